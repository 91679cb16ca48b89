"""The JAX feeder on feedpipe's own copy streams: every sample once per epoch, every batch exact
whether the loop keeps it, drops it at once, or dispatches steps on it without waiting; the device
blocks stay flat across epochs; and describe() and stats() say which copy path runs, and why.

No GPU is needed: the JAX layer is given host memory posing as each CPU device's
(`tests.device_fakes.HostMemory`), which JAX's CPU devices import through DLPack as its GPU
devices import CUDA memory. The fake checks that no copy overwrites memory still handed out.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core import dlpack
from feedpipe.core.copy_engine import OWN_STREAMS, CopyPath, block_limit
from feedpipe.core.sampler import Sampler
from tests.device_fakes import HostMemory
from tests.worker_fakes import index_pairs

DEPTH = 2


@pytest.fixture
def fake_gpus(monkeypatch):
    """Every JAX feeder made in the test copies on "its own streams" into fake device memory."""
    made: list[HostMemory] = []

    def memories(devices):
        fresh = [HostMemory(device.local_hardware_id) for device in devices]
        made.extend(fresh)
        return fresh, CopyPath(OWN_STREAMS, "fake device memory for a test")

    monkeypatch.setattr("feedpipe.jax.layer._device_memories", memories)
    yield made
    deadline = time.monotonic() + 2.0  # JAX releases a step's inputs once the step has run
    while dlpack.exports_alive() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert dlpack.exports_alive() == 0, "every export was released once its arrays died"


def ids(batch) -> list[int]:
    (_, y), mask = batch.distributed()
    return np.asarray(y)[np.asarray(mask)].tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_arrives_once_per_epoch_in_the_cores_order_over_three_epochs(
    devices, fake_gpus, workers
):
    length, size = 37, 8
    with fp.Feeder(
        index_pairs(length), size, devices=devices, shuffle=True, seed=5, workers=workers
    ) as feeder:
        plan = Sampler(length, size, shuffle=True, seed=5)
        blocks = []
        for epoch in range(3):
            got = []
            for batch in feeder:
                (x, y), _ = batch.distributed()
                assert (np.asarray(x) == np.asarray(y)[:, None]).all(), "rows mixed up"
                got += ids(batch)
            assert got == plan.order(epoch).tolist()
            blocks.append(feeder.stats().device_blocks)
        assert max(blocks) <= block_limit(DEPTH, 0) * len(devices), "bounded over the epochs"
        assert sum(memory.copies for memory in fake_gpus) > 0


def test_each_replicas_rows_sit_in_its_own_devices_memory(devices, fake_gpus):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        for memory, device, (x, y) in zip(fake_gpus, devices, batch.replicas, strict=True):
            assert x.devices() == {device} and y.devices() == {device}
            for array in (x, y):
                address = array.unsafe_buffer_pointer()
                assert any(
                    base <= address < base + block.nbytes for base, block in memory.blocks.items()
                ), "imported where it was copied, not copied again"
        del batch


def test_a_kept_batch_keeps_its_values_while_the_other_blocks_are_reused(devices, fake_gpus):
    x, y = index_pairs(400)
    with fp.Feeder((x, y), 8, devices=devices, depth=1) as feeder:
        batches = iter(feeder)
        first = next(batches)
        expected = [np.asarray(label).copy() for _, label in first.replicas]
        for _ in range(30):  # every other block is reused many times meanwhile
            next(batches)
        assert [np.asarray(label).tolist() for _, label in first.replicas] == [
            e.tolist() for e in expected
        ]
        del first, batches


def test_steps_dispatched_without_waiting_read_exactly_their_batch(devices, fake_gpus):
    # The blocks a queued step still reads are held, not reused; how many steps JAX queues
    # is its own, so the blocks are bounded by the steps in flight, not by a fixed count.
    length, size = 96, 8
    step = jax.jit(lambda total, x, y, mask: total + jnp.sum(jnp.where(mask, y, 0) * x[:, 0]))
    with fp.Feeder(index_pairs(length), size, devices=devices, shuffle=True) as feeder:
        total = jnp.zeros((), jnp.float32)
        for _ in range(3):
            for batch in feeder:  # nothing waits for a step; each batch is dropped at once
                (x, y), mask = batch.distributed()
                total = step(total, x, y, mask)
        assert float(total) == 3 * sum(i * i for i in range(length))


def test_a_step_that_donates_a_staged_batch_writes_its_output_into_jaxs_own_memory(
    devices, fake_gpus
):
    double = jax.jit(lambda x: x * 2, donate_argnums=0)
    with fp.Feeder(index_pairs(16), 8, devices=devices[:1]) as feeder:
        for batch in feeder:
            x = batch.replicas[0][0]
            expected = np.asarray(x) * 2
            out = double(x)
            assert (np.asarray(out) == expected).all()
            address = out.unsafe_buffer_pointer()
            assert not any(
                base <= address < base + block.nbytes
                for memory in fake_gpus
                for base, block in memory.blocks.items()
            ), "the output must not live in a block feedpipe will reuse"
            del batch, x, out


def test_a_64_bit_field_jax_narrows_crosses_narrowed_and_exact(devices, fake_gpus):
    x, y = index_pairs(24)
    with fp.Feeder((x, y.astype(np.int64)), 8, devices=devices) as feeder:
        got = []
        for batch in feeder:
            (bx, by), mask = batch.distributed()
            assert by.dtype == np.int32
            assert (np.asarray(bx)[:, 0] == np.asarray(by)).all()
            got += np.asarray(by)[np.asarray(mask)].tolist()
        assert sorted(got) == list(range(24))


def test_describe_and_stats_say_the_batches_cross_on_feedpipes_own_streams(devices, fake_gpus):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        assert feeder.describe().copy_path == OWN_STREAMS
        assert feeder.describe().copy_path_reason == "fake device memory for a test"
        for _ in feeder:
            pass
        stats = feeder.stats()
        assert stats.copy_path == OWN_STREAMS and stats.copies >= 2  # the next epoch may be staged
        assert stats.device_blocks >= len(devices)
        assert OWN_STREAMS in str(stats)


def test_stats_time_each_staging_stage_and_a_fence_covers_many_batches(devices, fake_gpus):
    with fp.Feeder(index_pairs(64), 8, devices=devices, shuffle=True) as feeder:
        for _ in range(25):  # 200 batches, each dropped as the next is taken
            for _ in feeder:
                pass
        stats = feeder.stats()
    assert set(stats.stage_ms) == {"gather", "fence", "copy issued", "copy waited", "import"}
    assert all(ms > 0 for ms in stats.stage_ms.values())
    assert stats.staged_batches >= stats.copies >= 200
    assert 0 < stats.fences_per_batch <= 0.1, "one fence covers the blocks of many batches"
    assert "staging ms a batch: gather" in str(stats) and "fences a batch" in str(stats)


def test_a_dtype_dlpack_cannot_name_falls_back_to_device_put_and_says_which_field(
    devices, fake_gpus
):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.arange(32, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(16, 2)
    with fp.Feeder({"x": x, "y": np.arange(16, dtype=np.int32)}, 8, devices=devices) as feeder:
        description = feeder.describe()
        assert description.copy_path == "jax.device_put"
        assert "field ['x'] has dtype float8_e4m3fn" in description.copy_path_reason
        assert all(memory.closed for memory in fake_gpus)
        batch = next(iter(feeder))
        assert batch.replicas[0]["x"].dtype == ml_dtypes.float8_e4m3fn
        del batch


def test_closing_the_feeder_frees_its_blocks_and_a_held_batch_keeps_its_own(devices, fake_gpus):
    feeder = fp.Feeder(index_pairs(64), 8, devices=devices)
    batches = iter(feeder)
    held = next(batches)
    next(batches)
    del batches
    feeder.close()
    assert [len(memory.blocks) for memory in fake_gpus] == [1] * len(devices)
    assert ids(held) == list(range(8))
    del held
    gc.collect()
    with fp.Feeder(index_pairs(8), 8, devices=devices) as later:
        next(iter(later))  # the next engine made (or closed) frees the rest
    assert [len(memory.blocks) for memory in fake_gpus[: len(devices)]] == [0] * len(devices)


def test_on_cpu_devices_describe_says_no_batch_crosses(devices):
    with fp.Feeder(index_pairs(16), 8, devices=devices) as feeder:
        description = feeder.describe()
        assert description.copy_path == "none"
        assert "CPUs" in description.copy_path_reason
        for _ in feeder:
            pass
        assert feeder.stats().copy_path is None


@pytest.mark.parametrize("direct", ["missing", "refused", "other arrays"])
def test_where_the_direct_import_is_missing_or_wrong_the_public_one_gives_exact_batches(
    devices, fake_gpus, monkeypatch, direct
):
    from feedpipe.jax import stage

    def refused(export, device):
        raise TypeError("dlpack_managed_tensor_to_buffer() takes 4 positional arguments")

    def other(export, device):
        return jnp.zeros(export.shape[1:], export.dtype)  # the wrong shape

    taken = {"missing": None, "refused": refused, "other arrays": other}[direct]
    monkeypatch.setattr(stage, "_direct_import", lambda: taken)
    public = []
    monkeypatch.setattr(
        stage, "_public_import", lambda e, d: public.append(1) or jax.dlpack.from_dlpack(e, d)
    )
    plan = Sampler(20, 8, shuffle=True, seed=1)
    with fp.Feeder(index_pairs(20), 8, devices=devices, shuffle=True, seed=1) as feeder:
        got = []
        for batch in feeder:
            (x, y), _ = batch.distributed()
            assert (np.asarray(x) == np.asarray(y)[:, None]).all()
            got += ids(batch)
    assert got == plan.order(0).tolist()
    assert len(public) >= 2 * len(devices) * 3, "every field of every batch imported publicly"
