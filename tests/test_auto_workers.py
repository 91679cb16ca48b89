"""`workers="auto"`: the same batches as `workers=0` while it measures, switches and settles;
what it picks for a waiting source; the sources it leaves alone and why; and what it says.

The trials are shortened (`TRIAL_S`), so that a small epoch sees every switch. Where a test
needs a given sequence of trials, the ranking is fixed (`SampleCost.settings`): what is under
test there is the switching, not the model (tests/core/test_cost.py holds the model)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core import auto, env
from feedpipe.core.cost import SampleCost, Setting
from tests import worker_fakes as wf
from tests.auto_fakes import HoldsPythonObjects, LoadsForeverInAWorker
from tests.conftest import feedpipe_processes
from tests.fakes import all_ids, host_batch_ids, real_ids

GLOBAL_BATCH = 8
MAX_EPOCHS = 30


@pytest.fixture(autouse=True)
def short_trials(monkeypatch):
    monkeypatch.setattr(auto, "TRIAL_S", 0.01)
    monkeypatch.setattr(auto, "TRIAL_BATCHES", 2)
    monkeypatch.setattr(auto, "WARM_BATCHES", 1)


def epochs(feeder, count: int = 2, ids=all_ids) -> list[list[int]]:
    return [ids(batch) for _ in range(count) for batch in feeder]


def reference(source, devices, count: int = 2, batch=GLOBAL_BATCH, **options) -> list[list[int]]:
    with fp.Feeder(source, batch, devices=devices, workers=0, **options) as feeder:
        return epochs(feeder, count)


class LockedSlowSource(wf.SlowSource):
    """A `SlowSource` holding a lock: it cannot be sent to a worker process."""

    def __init__(self, length: int):
        super().__init__(length, 0.001)
        self.lock = threading.Lock()


def ranked(*settings: Setting):
    """A fixed ranking, each setting predicted far above anything measured."""

    def settings_(self, target=math.inf, at_least_one=False):
        return list(settings)

    return settings_


def until_settled(feeder, devices, **options) -> None:
    """Reads epochs until `workers="auto"` has settled, and one more, each the same as
    `workers=0`'s epoch (from the same ids read without a delay)."""
    length, batch = len(feeder.source), feeder.options.global_batch_size
    expected = reference(wf.IndexSource(length), devices, MAX_EPOCHS, batch, **options)
    producer = feeder._assembly.producer
    for epoch in range(MAX_EPOCHS):
        per_epoch = len(expected) // MAX_EPOCHS
        assert epochs(feeder, 1) == expected[epoch * per_epoch : (epoch + 1) * per_epoch]
        if producer.settled and epoch > 0:
            return
    raise AssertionError(f"not settled after {MAX_EPOCHS} epochs: {producer.why}")


def test_a_waiting_source_gets_many_workers_and_the_batches_of_workers0(devices, monkeypatch):
    # Batches of 32 rows measured over 3 batches: a run of one row per thread would measure
    # the threads' start more than their rate.
    monkeypatch.setattr(auto, "TRIAL_S", 0.05)
    monkeypatch.setattr(auto, "TRIAL_BATCHES", 3)
    source = wf.SlowSource(640, 0.002)
    with fp.Feeder(source, 32, devices=devices, workers="auto", shuffle=True) as feeder:
        until_settled(feeder, devices, shuffle=True)
        described, stats = feeder.describe(), feeder.stats()
    # 2 ms of waiting and almost no CPU a sample: many more workers than the cores, threads
    # (8 at most) or processes, whichever made more.
    assert described.workers >= 8
    assert described.workers_chosen.startswith(f"{stats.workers_picked}: the fastest measured")
    assert "waiting" in described.workers_chosen
    assert f'workers="auto" picked {stats.workers_picked}' in str(stats)


@pytest.mark.parametrize("first", ["process", "thread"])
def test_every_switch_keeps_the_batches_of_workers0(devices, monkeypatch, first):
    second = "thread" if first == "process" else "process"
    plan = ranked(Setting(first, 2, 1e9), Setting(second, 3, 1e9))
    monkeypatch.setattr(SampleCost, "settings", plan)
    source = wf.SlowSource(200, 0.001)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto", shuffle=True) as feeder:
        until_settled(feeder, devices, shuffle=True)
        producer = feeder._assembly.producer
    assert set(producer.measured) == {("thread", 0), (first, 2), (second, 3)}
    assert producer.settled
    kept = max(producer.measured, key=producer.measured.get)
    assert (producer.setting.mode, producer.setting.workers) in ((kept[0], kept[1]), kept)
    assert list(producer.producers) == [kept] or kept == ("thread", 0)


def test_skipped_samples_are_the_same_as_with_workers0(devices, monkeypatch):
    monkeypatch.setattr(SampleCost, "settings", ranked(Setting("thread", 2, 1e9)))
    source = wf.FailingSource(96, fail_at=50)
    options = {"shuffle": True, "errors": "skip", "max_skipped": 3}
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, **options) as fixed:
        expected, skipped = epochs(fixed, ids=real_ids), fixed.stats().skipped
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto", **options) as feeder:
        assert epochs(feeder, ids=real_ids) == expected
        assert feeder.stats().skipped == skipped


@pytest.mark.parametrize("stop_after", [1, 7])
def test_a_state_taken_while_it_measures_resumes_anywhere(devices, monkeypatch, stop_after):
    monkeypatch.setattr(SampleCost, "settings", ranked(Setting("process", 2, 1e9)))
    source = wf.SlowSource(96, 0.001)
    whole = reference(source, devices, count=1, shuffle=True)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto", shuffle=True) as first:
        taken = []
        for batch in first:
            taken.append(all_ids(batch))
            if len(taken) == stop_after:
                break
        state = first.get_state()
    for workers in (0, "auto"):
        with fp.Feeder(
            source, GLOBAL_BATCH, devices=devices, workers=workers, shuffle=True
        ) as rest:
            rest.set_state(state)
            assert taken + epochs(rest, 1) == whole


def test_a_source_that_cannot_be_pickled_is_never_given_processes(devices, monkeypatch):
    monkeypatch.setattr(
        SampleCost, "settings", ranked(Setting("process", 2, 1e9), Setting("thread", 2, 1e9))
    )
    with fp.Feeder(LockedSlowSource(96), GLOBAL_BATCH, devices=devices, workers="auto") as feeder:
        until_settled(feeder, devices)
        producer, chosen = feeder._assembly.producer, feeder.describe().workers_chosen
    assert ("process", 2) not in producer.measured
    assert "no processes: the source cannot be pickled" in chosen


def test_a_pool_that_fails_to_start_is_named_and_passed_over(devices, monkeypatch):
    monkeypatch.setattr(
        SampleCost, "settings", ranked(Setting("process", 2, 1e9), Setting("thread", 2, 1e9))
    )
    from feedpipe.core import workers

    def no_processes(count, setup, timeout_s):
        raise OSError("no more processes")

    monkeypatch.setattr(workers, "ProcessWorkers", no_processes)
    source = wf.SlowSource(96, 0.001)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto") as feeder:
        until_settled(feeder, devices)
        chosen = feeder.describe().workers_chosen
    assert 'workers=2, worker_mode="process" failed to start (OSError: no more processes)' in chosen


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (wf.index_arrays(64), "arrays without a transform are gathered"),
        (fp.from_generator(wf.sharded_range(64)), "order depends on how many shards read it"),
    ],
)
def test_sources_it_leaves_to_one_thread_say_why(devices, source, why):
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto") as feeder:
        assert len(epochs(feeder, 1)) == 8
        described = feeder.describe()
        assert feeder.stats().workers_picked is None
    assert described.workers == 0 and why in described.workers_chosen


def test_closing_while_a_pool_spawns_ends_its_workers(devices, monkeypatch):
    monkeypatch.setattr(SampleCost, "settings", ranked(Setting("process", 16, 1e9)))
    source = LoadsForeverInAWorker(400, 0.002)
    feeder = fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto")
    producer = feeder._assembly.producer
    producer.worker_bytes = 1  # as if one worker was measured: the pool of 16 starts at once
    for _ in feeder:
        if producer._pending is not None:
            break
    # A pool of 16 processes is spawning in the background: they exist, none is ready.
    assert producer._pending is not None, producer.why
    deadline = time.monotonic() + 60
    while len(feedpipe_processes()) < 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(feedpipe_processes()) == 16 and not producer._pending[1].done()
    feeder.close()
    assert feedpipe_processes() == []


def test_trial_processes_stop_at_what_fits_the_memory_available(devices, monkeypatch):
    monkeypatch.setattr(SampleCost, "settings", ranked(Setting("process", 16, 1e9)))
    monkeypatch.setenv(env.AVAILABLE_BYTES, str(2**30))  # 1 GiB available
    source = HoldsPythonObjects(200)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers="auto") as feeder:
        until_settled(feeder, devices)
        producer, chosen = feeder._assembly.producer, feeder.describe().workers_chosen
    # One worker was measured, and trials took as many as fit half of 1 GiB, no more.
    (tried,) = [workers for mode, workers in producer.measured if mode == "process"]
    assert producer.worker_bytes > 0
    assert tried * producer.worker_bytes <= auto.MEMORY_SHARE * 2**30
    assert (tried + 1) * producer.worker_bytes > auto.MEMORY_SHARE * 2**30
    assert f"memory capped processes at {tried}" in chosen
    assert env.AVAILABLE_BYTES in chosen


def test_available_memory_must_be_a_number_of_bytes(monkeypatch):
    monkeypatch.setenv(env.AVAILABLE_BYTES, "1G")
    with pytest.raises(ValueError, match=r"FEEDPIPE_AVAILABLE_BYTES='1G' must be a whole number"):
        auto.available_memory()


def test_workers_must_be_a_count_or_auto(devices):
    with pytest.raises(ValueError, match=r'`workers`=.Auto. must be an integer >= 0.*"auto"'):
        fp.Feeder(np.zeros((16, 2)), GLOBAL_BATCH, devices=devices, workers="Auto")


def test_as_dataset_gives_the_batches_of_workers0_across_every_switch(devices, monkeypatch):
    # The path model.fit reads on TensorFlow: batches kept on the host (shared slots) and
    # handed to tf.data, while "auto" switches from its thread to threads and to processes.
    plan = ranked(Setting("thread", 2, 1e9), Setting("process", 2, 1e9))
    monkeypatch.setattr(SampleCost, "settings", plan)
    source = wf.SlowSource(96, 0.001)
    with fp.Feeder(wf.IndexSource(96), GLOBAL_BATCH, devices=devices, shuffle=True) as fixed:
        dataset = fixed.as_dataset()
        expected = [[host_batch_ids(e).tolist() for e in dataset] for _ in range(MAX_EPOCHS)]
    options = {"devices": devices, "workers": "auto", "shuffle": True}
    with fp.Feeder(source, GLOBAL_BATCH, **options) as feeder:
        dataset, producer = feeder.as_dataset(), feeder._assembly.producer
        producer.worker_bytes = 1  # as if measured: the pool starts without a first worker
        for epoch in range(MAX_EPOCHS):
            assert [host_batch_ids(e).tolist() for e in dataset] == expected[epoch]
            if producer.settled and epoch:
                break
    assert set(producer.measured) == {("thread", 0), ("thread", 2), ("process", 2)}
