"""The service path's plan, without a service: a host's producer takes from the sampler only the
steps its first job's rows reach, however long the epoch, and the rows that come back, in any
order, twice, or too far ahead, are handed on once each, step by step in the plan's order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from feedpipe.core.sampler import Sampler
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.sources import ArraySource, SampleSpec
from feedpipe.core.split import ReplicaSplit
from feedpipe.core.state import Position
from feedpipe.service import client as service_module
from feedpipe.service import producer as producer_module

BILLION = 10**9
GLOBAL_BATCH = 4096


class CountingSampler(Sampler):
    """A sampler that counts the steps taken from its plans, and fails past `most` of them
    (listing an epoch of 1e9 samples would take gigabytes)."""

    taken = 0
    most = 10**5

    def steps(self, epoch, start=0):
        for step in super().steps(epoch, start):
            self.taken += 1
            assert self.taken <= self.most, f"{self.taken} steps taken from the plan"
            yield step


class FirstJob(Exception):
    """Stops the producer where its first job would start."""


class Pool:
    """`slots` host slots of `rows` int64 rows each, taken and given back as the pipeline's."""

    def __init__(self, rows: int, slots: int):
        layout = SlotLayout(SampleSpec.of(np.int64(0)), ReplicaSplit(rows, 1))
        self.free = [HostSlot(layout) for _ in range(slots)]

    def try_acquire(self) -> HostSlot | None:
        return self.free.pop() if self.free else None

    def acquire(self) -> HostSlot:
        assert self.free, "the producer waited for a slot the consumer could not give back"
        return self.free.pop()

    def give_back(self, slot: HostSlot) -> None:
        self.free.append(slot)

    def check_stop(self) -> None:
        pass


def first_job(sampler: Sampler, start: Position) -> tuple[np.ndarray, np.ndarray, int]:
    """The sample indices and positions of the first job a service producer over `sampler`
    asks for from `start` (no service: its start is recorded instead), and its rows a job."""
    features = np.zeros((1, 3), np.float32)
    work = service_module.ServiceWork(ArraySource((features, np.zeros(1, np.int64))), None, 0)
    producer = producer_module.ServiceProducer(work, "grpc://localhost:0", sampler)
    asked = []

    def record(indices, epoch, positions):
        asked.append((indices, positions))
        raise FirstJob

    producer._start = record
    with pytest.raises(FirstJob):
        next(producer.slots(start, Pool(1, 0)))
    ((indices, positions),) = asked
    return indices, positions, work.rows_per_job


@pytest.mark.parametrize("hosts", [1, 64])
@pytest.mark.parametrize("step", [0, 100_000])
def test_the_first_job_of_an_epoch_or_a_restore_plans_only_the_steps_its_rows_reach(hosts, step):
    """1e9 samples shuffled (a lazy order) in global batches of 4096, on host 0 of 1 or 64: the
    producer takes as many steps as the first job's rows need, not the epoch's 244,141, and
    asks for their rows in the plan's order."""
    share = range(0, GLOBAL_BATCH // hosts)
    sampler = CountingSampler(BILLION, GLOBAL_BATCH, shuffle=True, share=share)
    assert sampler.lazy
    indices, positions, rows_per_job = first_job(sampler, Position(2, step))
    reach = -(-rows_per_job // len(share))
    assert sampler.taken == reach
    planned = itertools.islice(sampler.steps(2, step), reach)
    expected = np.concatenate([planned_step.rows for planned_step in planned])
    np.testing.assert_array_equal(indices, expected[:rows_per_job])
    np.testing.assert_array_equal(positions, np.arange(rows_per_job))


def value(indices: np.ndarray) -> np.ndarray:
    """What the service makes of samples `indices` here: their own number, told apart from 0."""
    return indices * 10 + 1


def served(rows: producer_module._Rows, samples: np.ndarray, job_rows: int, seed: int):
    """Plays a service against `rows` until its epoch is handed on, and returns what it handed
    on (each step and its slot's values, the slot then given back: the consumer takes each step at
    once), the most rows it kept outside the slots, and how many jobs sent rows too far ahead.
    Each job asks for the first `job_rows` rows missing and sends them in elements of 1 to 7
    rows, shuffled, with a few rows sent before (their steps handed on, some) sent again; a job
    whose rows came too far ahead is dropped, as the producer drops it. `samples` are the
    sample indices of the rows' positions."""
    rng = np.random.default_rng(seed)
    got, most_kept, too_far = [], 0, 0
    sent = np.zeros(0, np.int64)
    while not rows.done():
        positions, indices = rows.missing(job_rows)
        np.testing.assert_array_equal(indices, samples[positions])
        again = rng.choice(sent, min(3, len(sent)), replace=False)
        positions = np.concatenate([rng.permutation(positions), again])
        sent = np.union1d(sent, positions)
        cut = np.cumsum(rng.integers(1, 8, size=len(positions)))
        for part in np.split(positions, cut[cut < len(positions)]):
            kept_all = rows.arrived(part, [value(samples[part])])
            most_kept = max(most_kept, len(rows.kept))
            for step, slot in rows.deliver():
                got.append((step, slot.regions[0][0].copy()))
                rows.supply.give_back(slot)
            if not kept_all:
                too_far += 1
                break  # the producer asks a new job for the rows still missing
    return got, most_kept, too_far


@pytest.mark.parametrize(
    ("start", "job_rows", "held"),
    [(0, 40, 1000), (0, 40, 5), (7, 13, 3), (12, 1, 0)],
    ids=["whole_epoch", "rows_too_far_ahead", "restart_mid_epoch", "one_row_a_job"],
)
def test_rows_in_any_order_are_handed_on_once_each_in_the_plans_order(start, job_rows, held):
    """103 samples shuffled in global batches of 8 (the last with 7 real rows and a padding
    one), from step `start`, through a window of 2 open slots and `held` rows kept past them;
    rows arrive shuffled, some twice, and past the held ones they are left missing and asked
    for again: every step from `start` on comes once, in order, its rows each its own sample's
    value, and no more rows are kept than the window's and `held`."""
    sampler = Sampler(103, 8, shuffle=True, seed=4)
    plan = list(sampler.steps(1, start))
    pool = Pool(8, 3)
    rows = producer_module._Rows(sampler.steps(1, start), pool, window=2, held=held)
    samples = np.concatenate([step.rows for step in plan])
    got, most_kept, too_far = served(rows, samples, job_rows, seed=start + job_rows)
    assert [step.index for step, _ in got] == list(range(start, len(sampler)))
    for (step, values), planned in zip(got, plan, strict=True):
        np.testing.assert_array_equal(step.rows, planned.rows)
        np.testing.assert_array_equal(values, value(np.resize(planned.rows, 8)))  # padded
    assert most_kept <= 2 * 8 + held
    assert (too_far > 0) == (job_rows > 2 * 8 + held), "rows past the held ones were refused"
    assert len(pool.free) == 3, "every slot came back"
