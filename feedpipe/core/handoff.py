"""Hand-off: the queue between the producer thread and the consumer, which measures itself.

At most `depth` staged batches wait in it; epoch ends and failures travel through it as values.
Each side waits in slices that re-check a stop event (and, for the consumer, that the producer
thread is alive), so nothing blocks forever.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from feedpipe.core._sync import WAIT_SLICE_S, Failure, Stopped, Wakeup
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import EpochEnd


class Handoff:
    """A queue holding at most `depth` staged batches (epoch ends and failures are free).

    Each side wakes the other only when it waits, and a full ring is refilled from half-empty:
    a producer waiting for room is woken once a take leaves `depth // 2` batches or fewer. On
    virtual CPUs waking a sleeping thread costs tens of microseconds, paid inside `next()`;
    with a deep ring most takes then wake nobody, and the producer refills several batches per
    wake-up while the rest of the ring covers the steps. A ring of depth 2 wakes it every take.

    Like SPDL's `StatsQueue`, it measures its own waits into `stats`: the producer's wait for
    room, and for each batch taken the consumer's wait and how many were staged when it asked
    (an epoch's end closes the consumer's last step).
    """

    def __init__(self, depth: int, stats: StatsRecorder, on_starve: Callable[[], None]):
        self.depth = depth
        self._stats = stats
        self._on_starve = on_starve
        self._items: collections.deque = collections.deque()
        self.staged = 0
        """Batches staged and not yet taken."""
        self._lock = threading.Lock()
        self._consumer_wakeup = Wakeup()
        self._producer_wakeup = Wakeup()
        self.consumer_waiting = False
        self._producer_waiting = False

    def wait_for_room(self, stop: threading.Event) -> None:
        """Waits while `depth` batches are staged; raises `Stopped` if `stop` is set."""
        started = time.perf_counter()
        try:
            while True:
                with self._lock:
                    self._producer_waiting = self.staged >= self.depth
                    if not self._producer_waiting:
                        break
                if stop.is_set():
                    raise Stopped
                self._producer_wakeup.wait(WAIT_SLICE_S)
            if stop.is_set():
                raise Stopped
        finally:
            self._stats.producer_wait_s += time.perf_counter() - started

    def put(self, item: Any, *, is_batch: bool) -> None:
        with self._lock:
            self._items.append((item, is_batch))
            self.staged += is_batch
            waiting = self.consumer_waiting
        if waiting:
            self._consumer_wakeup.call()

    def get(self, thread: threading.Thread, stop: threading.Event) -> Any:
        """The next item; raises if the feeder closed or the thread died without sending one."""
        staged, asked = self.staged, time.perf_counter()
        item = self._get(thread, stop)
        if isinstance(item, EpochEnd):
            self._stats.loop_ended(asked)
        elif not isinstance(item, Failure):
            self._stats.taken(
                asked=asked, got=time.perf_counter(), occupancy=staged, samples=item.num_valid
            )
        return item

    def _get(self, thread: threading.Thread, stop: threading.Event) -> Any:
        with self._lock:
            if self._items:
                return self._take()
            self.consumer_waiting = True
        self._on_starve()
        try:
            while True:
                with self._lock:
                    if self._items:
                        self.consumer_waiting = False
                        return self._take()
                if stop.is_set():
                    raise RuntimeError("The feeder was closed while this loop waited for a batch.")
                if not thread.is_alive():
                    raise RuntimeError(
                        f"{thread.name} stopped without delivering a batch, an error or the end "
                        "of the epoch; the feeder cannot go on."
                    )
                self._consumer_wakeup.wait(WAIT_SLICE_S)
        finally:
            self.consumer_waiting = False

    def _take(self) -> Any:
        """Pops the next item (the lock held); wakes a producer waiting for room once the ring
        is half empty."""
        item, is_batch = self._items.popleft()
        self.staged -= is_batch
        if self._producer_waiting and self.staged <= self.depth // 2:
            self._producer_waiting = False
            self._producer_wakeup.call()
        return item

    def starving(self) -> bool:
        """The consumer waits and nothing is staged."""
        return self.consumer_waiting and not self.staged

    def drain(self) -> None:
        with self._lock:
            self._items.clear()
            self.staged = 0
        self._consumer_wakeup.call()
        self._producer_wakeup.call()
