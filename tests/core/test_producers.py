"""The producer of `workers=0`: the plan of each epoch turned into filled slots in order, from
any position, with a stream's last rows padded, dropped or refused by the remainder rule, and
every slot it does not deliver given back. (The worker pool's producer is held to the same
batches in tests/test_workers.py and tests/jax_layer/test_jax_feeder.py.)"""

from __future__ import annotations

import itertools

import pytest

from feedpipe.core.producers import ThreadProducer
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import EpochEnd, Sampler
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.sources import GeneratorSource, MapSource
from feedpipe.core.split import ReplicaSplit
from feedpipe.core.state import Position
from feedpipe.core.writer import SampleWriter, first_look
from tests.worker_fakes import IndexSource, sharded_range

GLOBAL_BATCH = 4
START = Position(0, 0)


class Supply:
    """Fresh slots on demand; keeps the ones given back."""

    def __init__(self, layout: SlotLayout):
        self.layout = layout
        self.given_back: list[HostSlot] = []

    def acquire(self) -> HostSlot:
        return HostSlot(self.layout)

    def try_acquire(self) -> HostSlot:
        return HostSlot(self.layout)

    def give_back(self, slot: HostSlot) -> None:
        self.given_back.append(slot)

    def check_stop(self) -> None:
        pass

    def service_waited(self, seconds: float, lagging: bool = False) -> None:
        pass

    def take_dropped(self) -> list[int]:
        return []


class EpochCounting(MapSource):
    """Counts the calls of `on_epoch_end` (where a PyDataset's own hook runs)."""

    def __init__(self, data):
        super().__init__(data)
        self.epochs_ended = 0

    def on_epoch_end(self) -> None:
        self.epochs_ended += 1


def thread_producer(source, remainder="pad", **sampler_options):
    """The producer of `workers=0` over `source` (rows cut over 2 replicas), and its supply."""
    spec, _ = first_look(source, None, 0)
    sampler = None
    if source.indexed:
        sampler = Sampler(source.length, GLOBAL_BATCH, remainder=remainder, **sampler_options)
    rule = Remainder(remainder, GLOBAL_BATCH)
    producer = ThreadProducer(SampleWriter(source, spec, None, 0), GLOBAL_BATCH, sampler, rule)
    return producer, Supply(SlotLayout(spec, ReplicaSplit(GLOBAL_BATCH, 2)))


def produced(source, remainder="pad", start=START, count=20, **sampler_options):
    """The first `count` items the producer yields from `start`: `EpochEnd`s as they are, each
    step as (epoch, index, num_valid, labels of every row); and the supply."""
    producer, supply = thread_producer(source, remainder, **sampler_options)
    items = []
    for item in itertools.islice(producer.slots(start, supply), count):
        if isinstance(item, EpochEnd):
            items.append(item)
        else:
            step, slot = item
            rows = [int(v) for replica in slot.regions for v in replica[1]]
            items.append((step.epoch, step.index, step.num_valid, rows))
    return items, supply


@pytest.mark.filterwarnings("ignore:remainder=.drop. leaves out")
def test_an_indexed_epoch_gives_its_steps_in_order_then_its_end_with_the_dropped_count():
    source = EpochCounting(IndexSource(10))
    items, supply = produced(source, remainder="drop", count=6)
    assert items == [
        (0, 0, 4, [0, 1, 2, 3]),
        (0, 1, 4, [4, 5, 6, 7]),
        EpochEnd(0, dropped=2),
        (1, 0, 4, [0, 1, 2, 3]),
        (1, 1, 4, [4, 5, 6, 7]),
        EpochEnd(1, dropped=2),
    ]
    assert source.epochs_ended == 2
    assert supply.given_back == []


def test_an_indexed_epochs_padded_last_step_repeats_its_real_rows():
    items, _ = produced(MapSource(IndexSource(10)), count=4)
    assert items[2:] == [(0, 2, 2, [8, 9, 8, 9]), EpochEnd(0)]


def test_a_resumed_producer_starts_at_the_step_and_goes_on_into_the_next_epochs():
    source = MapSource(IndexSource(12))
    whole, _ = produced(source, count=12, shuffle=True, seed=4)
    resumed, _ = produced(source, start=Position(1, 2), count=5, shuffle=True, seed=4)
    assert resumed == whole[6:11]
    assert resumed[0][:2] == (1, 2)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_a_streams_last_rows_are_padded_or_dropped_and_a_dropped_slot_is_given_back(remainder):
    items, supply = produced(GeneratorSource(sharded_range(10)), remainder=remainder, count=4)
    assert items[:2] == [(0, 0, 4, [0, 1, 2, 3]), (0, 1, 4, [4, 5, 6, 7])]
    if remainder == "pad":
        assert items[2:] == [(0, 2, 2, [8, 9, 8, 9]), EpochEnd(0)]
        assert supply.given_back == []
    else:
        assert items[2:] == [EpochEnd(0, dropped=2), (1, 0, 4, [0, 1, 2, 3])]
        assert len(supply.given_back) == 1


def test_a_stream_that_ends_off_a_multiple_is_refused_under_error_after_its_whole_batches():
    producer, supply = thread_producer(GeneratorSource(sharded_range(10)), "error")
    slots = producer.slots(START, supply)
    assert [next(slots)[0].index for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match=r'`remainder`="error", but epoch 0 .* 10 samples, 2 past'):
        next(slots)
    assert len(supply.given_back) == 1


def test_a_stream_resumed_mid_epoch_skips_exactly_the_batches_taken():
    items, _ = produced(GeneratorSource(sharded_range(10)), start=Position(0, 1), count=3)
    assert items == [(0, 1, 4, [4, 5, 6, 7]), (0, 2, 2, [8, 9, 8, 9]), EpochEnd(0)]
