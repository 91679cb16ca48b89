"""The delay other processes caused this process's threads: counted when other processes hold
the CPUs, not when this process's own threads crowd each other."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import psutil
import pytest

from feedpipe.core._contention import delay_from_other_load_s, snapshot
from tests.test_monitor import competing_cpu_load

SPAN_S = 0.6

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/schedstat"), reason="the kernel does not count run-queue delay"
)


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_other_processes_holding_the_cpus_count_as_other_load():
    """Two busy processes per core against one busy thread here: the thread gets about two
    fifths of a core and waits the rest, and nearly all the CPU it waits for is theirs."""
    with competing_cpu_load(per_core=2):
        time.sleep(0.2)  # the competitors are running
        begin, began = snapshot(), time.monotonic()
        spin(SPAN_S)
        end, wall_s = snapshot(), time.monotonic() - began
    other_s = delay_from_other_load_s(begin, end)
    assert other_s > 0.2 * wall_s, f"{other_s:.3f} s of {wall_s:.3f} s"
    assert other_s <= end.run_delay_s - begin.run_delay_s


def other_processes_cpu_s() -> float:
    """CPU time every other process has used so far, read process by process (psutil), apart
    from the machine-wide counter the measurement reads."""
    total = 0.0
    for process in psutil.process_iter(["pid", "cpu_times"]):
        times = process.info["cpu_times"]
        if process.info["pid"] != os.getpid() and times is not None:
            total += times.user + times.system
    return total


def test_this_processes_own_threads_crowding_each_other_are_not_other_load():
    """Three hashing threads per core (hashlib lets go of the GIL): they wait for each other
    on the run queue, and none of that is counted as other processes' doing. What other
    processes on the machine run meanwhile may be counted, up to their share of the busy CPU
    (read apart, process by process), so the test holds on a busy machine too."""
    stop = threading.Event()
    data = os.urandom(1 << 20)

    def hash_until_stopped() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [
        threading.Thread(target=hash_until_stopped) for _ in range(3 * len(os.sched_getaffinity(0)))
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.1)
        begin, others_began = snapshot(), other_processes_cpu_s()
        time.sleep(SPAN_S)
        end, others_s = snapshot(), other_processes_cpu_s() - others_began
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    delay_s = end.run_delay_s - begin.run_delay_s
    assert delay_s > SPAN_S, "the threads must have waited for each other"
    others_share = min(1.0, others_s / max(end.machine_busy_s - begin.machine_busy_s, 1e-9))
    assert delay_from_other_load_s(begin, end) < (0.15 + others_share) * delay_s
