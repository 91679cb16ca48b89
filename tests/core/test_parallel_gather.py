"""In-memory arrays gathered over row ranges in several threads (`feedpipe.core.gather`): every
batch bit-equal to the single `np.take` of `workers=0`, in the same order, from any position;
the threads sized from the cores and the batch and said in `describe()`; none left after
`close()`, whatever was being gathered; an error in a gather thread reaching the loop."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import optree
import pytest

import feedpipe as fp
from feedpipe.core import gather as gather_module
from feedpipe.core.gather import GatherPool, plan_gather, row_ranges
from feedpipe.core.producers import ThreadProducer
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import EpochEnd, Sampler
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.source import ArraySource
from feedpipe.core.split import HostShare, ReplicaSplit
from feedpipe.core.state import Position
from feedpipe.core.writer import SampleWriter, first_look
from tests.conftest import feedpipe_threads

START = Position(0, 0)
LENGTH = 203  # no batch size below divides it, nor do the thread counts divide the batches


class Supply:
    """Fresh slots on demand (none spare for a gather ahead where `spare` is False); keeps the
    ones given back."""

    def __init__(self, layout: SlotLayout, spare: bool = True):
        self.layout = layout
        self.spare = spare
        self.given_back: list[HostSlot] = []

    def acquire(self) -> HostSlot:
        return HostSlot(self.layout)

    def try_acquire(self) -> HostSlot | None:
        return HostSlot(self.layout) if self.spare else None

    def give_back(self, slot: HostSlot) -> None:
        self.given_back.append(slot)

    def check_stop(self) -> None:
        pass


def arrays(kind: str, length: int = LENGTH):
    """Random fields of every dtype a slot holds: one array, a tuple or a dict."""
    rng = np.random.default_rng(7)
    image = rng.random((length, 5, 3), dtype=np.float32)
    if kind == "array":
        return image
    fields = (
        image,
        rng.integers(-(2**62), 2**62, size=length, dtype=np.int64),
        rng.random((length, 7)) < 0.5,
        rng.standard_normal((length, 2, 2)).astype(np.float16),
        rng.integers(0, 255, size=(length, 3), dtype=np.uint8),
    )
    if kind == "tuple":
        return fields
    return dict(zip(("image", "id", "flags", "half", "bytes"), fields, strict=True))


def producer_over(source, batch, threads, *, replicas=2, share=None, **sampler_options):
    """The producer of `workers=0` over `source`, gathering in `threads` (1: no pool), and the
    layout of its slots."""
    spec, _ = first_look(source, None, 0)
    host = HostShare(batch) if share is None else share
    sampler = Sampler(source.length, batch, share=host.rows, **sampler_options)
    rule = Remainder(sampler_options.get("remainder", "pad"), batch)
    pool = GatherPool(source.take, threads) if threads > 1 else None
    producer = ThreadProducer(
        SampleWriter(source, spec, None, 0), batch, sampler, rule, gather=pool
    )
    split = host.local_split if share is not None else ReplicaSplit(batch, replicas)
    return producer, SlotLayout(spec, split)


def made(producer, layout, start=START, count=12, spare=True):
    """The first `count` items from `start`: `EpochEnd`s as they are, each batch as its step's
    (epoch, index, num_valid) and a copy of each region of its slot."""
    supply = Supply(layout, spare)
    items = []
    for item in itertools.islice(producer.slots(start, supply), count):
        if isinstance(item, EpochEnd):
            items.append(item)
        else:
            step, slot = item
            regions = [region.copy() for replica in slot.regions for region in replica]
            items.append((step.epoch, step.index, step.num_valid, regions))
    return items


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        if isinstance(theirs, EpochEnd):
            assert mine == theirs
        else:
            assert mine[:3] == theirs[:3]
            for region, expected_region in zip(mine[3], theirs[3], strict=True):
                assert region.dtype == expected_region.dtype
                np.testing.assert_array_equal(region, expected_region)


@pytest.mark.parametrize("kind", ["array", "tuple", "dict"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.filterwarnings("ignore:remainder=.drop. leaves out")
def test_batches_gathered_in_threads_are_the_single_takes_bit_for_bit(kind, shuffle, remainder):
    source = ArraySource(arrays(kind))
    options = {"shuffle": shuffle, "seed": 3, "remainder": remainder}
    expected = made(*producer_over(source, 24, 1, **options), count=40)
    assert sum(isinstance(item, EpochEnd) for item in expected) >= 3  # epochs with a last batch
    for threads in (2, 3, 5):
        producer, layout = producer_over(source, 24, threads, **options)
        try:
            assert_same_batches(made(producer, layout, count=40), expected)
            assert_same_batches(made(producer, layout, count=40, spare=False), expected)
        finally:
            producer.close()


def test_a_batch_of_fewer_rows_than_threads_is_still_whole():
    source = ArraySource(arrays("tuple", length=5))
    expected = made(*producer_over(source, 4, 1, replicas=4), count=6)
    producer, layout = producer_over(source, 4, 7, replicas=4)
    try:
        assert_same_batches(made(producer, layout, count=6), expected)
    finally:
        producer.close()


def test_a_hosts_share_gathers_only_its_rows_and_the_same_bytes():
    source = ArraySource(arrays("dict"))
    for host in (0, 1, 2):
        share = HostShare(24, num_hosts=3, host=host, local_replicas=2)
        options = {"share": share, "shuffle": True}
        expected = made(*producer_over(source, 24, 1, **options), count=30)
        producer, layout = producer_over(source, 24, 3, **options)
        try:
            assert_same_batches(made(producer, layout, count=30), expected)
        finally:
            producer.close()


def test_a_resumed_producer_gathers_the_stream_from_its_position():
    source = ArraySource(arrays("tuple"))
    start = Position(1, 3)
    expected = made(*producer_over(source, 16, 1, shuffle=True), start=start, count=25)
    producer, layout = producer_over(source, 16, 3, shuffle=True)
    try:
        made(producer, layout, count=5)  # a stream stopped early, as a re-iterated feeder's
        assert_same_batches(made(producer, layout, start=start, count=25), expected)
    finally:
        producer.close()


def test_a_stream_closed_with_a_batch_gathered_ahead_gives_its_slot_back_written():
    source = ArraySource(arrays("array"))
    producer, layout = producer_over(source, 16, 3)
    supply = Supply(layout)
    slots = producer.slots(Position(0, 0), supply)
    step, _ = next(slots)
    slots.close()
    try:
        (ahead,) = supply.given_back
        expected = np.take(source.arrays[0], np.arange(16, 32), axis=0)
        np.testing.assert_array_equal(np.concatenate([r[0] for r in ahead.regions]), expected)
    finally:
        producer.close()
    assert step.index == 0
    assert not feedpipe_threads()


def test_an_error_in_a_gather_thread_keeps_its_type_and_names_the_thread_and_rows():
    helped = threading.Event()

    class Broken(ArraySource):
        def take(self, indices, outs):
            if threading.current_thread().name.startswith("feedpipe-gather"):
                helped.set()
                raise MemoryError("no room")
            helped.wait(5)  # the producer's range waits for the thread to take the other one
            super().take(indices, outs)

    source = Broken(arrays("array"))
    producer, layout = producer_over(source, 16, 2)
    try:
        with pytest.raises(MemoryError, match="no room") as raised:
            made(producer, layout, count=3, spare=False)
    finally:
        producer.close()
    (note,) = raised.value.__notes__
    assert "feedpipe-gather-1" in note and "rows 8:16 of step 0 of epoch 0" in note


def test_row_ranges_cover_every_row_once_in_order():
    for count, parts in [(10, 3), (3, 8), (16, 4), (1, 1), (7, 7)]:
        ranges = row_ranges(count, parts)
        assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]]
        assert ranges[-1][1] == count and len(ranges) == min(parts, count)
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1


def test_threads_follow_the_cores_and_the_batch(monkeypatch):
    monkeypatch.delenv(gather_module.THREADS_ENV, raising=False)
    monkeypatch.setattr(gather_module, "cores", lambda: 16)
    mib = 1 << 20
    assert plan_gather(64 * mib).threads == 16
    assert plan_gather(64 * mib).reason == "16 threads: 16 cores, batches of 64.0 MiB"
    assert plan_gather(7 * mib + 5).threads == 3
    assert "at least 2 MiB a thread" in plan_gather(7 * mib).reason
    assert plan_gather(3 * mib).threads == 1
    monkeypatch.setenv(gather_module.THREADS_ENV, "2")
    assert plan_gather(64 * mib).threads == 2
    assert "FEEDPIPE_GATHER_THREADS=2" in plan_gather(64 * mib).reason


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_thread_count_in_the_environment_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(gather_module.THREADS_ENV, value)
    with pytest.raises(ValueError, match=rf"FEEDPIPE_GATHER_THREADS='{value}' must be a whole"):
        plan_gather(1 << 30)


# ---- through the feeder ---------------------------------------------------------------------


@pytest.fixture
def threads(monkeypatch):
    """Sets the gather threads of the feeders built next, however small their batches."""
    monkeypatch.setattr(gather_module, "MIN_RANGE_BYTES", 1)

    def use(count: int) -> None:
        monkeypatch.setenv(gather_module.THREADS_ENV, str(count))

    return use


def batches(feeder, count=None) -> list[list[np.ndarray]]:
    """Every leaf of every replica of the next `count` batches (an epoch where None)."""
    return [
        [np.asarray(leaf) for replica in batch.replicas for leaf in optree.tree_leaves(replica)]
        + [np.asarray(mask) for mask in batch.masks]
        for batch in itertools.islice(feeder, count)
    ]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_a_feeder_gathering_in_threads_gives_workers_0s_batches(devices, threads):
    source = arrays("dict")
    options = {"devices": devices, "shuffle": True, "seed": 5}
    threads(1)
    with fp.Feeder(source, 24, **options) as feeder:
        assert feeder.describe().gather_threads == 1
        expected = [batches(feeder) for _ in range(2)]
    threads(3)
    with fp.Feeder(source, 24, **options) as feeder:
        described = feeder.describe()
        assert (described.gather_threads, described.slots.count) == (3, 5)
        assert "FEEDPIPE_GATHER_THREADS=3" in described.gather_chosen
        for epoch in expected:
            assert_same(batches(feeder), epoch)


def test_a_state_taken_mid_epoch_resumes_the_same_batches(devices, threads):
    source = arrays("tuple")
    threads(1)
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        expected = batches(feeder, 20)
    threads(2)
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        assert_same(batches(feeder, 5), expected[:5])
        state = feeder.get_state()
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        feeder.set_state(state)
        assert_same(batches(feeder, 15), expected[5:])


def test_a_re_iterated_feeder_gathers_what_workers_0_gives(devices, threads):
    source = arrays("array")
    runs = []
    for count in (1, 3):
        threads(count)
        with fp.Feeder(source, 16, devices=devices) as feeder:
            runs.append(batches(feeder, 3) + batches(feeder) + batches(feeder, 2))
    assert_same(runs[1], runs[0])


def test_closing_while_a_batch_is_gathered_leaves_no_thread(devices, threads):
    threads(2)
    feeder = fp.Feeder(arrays("array", length=4096), 512, devices=devices, shuffle=True)
    next(iter(feeder))
    assert any(name.startswith("feedpipe-gather") for name in feedpipe_threads())
    feeder.close()
    assert not feedpipe_threads()


def test_arrays_of_small_batches_are_gathered_in_one_thread_and_describe_says_why(devices):
    with fp.Feeder(arrays("array"), 8, devices=devices) as feeder:
        described = feeder.describe()
        assert described.gather_threads == 1
        assert described.gather_chosen.startswith("1 thread: batches of 0.0 MiB")
        assert described.slots.count == 4  # nothing is gathered ahead
        next(iter(feeder))
        assert not [t for t in feedpipe_threads() if t.startswith("feedpipe-gather")]


def test_sources_made_otherwise_have_no_gather_threads(devices):
    source = arrays("array")
    with fp.Feeder(source, 8, devices=devices, transform=lambda x: x) as feeder:
        described = feeder.describe()
    assert (described.gather_threads, described.gather_chosen) == (0, None)
