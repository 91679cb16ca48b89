"""The one stop/timeout/join pattern that every feedpipe thread and worker pool follows.

Every blocking wait is sliced (`WAIT_SLICE_S`) and re-checks a stop event, so a stop is seen
within one slice; errors travel to the consumer as values (`Failure`); shutting down is: set
stop, wake whoever waits, join with one deadline (`join_within`), and name what is still
stuck rather than wait for it. `Watchdog` is the liveness rule of worker pools: a worker with
work outstanding that shows no progress within `timeout_s` is overdue, whatever it is stuck
in (a sample, loading the source, or frozen between samples).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence

WAIT_SLICE_S = 0.05
"""How long one blocked wait lasts before it re-checks that it should still wait."""
JOIN_TIMEOUT_S = 5.0
"""How long a shutdown waits for a thread in user code; one stuck longer is left to finish alone
(threads are daemons and end with the process)."""
STOP_GRACE_S = 1.0
"""How long a shutdown lets worker processes finish their current task before killing them."""


def poll_then_sleep(done: Callable[[], bool], sleep: Callable[[], object], poll_s: float) -> None:
    """Waits for a device's work: polls `done` for up to `poll_s`, then blocks in `sleep`.

    A wait that sleeps at once wakes tens of microseconds after the work ends (as long as a
    2 MiB copy takes); one that polls sees the end at once but holds a core. Polling for about
    the work's expected time, then sleeping, gets the first without paying the second for long.
    """
    deadline = time.perf_counter() + poll_s
    while not done():
        if time.perf_counter() > deadline:
            sleep()
            return


class Stopped(Exception):
    """The pipeline was asked to stop while this thread waited."""


class Failure:
    """An exception raised away from the consumer, carried to it as a value."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class Wakeup:
    """One thread's wake-up call: a lock held while nobody has called, released to call.

    `wait` and `call` are single C calls (a Condition's `notify` runs Python), which matters on
    the consumer's path, where every microsecond of `next()` is the step's. A call made before
    the wait makes the wait return at once; waiters re-check their condition either way.
    """

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def wait(self, timeout: float) -> None:
        self._lock.acquire(timeout=timeout)

    def call(self) -> None:
        try:  # noqa: SIM105 (contextlib.suppress would add a Python-level call to the hot path)
            self._lock.release()
        except RuntimeError:  # already called and not yet waited for
            pass


def join_within(
    threads: Sequence[threading.Thread], timeout_s: float = JOIN_TIMEOUT_S, *, skip=()
) -> list[str]:
    """Joins `threads` against one deadline and warns naming those still running.

    The calling thread and those in `skip` (known to be stuck in user code) are not waited
    for. Returns the names of the threads left running.
    """
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        if thread is not threading.current_thread() and thread not in skip:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive() and t is not threading.current_thread()]
    if stuck:
        warnings.warn(
            f"{', '.join(stuck)} did not stop (user code still running); daemon threads end "
            "with the process.",
            stacklevel=3,
        )
    return stuck


class Watchdog:
    """When did each worker last show progress, and is one overdue?

    A worker shows progress by starting a sample (its status row's clock), or by answering a
    task. One that has tasks outstanding and shows none for `timeout_s` is overdue: hung in a
    sample, in loading its source, or stopped between samples (SIGSTOP). `status[w]` is
    `[sample index or -1, epoch, time.monotonic() at the sample's start]`.
    """

    def __init__(self, status, names: Sequence[str], timeout_s: float | None):
        self.status = status
        self.names = list(names)
        self.timeout_s = timeout_s
        self.outstanding = [0] * len(names)
        """Tasks sent to each worker and not yet answered."""
        self._progress = [time.monotonic()] * len(names)

    def sent(self, worker: int) -> None:
        if not self.outstanding[worker]:
            self._progress[worker] = time.monotonic()  # an idle worker's clock starts now
        self.outstanding[worker] += 1

    def answered(self, worker: int) -> None:
        self.outstanding[worker] -= 1
        self._progress[worker] = time.monotonic()

    def overdue(self, pids: Sequence[int | None] = ()) -> tuple[int, TimeoutError] | None:
        """The first overdue worker and the error that names it, if any."""
        if self.timeout_s is None:
            return None
        now = time.monotonic()
        for worker, (index, epoch, started) in enumerate(self.status.tolist()):
            if not self.outstanding[worker]:
                continue
            since = max(self._progress[worker], started)
            if now - since <= self.timeout_s:
                continue
            pid = f" (pid {pids[worker]})" if pids and pids[worker] is not None else ""
            name = f"{self.names[worker]}{pid}"
            if index >= 0:
                doing = (
                    f"has spent {now - since:.1f} s on sample {int(index)} of epoch {int(epoch)}"
                )
            else:
                doing = (
                    f"has shown no progress for {now - since:.1f} s with "
                    f"{self.outstanding[worker]} task(s) outstanding (stuck loading the source "
                    "or `transform`, or stopped)"
                )
            return worker, TimeoutError(
                f"{name} {doing}, more than `timeout_s`={self.timeout_s:g}; fix the hang in the "
                "source or `transform`, or raise `timeout_s`."
            )
        return None
