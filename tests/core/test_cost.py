"""What a sample costs: the probe tells waiting from GIL-bound work, and the model sizes each
remedy by the resource it uses (threads for waiting, processes for the GIL, cores for CPU)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from feedpipe.core import cost as cost_module
from feedpipe.core.cost import (
    GIL_BOUND,
    WAITING,
    SampleCost,
    Setting,
    probe,
)
from tests.load import busy_cores


def sample_cost(wall_ms: float, cpu_ms: float, gil_ms: float, cores: float = 2.0) -> SampleCost:
    return SampleCost(
        wall_s=wall_ms / 1e3,
        cpu_s=cpu_ms / 1e3,
        gil_s=gil_ms / 1e3,
        threads=4,
        threads_rate=math.nan,
        parallel_cpu=math.nan,
        samples=100,
        free_cores=cores,
    )


def spin(iterations: int) -> int:
    total = 0
    for k in range(iterations):
        total = (total * 31 + k) & 0xFFFF
    return total


def test_a_waiting_source_is_given_workers_far_beyond_the_cores():
    # 1 ms a sample, 0.05 of it CPU holding the GIL: neither the GIL (20,000 a second) nor 2
    # cores (40,000) stop 8 threads (8,000) or 16 processes (16,000); threads stop at 8, where
    # the GIL's hand-offs begin to cost more than they wait in parallel.
    waiting = sample_cost(1.0, 0.05, 0.05)
    assert waiting.rate("thread", 8) == pytest.approx(8_000)
    assert waiting.rate("process", 16) == pytest.approx(16_000)
    first, second = waiting.settings(target=12_000)[:2]
    assert (first.mode, first.workers, first.rate) == ("process", 16, pytest.approx(12_000))
    assert (second.mode, second.workers, second.rate) == ("thread", 8, pytest.approx(8_000))
    # Where 8 threads reach the step's rate, they rank first: they start at once.
    first = waiting.settings(target=6_000)[0]
    assert (first.mode, first.workers, first.rate) == ("thread", 8, pytest.approx(6_000))


def test_gil_bound_python_is_given_processes_and_threads_stay_at_one_core():
    gil = sample_cost(0.5, 0.5, 0.5)
    assert gil.rate("thread", 8) == pytest.approx(2_000)  # one GIL: one sample at a time
    first = gil.settings()[0]
    assert (first.mode, first.workers) == ("process", 2)
    assert first.rate == pytest.approx(4_000)


def test_gil_free_work_ranks_threads_first_where_they_reach_the_same_rate():
    free = sample_cost(0.5, 0.5, 0.25)
    ranked = free.settings()
    assert [(s.mode, s.workers) for s in ranked[:2]] == [("thread", 2), ("process", 2)]
    assert ranked[0].rate == ranked[1].rate == pytest.approx(4_000)


def test_a_mixed_source_is_given_more_processes_than_cores():
    # Half waiting, half GIL-bound: threads stop at the GIL (4,000), processes at the
    # cores' CPU (2 / 0.25 ms = 8,000), which 4 processes reach as each waits half the time.
    mixed = sample_cost(0.5, 0.25, 0.25)
    first = mixed.settings()[0]
    assert (first.mode, first.workers, first.rate) == ("process", 4, pytest.approx(8_000))


def test_a_loaded_machine_is_not_promised_its_idle_rate():
    assert sample_cost(0.5, 0.5, 0.5, cores=1.0).settings()[0].rate == pytest.approx(2_000)


def test_settings_name_the_feeder_arguments_that_make_them():
    assert Setting("thread", 0, 1.0).options == {"workers": 0}
    assert Setting("process", 4, 1.0).options == {"workers": 4, "worker_mode": "process"}
    assert str(Setting("thread", 8, 1.0)) == 'workers=8, worker_mode="thread"'


@pytest.mark.clock
def test_the_probe_tells_waiting_from_gil_bound_work(monkeypatch):
    monkeypatch.setattr(cost_module, "PROBE_S", 0.05)
    waiting = probe(lambda index: time.sleep(0.002), range(100), budget_s=0.05)
    assert waiting.kind == WAITING
    # Less the time other load kept it from a CPU, a sample takes its sleep.
    assert waiting.wall_s - waiting.queued_s == pytest.approx(0.002, rel=0.5)
    assert waiting.cpu_s < 0.5 * waiting.wall_s
    iterations = 20_000
    working = probe(lambda index: spin(iterations), range(100), budget_s=0.05)
    # However loaded the machine, 4 threads of GIL-bound Python make at most one core's worth.
    assert working.kind == GIL_BOUND
    assert working.waiting < 0.3
    assert working.gil_s == pytest.approx(working.cpu_s, rel=0.5)


@pytest.mark.clock
def test_gil_bound_work_under_competing_cpu_load_is_read_as_gil_bound():
    # A core's worth of other processes per core: the reading thread waits for a CPU a good
    # share of its wall time, which is the machine's load, not the source's waiting.
    with busy_cores():
        working = probe(lambda index: spin(20_000), range(100), budget_s=0.1)
    assert working.kind == GIL_BOUND, working.describe()
    assert working.waiting < 0.3, working.describe()


def test_a_sample_that_raises_counts_as_read():
    def broken(index: int) -> None:
        time.sleep(0.001)
        raise ValueError(index)

    measured = probe(broken, range(10), budget_s=0.02)
    assert measured.samples >= 2 + cost_module.PROBE_THREADS
    assert measured.kind == WAITING


def test_the_feeders_own_work_shares_the_cores_and_the_gil_with_the_workers():
    # 0.5 ms of GIL-bound CPU a sample, and 0.5 ms more of the feeder's own in its process:
    # one thread makes 1,000 a second; 2 processes would make 4,000 on 2 cores, but the cores
    # also run the feeder's 0.5 ms: 2,000; threads stop at the GIL the feeder shares.
    cost = dataclasses.replace(sample_cost(0.5, 0.5, 0.5), feeder_cpu_s=0.0005)
    assert cost.rate("thread", 0) == pytest.approx(1_000)
    assert cost.rate("process", 2) == pytest.approx(2_000)
    assert cost.rate("thread", 4) == pytest.approx(1_000)
