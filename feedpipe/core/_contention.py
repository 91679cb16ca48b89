"""How long this process's threads waited for a CPU that other processes held.

A step that other load on the machine slows is not slowed by its input, but its time alone can
only be measured beside the stretch of real steps, not inside it: load that rises and falls in
between would pass for input wait. Linux counts, for each thread, the time it was ready to run
but waited for a CPU (`/proc/self/task/*/schedstat`), and, for the machine, the CPU time all
processes used (`/proc/stat`). That run-queue delay, times the share of the machine's busy CPU
that went to other processes, estimates the delay other load caused over a span. An input's
worker processes are other processes too: the delay they cause the step is not told apart
from any other load's, so it can widen a bound, never narrow one. Where the kernel does not
count (another system, schedstats off) every figure reads zero and bounds are the
measurements' own.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
"""Seconds per clock tick, the unit of `/proc/stat`."""


@dataclasses.dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """Cumulative CPU counters at one moment; two of them bound a span."""

    run_delay_s: float
    """Time this process's live threads have waited, ready to run, for a CPU."""
    machine_busy_s: float
    """CPU time every process on the machine has used (all cores; steal left out)."""
    own_cpu_s: float
    """CPU time this process has used."""


def snapshot() -> CpuSnapshot:
    """The counters now; zeros for what this system does not expose."""
    return CpuSnapshot(_run_delay_s(), _machine_busy_s(), time.process_time())


def delay_from_other_load_s(begin: CpuSnapshot, end: CpuSnapshot) -> float:
    """Seconds of run-queue delay over the span that other processes' CPU use accounts for."""
    delay_s = max(0.0, end.run_delay_s - begin.run_delay_s)
    busy_s = end.machine_busy_s - begin.machine_busy_s
    if delay_s == 0.0 or busy_s <= 0.0:
        return 0.0
    others_s = busy_s - (end.own_cpu_s - begin.own_cpu_s)
    return delay_s * min(1.0, max(0.0, others_s / busy_s))


class OtherLoadSpan:
    """The delay other processes cause this process's threads from its making on."""

    def __init__(self) -> None:
        self._begin = snapshot()

    def per_step_s(self, steps: int) -> float:
        """That delay so far, in seconds per step over `steps` steps."""
        return delay_from_other_load_s(self._begin, snapshot()) / max(steps, 1)


def thread_run_delay_s() -> float:
    """Seconds the calling thread has waited, ready to run, for a CPU (0 where not counted):
    time a clock on the wall counts that neither its work nor its waits for I/O took."""
    fields = (_read(f"/proc/self/task/{threading.get_native_id()}/schedstat") or "").split()
    return int(fields[1]) * 1e-9 if len(fields) >= 2 else 0.0


def _read(path: str, first_line: bool = False) -> str | None:
    try:
        with open(path) as file:
            return file.readline() if first_line else file.read()
    except OSError:  # not Linux, or the thread ended meanwhile
        return None


def _run_delay_s() -> float:
    """The second field of each thread's schedstat: nanoseconds spent waiting on a run queue."""
    total_ns = 0
    for thread in _listdir("/proc/self/task"):
        fields = (_read(f"/proc/self/task/{thread}/schedstat") or "").split()
        if len(fields) >= 2:
            total_ns += int(fields[1])
    return total_ns * 1e-9


def _machine_busy_s() -> float:
    """user + nice + system + irq + softirq of the first (all-cores) line of /proc/stat."""
    line = _read("/proc/stat", first_line=True)  # the rest is long: a line per core and IRQ
    if not line or not line.startswith("cpu "):
        return 0.0
    ticks = [int(field) for field in line.split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks + [0] * (7 - len(ticks))
    return (user + nice + system + irq + softirq) * _TICK_S


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
