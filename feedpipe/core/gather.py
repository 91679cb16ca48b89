"""Gather: the rows of a batch of in-memory arrays copied in several threads at once.

`np.take` releases the GIL while it copies rows, so the rows of a batch cut into contiguous
ranges, one a thread, are copied at once, each range into its part of the slot. `plan_gather`
sizes the threads from the machine (the cores this process may run on) and the batch (no range
under `MIN_RANGE_BYTES`); one thread is the plain single `np.take` a field, with no pool.
`GatherPool` keeps the threads for a feeder's life: `submit` queues a batch's ranges and returns
at once, so the batch is gathered while the caller stages the one before it, and `Gathering.wait`
has the caller copy the ranges no thread has started before it waits for the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from feedpipe.core import env
from feedpipe.core._sync import WAIT_SLICE_S, join_within
from feedpipe.core.machine import cores
from feedpipe.core.sampler import Step
from feedpipe.core.slots import HostSlot

MIN_RANGE_BYTES = 2 << 20
"""Fewest bytes a thread gathers. Below about this, waking a thread costs what it saves where a
core copies fast: over rows of 96x96x3 float32 on an idle 2-core machine (about 15 GB/s from
one thread), two threads gathered a batch of 1.7 MiB at 0.68x one thread's rate, 6.8 MiB at
1.11x and 27 MiB at 1.2x to 1.34x. A core of the 16-core GPU machine gathers 1.7 GB/s, so there
any range of this size pays (`kernels_bench/gather.py` measures both)."""

Take = Callable[[np.ndarray, Sequence[np.ndarray]], None]
"""Gathers rows (indices) of every field into one output array a field (`ArraySource.take`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatherPlan:
    """How many threads gather each batch of in-memory arrays, and why."""

    threads: int
    """Threads copying a batch's rows at once, the producer's own included; 1: one `np.take` a
    field in the producer's thread, as it comes."""
    reason: str
    """What set the count: the cores, the batch's bytes, or `FEEDPIPE_GATHER_THREADS`."""


def thread_cap() -> tuple[int, str]:
    """The most gather threads, and what set it: `FEEDPIPE_GATHER_THREADS` where it is set,
    else the cores this process may run on."""
    count = env.count(env.GATHER_THREADS)
    if count is None:
        count = cores()
        return count, f"{count} core{'s' if count != 1 else ''}"
    return count, f"{env.GATHER_THREADS}={count}"


def plan_gather(batch_bytes: int) -> GatherPlan:
    """The gather threads of a batch of `batch_bytes`: one a core (or as many as
    `FEEDPIPE_GATHER_THREADS` allows), as long as each gathers `MIN_RANGE_BYTES` at least."""
    cap, why = thread_cap()
    by_bytes = max(1, batch_bytes // MIN_RANGE_BYTES)
    threads = min(cap, by_bytes)
    mib = f"{batch_bytes / 2**20:.1f} MiB"
    if threads == cap:
        reason = f"{why}, batches of {mib}"
    else:
        reason = f"batches of {mib}, at least {MIN_RANGE_BYTES / 2**20:g} MiB a thread ({why})"
    return GatherPlan(threads, f"{threads} thread{'s' if threads != 1 else ''}: {reason}")


def row_ranges(count: int, parts: int) -> list[tuple[int, int]]:
    """Rows `0:count` cut into `parts` contiguous ranges (fewer where rows run out), the
    first ones a row longer where `parts` does not divide `count`."""
    parts = max(1, min(parts, count))
    size, extra = divmod(count, parts)
    ranges, lo = [], 0
    for part in range(parts):
        hi = lo + size + (part < extra)
        ranges.append((lo, hi))
        lo = hi
    return ranges


class Gathering:
    """One batch being gathered: its row ranges, those no thread has claimed yet, and what
    failed. Invariant: `wait` returns only once no thread writes to the slot again."""

    def __init__(self, take: Take, slot: HostSlot, step: Step, ranges: list[tuple[int, int]]):
        self.take = take
        self.slot = slot
        self.step = step
        self._unclaimed = collections.deque(ranges)
        self._left = len(ranges)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list[tuple[int, BaseException]] = []

    def work(self) -> None:
        """Claims one range, if any is left, and copies its rows into the slot."""
        try:
            lo, hi = self._unclaimed.popleft()
        except IndexError:
            return
        rows = self.step.rows
        try:
            for outs, done, count in self.slot.runs(lo, hi - lo):
                self.take(rows[lo + done : lo + done + count], outs)
        except BaseException as error:
            error.add_note(
                f"feedpipe: raised in {threading.current_thread().name} while gathering rows "
                f"{lo}:{hi} of step {self.step.index} of epoch {self.step.epoch} (indices "
                f"{int(rows[lo])} to {int(rows[hi - 1])})."
            )
            self._errors.append((lo, error))
        finally:
            with self._lock:
                self._left -= 1
                if not self._left:
                    self._done.set()

    def wait(self) -> None:
        """Copies the ranges no thread has claimed, waits for the others, and raises the error
        of the lowest range that failed, if any."""
        while self._unclaimed:
            self.work()
        while not self._done.wait(WAIT_SLICE_S):
            pass  # a claimed range is a copy in memory: it ends
        if self._errors:
            raise min(self._errors, key=lambda pair: pair[0])[1]


def _help(tasks: queue.SimpleQueue, stop: threading.Event) -> None:
    """A gather thread: works on the batches it is handed until stopped."""
    while not stop.is_set():
        try:
            gathering = tasks.get(timeout=WAIT_SLICE_S)
        except queue.Empty:
            continue
        if gathering is None:
            return
        gathering.work()


class GatherPool:
    """The threads that gather the rows of each batch with the producer's thread.

    `threads - 1` daemon threads, `feedpipe-gather-<i>`, started on the first batch and kept
    until `close()`, which is idempotent; the producer's thread is the last one. Invariant: a
    slot a `Gathering` writes to is handed on only after its `wait` returned.
    """

    def __init__(self, take: Take, threads: int):
        if threads < 2:
            raise ValueError(f"A GatherPool needs 2 threads or more, got {threads}.")
        self.take = take
        self.threads = threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._helpers: list[threading.Thread] = []

    def submit(self, slot: HostSlot, step: Step) -> Gathering:
        """Starts gathering `step`'s rows into `slot`; returns at once."""
        ranges = row_ranges(len(step.rows), self.threads)
        gathering = Gathering(self.take, slot, step, ranges)
        if not self._stop.is_set():
            self._start()
            for _ in ranges[1:]:  # the waiting thread takes one range at least
                self._tasks.put(gathering)
        return gathering

    def gather(self, slot: HostSlot, step: Step) -> None:
        """Gathers `step`'s rows into `slot`, in every thread, and returns when they are in."""
        self.submit(slot, step).wait()

    def _start(self) -> None:
        if self._helpers:
            return
        for index in range(1, self.threads):
            thread = threading.Thread(
                target=_help,
                args=(self._tasks, self._stop),
                name=f"feedpipe-gather-{index}",
                daemon=True,
            )
            thread.start()
            self._helpers.append(thread)

    def close(self) -> None:
        """Stops the threads once they finish the range they copy; idempotent. A batch still
        being gathered is finished by whoever waits for it."""
        self._stop.set()
        for _ in self._helpers:
            self._tasks.put(None)
        join_within(self._helpers)
        self._helpers.clear()

    def __repr__(self) -> str:
        return f"GatherPool(threads={self.threads}, running={len(self._helpers)})"
