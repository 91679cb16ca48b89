"""What a sample costs to make, and the rate each way of making samples in parallel can reach.

A source may wait (a disk, a remote store, a sleep), run Python that holds the GIL, or run
native code that releases it, and each is fed by a different remedy: threads for waiting,
processes for GIL-bound Python, either for native code, and cores only for CPU. Sizing them all
in cores, as if every source computed, gives advice off by the ratio of waiting to working.

`probe` measures one sample's wall time in one thread and the CPU time it costs this process
(every thread of it: native code may run a pool of its own), and the time that thread waited
for a CPU that other load held (`_contention`), which is the machine's, not the source's
waiting: then the
rate of `PROBE_THREADS` threads reading at once, which bounds the part of that CPU time that
holds the GIL. `SampleCost.rate` predicts the samples/s of any setting from those three
figures and the machine's cores; `settings` ranks the settings worth trying. The diagnosis
(`feedpipe.diagnostics.remedies`) and `workers="auto"` (`feedpipe.assembly`) both size their
workers here, so their advice and their choice cannot disagree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable

from feedpipe.core._contention import CpuSnapshot, snapshot, thread_run_delay_s
from feedpipe.core.machine import cores

PROBE_THREADS = 4
"""Threads reading at once in the probe: enough to tell GIL-bound work (their rate stays at
one core's) from work that waits or releases the GIL (it grows with them)."""
PROBE_S = 0.15
"""Seconds each half of the probe reads for, at least: long enough that a sample's cost is an
average over many, short enough to run before a feeder's first batch."""
THREAD_COUNTS = (1, 2, 4, 8)
"""Thread counts considered. Beyond 8, threads gain little: each sample's return to the GIL
costs this process CPU that grows with the threads contending for it. Over a source that
sleeps 0.5 ms a sample, 16 threads made 1.04x and 1.10x the samples/s of 8 in two runs,
where 16 processes made 1.47x and 1.37x (`kernels_bench/auto_workers.py`, 2-core machine)."""
PROCESS_COUNTS = (1, 2, 4, 8, 16)
"""Process counts considered, besides the cores: a doubling grid, as a sweep would try."""
NEAR_BEST = 0.95
"""A setting within this fraction of the best rate counts as reaching it: the fewest workers
that do are picked (each costs memory, and a process its start-up)."""
WAITING, GIL_BOUND, GIL_FREE, MIXED = "waiting", "GIL-bound Python", "GIL-free native code", "mixed"
COMPUTING = "computing"
WAITING_SHARE = 0.7
"""A source that spends at least this share of a sample's time off the CPU waits. Set with the
model, clear of the sources it tells apart: on a 2-core machine under load, the probe read a
2 ms sleep as 0.97 waiting and spinning Python as 0.00 (`tests/core/test_cost.py`'s sources);
a source between this and `COMPUTING_SHARE` is `MIXED`."""
COMPUTING_SHARE = 0.3
"""A source that spends at most this share of a sample's time off the CPU computes, and its
threads' CPU tells GIL-bound from GIL-free work: as far below the middle as `WAITING_SHARE`
is above it (set with the model; `tests/core/test_cost.py` keeps GIL-bound Python under a
competing load below it)."""
GIL_BOUND_CORES = 1.3
"""`PROBE_THREADS` threads whose CPU adds up to at most this many cores' worth ran one at a
time, holding the GIL: one core, and a margin of 0.3 for the threads' hand-offs and the
clocks (set with the model, not tuned since)."""
GIL_FREE_SHARE = 0.7
"""`PROBE_THREADS` threads whose CPU reaches this share of the cores they could use at once
(their count, at most the free cores) ran in parallel: native code that releases the GIL. A
margin of 30 % for hand-offs and other load, as `WAITING_SHARE` allows (set with the model,
not tuned since)."""
QUEUED_SHOWN_SHARE = 0.01
"""`describe` names the time a sample waited for a CPU that other load held once it is at
least this share of the sample's wall time: less changes no figure a reader acts on."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SampleCost:
    """What one sample costs its maker, as `probe` measured it; built by keyword, as its
    figures are all seconds, rates or counts that a position would mix up."""

    wall_s: float
    """Seconds per sample, read in one thread."""
    cpu_s: float
    """CPU seconds per sample, in any thread of this process: the rest of `wall_s` is
    waiting."""
    gil_s: float
    """At most this many seconds of a sample hold the GIL: the reading thread's own CPU time,
    or less where `PROBE_THREADS` threads outran it."""
    threads: int
    """Threads that read at once for `threads_rate` (0: not measured)."""
    threads_rate: float
    """Samples/s of `threads` threads reading at once (nan where not measured)."""
    parallel_cpu: float
    """Cores' worth of CPU those threads used at once, by their own clocks: about 1 where the
    GIL lets one run at a time, up to min(threads, cores) where it is released, near 0 where
    they wait (nan where not measured). Read from the threads' clocks, not from the rate, as a
    virtual CPU's speed can change by half between two measurements."""
    samples: int
    """Samples the probe read."""
    free_cores: float
    """The cores other processes left free while the probe ran: the machine's cores less
    their CPU use, so that a loaded machine is not promised its idle rate."""
    feeder_cpu_s: float = 0.0
    """CPU seconds per sample the feeder's own process spends besides the sample (handing
    rows over, staging), holding the GIL: it shares the cores and the GIL with the workers.
    0 where not measured."""
    queued_s: float = 0.0
    """Seconds of `wall_s` the reading thread spent ready to run but waiting for a CPU that
    other processes held (the scheduler's run-queue wait): a loaded machine's, not the
    source's, so it is no part of `waiting`."""

    @property
    def waiting(self) -> float:
        """The share of a sample's time spent waiting (I/O, sleep, a remote call), out of the
        time it was not kept from a CPU by other load."""
        own_s = self.wall_s - self.queued_s
        return min(1.0, max(0.0, 1.0 - self.cpu_s / own_s)) if own_s > 0 else 0.0

    @property
    def kind(self) -> str:
        """`WAITING`, `GIL_BOUND`, `GIL_FREE`, `MIXED`, or `COMPUTING` where no threads were
        measured to tell whether the GIL is held: what the sample's time goes to."""
        if self.waiting >= WAITING_SHARE:
            return WAITING
        if self.waiting <= COMPUTING_SHARE:
            if not self.threads:
                return COMPUTING
            if self.parallel_cpu <= GIL_BOUND_CORES:
                return GIL_BOUND
            if self.parallel_cpu >= GIL_FREE_SHARE * min(self.threads, self.free_cores):
                return GIL_FREE
        return MIXED

    def describe(self) -> str:
        """One clause: the figures, and what they make of the source."""
        threads = (
            f"{self.threads} threads made {self.threads_rate:,.0f} samples/s, "
            f"{self.parallel_cpu:.1f} cores' worth, with "
            if self.threads
            else "with "
        )
        queued = (
            f", {self.queued_s * 1e3:,.3f} ms waiting for a CPU other load held"
            if self.queued_s >= QUEUED_SHOWN_SHARE * self.wall_s
            else ""
        )
        return (
            f"a sample takes {self.wall_s * 1e3:,.3f} ms, {self.cpu_s * 1e3:,.3f} ms of it CPU "
            f"({self.waiting:.0%} waiting{queued}); {threads}{self.free_cores:.1f} cores free: "
            f"{self.kind}"
        )

    def rate(self, mode: str, workers: int, cores: float | None = None) -> float:
        """Samples/s that `workers` of `mode` ("thread" or "process"; 0: the feeder's one
        background thread) can make on `cores` cores (default: `free_cores`).

        Each worker makes one sample per `wall_s`; all of them, with the feeder's own work,
        use at most `cores` of CPU, a process at most one core; threads also share one GIL
        with the feeder's own work.
        """
        own = self.feeder_cpu_s
        if workers == 0:
            return 1.0 / _positive(self.wall_s + own)
        cores = self.free_cores if cores is None else cores
        rate = min(workers / _positive(self.wall_s), cores / _positive(self.cpu_s + own))
        if mode == "thread":
            return min(rate, 1.0 / _positive(self.gil_s + own))
        return min(rate, min(workers, cores) / _positive(self.cpu_s))

    def settings(self, target: float = math.inf, at_least_one: bool = False) -> list[Setting]:
        """The settings worth trying, best first: for each mode, the fewest workers that reach
        `target` samples/s or come within `NEAR_BEST` of the best that mode can; then the
        feeder's one thread (unless `at_least_one`). Equal rates rank threads first: they
        start at once and pickle nothing."""
        found = []
        for mode in ("thread", "process"):
            counts = THREAD_COUNTS if mode == "thread" else _process_counts(self.free_cores)
            best = max(self.rate(mode, n) for n in counts)
            goal = min(target, NEAR_BEST * best)
            workers = next(n for n in counts if self.rate(mode, n) >= goal)
            found.append(Setting(mode, workers, min(target, self.rate(mode, workers))))
        if not at_least_one:
            found.append(Setting("thread", 0, min(target, self.rate("thread", 0))))
        found.sort(key=lambda s: (-round(s.rate, 6), s.mode != "thread", s.workers))
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """A way to make the samples, and the samples/s predicted for it."""

    mode: str
    """"thread" or "process"."""
    workers: int
    """0: the feeder's one background thread."""
    rate: float

    @property
    def options(self) -> dict:
        """The `fp.Feeder` arguments that make it."""
        return (
            {"workers": 0}
            if not self.workers
            else {"workers": self.workers, "worker_mode": self.mode}
        )

    def __str__(self) -> str:
        if not self.workers:
            return "workers=0"
        return f'workers={self.workers}, worker_mode="{self.mode}"'


def probe(
    read: Callable[[int], object], indices: Iterable[int], budget_s: float = PROBE_S
) -> SampleCost:
    """Reads samples by `read(index)` for `indices` (cycled), first in one thread (after one
    untimed), then in `PROBE_THREADS` threads at once, each part for at least `budget_s`;
    returns their cost.

    A sample that raises counts as read: its error is the pipeline's to report, where the
    sample is really made.
    """
    pending = itertools.cycle(indices)
    lock = threading.Lock()

    def next_index() -> int:
        with lock:
            return next(pending)

    def one(index: int) -> None:
        with contextlib.suppress(Exception):
            read(index)

    one(next_index())  # untimed: Python specialises code on its first calls
    machine = snapshot()
    began, count = time.perf_counter(), 0
    cpu_began, thread_began = time.process_time(), time.thread_time()
    queued_began = thread_run_delay_s()
    while count < 2 or time.perf_counter() - began < budget_s:
        one(next_index())
        count += 1
    wall_s = (time.perf_counter() - began) / count
    cpu_s = (time.process_time() - cpu_began) / count
    thread_cpu_s = (time.thread_time() - thread_began) / count
    queued_s = (thread_run_delay_s() - queued_began) / count

    deadline = time.perf_counter() + budget_s
    counts, cpu = [0] * PROBE_THREADS, [0.0] * PROBE_THREADS

    def reader(slot: int) -> None:
        began = time.thread_time()
        while counts[slot] < 1 or time.perf_counter() < deadline:
            one(next_index())
            counts[slot] += 1
        cpu[slot] = time.thread_time() - began

    threads = [
        threading.Thread(target=reader, args=(i,), daemon=True) for i in range(PROBE_THREADS)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    threads_rate = sum(counts) / elapsed
    gil_s = min(thread_cpu_s, 1.0 / threads_rate)
    return SampleCost(
        wall_s=wall_s,
        cpu_s=cpu_s,
        gil_s=gil_s,
        threads=PROBE_THREADS,
        threads_rate=threads_rate,
        parallel_cpu=sum(cpu) / elapsed,
        samples=count + sum(counts),
        free_cores=free_cores_since(machine, began),
        queued_s=queued_s,
    )


def free_cores_since(machine: CpuSnapshot, began: float) -> float:
    """The cores other processes left free since `machine` (a `snapshot()`, taken at
    `began`): at least one, at most all of them."""
    now = snapshot()
    others_s = (now.machine_busy_s - machine.machine_busy_s) - (now.own_cpu_s - machine.own_cpu_s)
    elapsed = time.perf_counter() - began
    return min(float(cores()), max(1.0, cores() - max(0.0, others_s) / elapsed))


def _process_counts(free_cores: float) -> list[int]:
    """Process counts worth trying: the grid, and one a free core."""
    return sorted(set(PROCESS_COUNTS) | {max(1, math.floor(free_cores))})


def _positive(seconds: float) -> float:
    return max(seconds, 1e-9)
