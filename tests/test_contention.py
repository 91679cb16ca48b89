"""The delay other processes caused this process's threads: counted when other processes hold
the CPUs, not when this process's own threads crowd each other."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from feedpipe.diagnostics._contention import delay_from_other_load_s, snapshot
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


def test_this_processes_own_threads_crowding_each_other_are_not_other_load():
    """Three hashing threads per core (hashlib lets go of the GIL): they wait for each other
    on the run queue, and none of that is counted as other processes' doing."""
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
        begin = snapshot()
        time.sleep(SPAN_S)
        end = snapshot()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    delay_s = end.run_delay_s - begin.run_delay_s
    assert delay_s > SPAN_S, "the threads must have waited for each other"
    assert delay_from_other_load_s(begin, end) < 0.15 * delay_s
