"""In-memory arrays gathered over row ranges in several threads (`feedpipe.core.gather`): every
batch bit-equal to the single `np.take` of `workers=0`, in the same order, from any position;
the threads sized from the cores and the batch; a batch gathered ahead given back whole when
the stream stops; an error in a gather thread reaching the loop. Through the feeder:
tests/test_gather_threads.py."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from feedpipe.core import env
from feedpipe.core import gather as gather_module
from feedpipe.core.gather import GatherPool, plan_gather, row_ranges
from feedpipe.core.producers import ThreadProducer
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import EpochEnd, Sampler
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.sources import ArraySource
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
    monkeypatch.delenv(env.GATHER_THREADS, raising=False)
    monkeypatch.setattr(gather_module, "cores", lambda: 16)
    mib = 1 << 20
    assert plan_gather(64 * mib).threads == 16
    assert plan_gather(64 * mib).reason == "16 threads: 16 cores, batches of 64.0 MiB"
    assert plan_gather(7 * mib + 5).threads == 3
    assert "at least 2 MiB a thread" in plan_gather(7 * mib).reason
    assert plan_gather(3 * mib).threads == 1
    monkeypatch.setenv(env.GATHER_THREADS, "2")
    assert plan_gather(64 * mib).threads == 2
    assert "FEEDPIPE_GATHER_THREADS=2" in plan_gather(64 * mib).reason


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_thread_count_in_the_environment_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(env.GATHER_THREADS, value)
    with pytest.raises(ValueError, match=rf"FEEDPIPE_GATHER_THREADS='{value}' must be a whole"):
        plan_gather(1 << 30)
