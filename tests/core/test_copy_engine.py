"""The copy engine's bookkeeping: a device block is written only once every array made from it is
released and a fence behind that release has run; one fence covers many releases; the blocks
stay bounded whether the device runs behind or the consumer keeps batches; a capsule nobody
consumed still releases; each stage of a copy is timed; and where no CUDA is at hand the reason
says so.

The device is host memory posing as one (`tests.device_fakes.HostMemory`) and the consumer is
numpy's `from_dlpack`, which releases an export when its array dies, as a framework does.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from feedpipe.core import dlpack
from feedpipe.core._cuda import OUT_OF_MEMORY, CudaError
from feedpipe.core.copy_engine import (
    BLOCK_ALIGN,
    IN_FLIGHT,
    LOW_WATER,
    SPARE_BLOCKS,
    SPARE_BYTES,
    STAGES,
    CopyEngine,
    LinkRate,
    block_limit,
    cuda_devices,
    undeliverable_field,
)
from feedpipe.core.env import COPY_STREAM
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit
from tests.device_fakes import POISON, HostMemory, ManualFence

REPLICAS = 2
PER_REPLICA = 3
DEPTH = 2
LIMIT = DEPTH + IN_FLIGHT + SPARE_BLOCKS
"""Blocks a device's pool makes before it waits for a fence (these blocks are small)."""


def make_engine(depth: int = DEPTH, memories=None):
    spec = SampleSpec.of((np.zeros(5, np.float32), np.zeros((), np.int32)))
    layout = SlotLayout(spec, ReplicaSplit(REPLICAS * PER_REPLICA, REPLICAS))
    memories = memories or [HostMemory(r) for r in range(REPLICAS)]
    fences: list[ManualFence] = []
    fence = [lambda: ManualFence(fences)] * REPLICAS
    engine = CopyEngine(memories, spec, PER_REPLICA, depth, fence)
    assert engine.pools[0].limit == block_limit(depth, engine.block_bytes)
    return engine, layout, memories, fences


def batch(layout: SlotLayout, value: int) -> list[list[np.ndarray]]:
    """A host slot's regions, every byte of batch `value` holding rows `value * 10 + row`."""
    memory = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(memory)
    for r, (features, labels) in enumerate(views):
        rows = value * 10 + r * PER_REPLICA + np.arange(PER_REPLICA)
        features[:] = rows[:, None]
        labels[:] = rows
    return views


def sources(views: list[list[np.ndarray]]) -> list[list[tuple[int, int]]]:
    """Each region's address and bytes, as the engine takes them."""
    return [[(region.ctypes.data, region.nbytes) for region in row] for row in views]


def stage(
    engine: CopyEngine, layout: SlotLayout, value: int, stage_s: dict | None = None
) -> list[list[np.ndarray]]:
    """Batch `value` on the fake devices, as the consumer's arrays."""
    stage_s = dict.fromkeys(STAGES, 0.0) if stage_s is None else stage_s
    regions = batch(layout, value)  # alive until copied: the engine takes addresses
    with engine.copy(sources(regions), stage_s) as exports:
        return [[np.from_dlpack(export) for export in fields] for fields in exports]


def values(arrays: list[list[np.ndarray]]) -> list[int]:
    return [int(v) for fields in arrays for v in fields[1]]


def test_every_field_arrives_exactly_at_an_aligned_address_of_its_devices_memory():
    engine, layout, memories, _ = make_engine()
    arrays = stage(engine, layout, 7)
    assert values(arrays) == [70, 71, 72, 73, 74, 75]
    for memory, (features, labels) in zip(memories, arrays, strict=True):
        assert features.shape == (PER_REPLICA, 5) and labels.dtype == np.int32
        assert (features == labels[:, None]).all()
        for array in (features, labels):
            assert array.ctypes.data % BLOCK_ALIGN == 0
            assert any(
                base <= array.ctypes.data < base + block.nbytes
                for base, block in memory.blocks.items()
            )


def test_a_block_is_reused_only_after_its_arrays_are_released_and_a_fence_behind_them_ran():
    engine, layout, memories, fences = make_engine()
    first = stage(engine, layout, 0)
    first_block = {m.ordinal: set(m.blocks) for m in memories}
    del first
    gc.collect()
    kept = []
    value = 1
    while not fences:  # new blocks are made until only LOW_WATER more could be: then one fence
        kept.append(stage(engine, layout, value))
        value += 1
    assert engine.blocks == (LIMIT - LOW_WATER + 1) * REPLICAS
    assert len(fences) == REPLICAS, "one fence a device, behind the first batch's release"
    while engine.blocks < LIMIT * REPLICAS:  # the fence has not run: the block stays untouched
        kept.append(stage(engine, layout, value))
        value += 1
    for fence in fences:
        fence.ready = True
    reused = stage(engine, layout, value)
    assert engine.blocks == LIMIT * REPLICAS, "the fenced block is reused, not a new one made"
    assert all(reused[m.ordinal][0].ctypes.data in first_block[m.ordinal] for m in memories), (
        "the block reused is the first batch's"
    )
    assert values(reused) == [value * 10 + row for row in range(REPLICAS * PER_REPLICA)]
    assert [values(b)[0] for b in kept] == [v * 10 for v in range(1, value)], "kept intact"


def test_one_fence_covers_every_block_released_since_the_last():
    engine, layout, _, fences = make_engine()
    batches = 40 * LIMIT
    for value in range(batches):  # each batch dropped at once; the device keeps up
        arrays = stage(engine, layout, value)
        assert values(arrays)[0] == value * 10
        del arrays
        for fence in fences:
            fence.ready = True
    assert engine.blocks <= LIMIT * REPLICAS
    assert engine.fences == len(fences) / REPLICAS
    steady = SPARE_BLOCKS - LOW_WATER
    assert engine.fences <= batches / steady + 1, "about one fence per spare block"
    assert engine.fence_wait_s == 0


def test_the_spare_blocks_shrink_for_large_batches_but_always_leave_room_to_fence_ahead():
    assert block_limit(DEPTH, 1) == DEPTH + IN_FLIGHT + SPARE_BLOCKS
    assert block_limit(DEPTH, SPARE_BYTES // 4) == DEPTH + IN_FLIGHT + 4
    assert block_limit(DEPTH, SPARE_BYTES * 4) == DEPTH + IN_FLIGHT + LOW_WATER + 1


def test_when_the_device_runs_behind_the_blocks_stop_at_the_limit_and_a_fence_is_awaited():
    engine, layout, _, fences = make_engine()
    for value in range(4 * LIMIT):  # each batch dropped at once; no fence ever runs by itself
        arrays = stage(engine, layout, value)
        assert values(arrays)[0] == value * 10
        del arrays
    assert engine.blocks == LIMIT * REPLICAS
    assert sum(f.waited for f in fences) > 0
    assert engine.fence_wait_s > 0


def test_each_stage_of_a_copy_is_timed_and_the_link_rate_follows_the_copies():
    engine, layout, _, _ = make_engine()
    stage_s = dict.fromkeys(STAGES, 0.0)
    for value in range(5):
        stage(engine, layout, value, stage_s)
    assert set(stage_s) == {"fence", "copy issued", "copy waited", "import"}
    assert all(seconds > 0 for seconds in stage_s.values()), stage_s
    link = LinkRate()
    first = link.expected_s(2**20)
    for _ in range(60):
        link.observed(2**20, 1e-3)  # 1 MiB a millisecond: about 1 GB/s
    assert link.bytes_per_s == pytest.approx(2**20 / 1e-3, rel=0.01)
    assert link.expected_s(2**20) == pytest.approx(LinkRate.MARGIN * 1e-3 + LinkRate.FLOOR_S)
    assert link.expected_s(2**20) > first


def test_a_consumer_that_keeps_every_batch_gets_new_blocks_instead_of_a_wait_that_never_ends():
    engine, layout, _, fences = make_engine()
    kept = [stage(engine, layout, value) for value in range(3 * LIMIT)]
    assert engine.blocks == 3 * LIMIT * REPLICAS
    assert not any(f.waited for f in fences)
    assert [values(b)[0] for b in kept] == [v * 10 for v in range(3 * LIMIT)]


def test_kept_batches_keep_their_values_while_other_blocks_are_reused():
    engine, layout, _, fences = make_engine()
    kept = stage(engine, layout, 1)
    for value in range(2, 30):
        arrays = stage(engine, layout, value)
        del arrays
        for fence in fences:
            fence.ready = True
    assert values(kept) == [10, 11, 12, 13, 14, 15]
    assert engine.blocks <= (LIMIT + 1) * REPLICAS


def test_a_capsule_nobody_consumed_releases_its_block():
    engine, layout, _, _ = make_engine(depth=1)
    regions = batch(layout, 1)
    with engine.copy(sources(regions), dict.fromkeys(STAGES, 0.0)) as exports:
        unused = [fields[0].__dlpack__() for fields in exports]
    assert dlpack.exports_alive() == REPLICAS
    del unused
    gc.collect()
    assert dlpack.exports_alive() == 0
    stage(engine, layout, 2)
    assert engine.pools[0].held == 1, "only the batch just staged may still be read"


def test_a_failed_import_leaves_the_block_to_be_reused():
    engine, layout, _, _ = make_engine()
    regions = batch(layout, 1)
    with (
        pytest.raises(RuntimeError, match="import failed"),
        engine.copy(sources(regions), dict.fromkeys(STAGES, 0.0)),
    ):
        raise RuntimeError("import failed")
    arrays = stage(engine, layout, 2)
    assert values(arrays)[0] == 20
    engine.close()
    assert [len(m.blocks) for m in engine.memories] == [1] * REPLICAS, "the failed one freed"


def test_close_frees_released_blocks_at_once_and_held_ones_once_let_go():
    engine, layout, memories, fences = make_engine()
    dropped = stage(engine, layout, 1)
    held = stage(engine, layout, 2)
    del dropped
    gc.collect()
    engine.close()
    assert [len(m.blocks) for m in memories] == [1] * REPLICAS, "only the held batch's blocks"
    assert all(f.waited for f in fences), "close waits for the fence of what it frees"
    assert values(held) == [20, 21, 22, 23, 24, 25]
    del held
    gc.collect()
    make_engine()  # any engine made (or closed) later frees what closed ones left behind
    assert [len(m.blocks) for m in memories] == [0] * REPLICAS
    assert all(m.closed for m in memories)
    assert all((block == POISON).all() for m in memories for block in m.freed)
    engine.close()  # idempotent


def test_a_device_out_of_memory_names_the_preallocation_setting_and_the_way_out():
    full = CudaError("cuMemAlloc_v2", OUT_OF_MEMORY, "out of memory")
    engine, layout, _, _ = make_engine(memories=[HostMemory(r, full) for r in range(REPLICAS)])
    with pytest.raises(
        MemoryError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION.*FEEDPIPE_COPY_STREAM=0"
    ):
        stage(engine, layout, 1)


def test_without_a_cuda_driver_in_the_process_the_reason_says_so(monkeypatch):
    monkeypatch.delenv(COPY_STREAM, raising=False)
    memories, reason = cuda_devices([0])
    assert memories is None
    assert "no CUDA driver is loaded in this process" in reason


def test_the_switch_turns_the_engine_off_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(COPY_STREAM, "0")
    assert cuda_devices([0]) == (
        None,
        f"feedpipe's own copy streams were turned off with {COPY_STREAM}=0",
    )
    monkeypatch.setenv(COPY_STREAM, "sometimes")
    with pytest.raises(ValueError, match=r"FEEDPIPE_COPY_STREAM='sometimes' is neither on nor off"):
        cuda_devices([0])


def test_a_dtype_dlpack_cannot_name_is_found_by_field():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    spec = SampleSpec.of({"image": np.zeros(2, ml_dtypes.float8_e4m3fn), "label": np.int32(0)})
    assert "float8_e4m3fn" in undeliverable_field(spec)
    assert "image" in undeliverable_field(spec)
    bfloat = SampleSpec.of((np.zeros(2, ml_dtypes.bfloat16), np.zeros(2, np.bool_)))
    assert undeliverable_field(bfloat) is None


def test_a_wait_polls_for_its_expected_time_and_then_sleeps():
    from feedpipe.core._sync import poll_then_sleep

    answers = iter([False, False, True])
    slept = []
    poll_then_sleep(lambda: next(answers), lambda: slept.append(True), 10.0)
    assert slept == [], "done within the poll: no sleep"
    queries = []
    poll_then_sleep(lambda: queries.append(1) and False, lambda: slept.append(True), 0.002)
    assert slept == [True] and len(queries) >= 1
