"""The background thread that produces, stages and hands over batches, and its shutdown.

Errors and epoch ends travel through the hand-off as values. Every wait is sliced and
re-checks the stop event (and, for the consumer, that the thread is still alive), so nothing
blocks forever. `close()` runs in a fixed order: stop, drain so a blocked thread wakes, join
with a timeout, drain again; it is idempotent and also runs from `weakref.finalize`.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from feedpipe._sync import WAIT_SLICE_S, Failure, Stopped, Wakeup, join_within
from feedpipe.producers import Position, Producer
from feedpipe.sampler import EpochEnd
from feedpipe.slots import HostSlot, SlotPool
from feedpipe.stats import StatsRecorder


class Handoff:
    """A queue holding at most `depth` staged batches (epoch ends and failures are free).

    Each side wakes the other only when it waits, and a full ring is refilled from half-empty:
    a producer waiting for room is woken once a take leaves `depth // 2` batches or fewer. On
    virtual CPUs waking a sleeping thread costs tens of microseconds, paid inside `next()`;
    with a deep ring most takes then wake nobody, and the producer refills several batches per
    wake-up while the rest of the ring covers the steps. A ring of depth 2 wakes it every take.
    """

    def __init__(self, depth: int, on_starve: Callable[[], None]):
        self.depth = depth
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

    def put(self, item: Any, *, is_batch: bool) -> None:
        with self._lock:
            self._items.append((item, is_batch))
            self.staged += is_batch
            waiting = self.consumer_waiting
        if waiting:
            self._consumer_wakeup.call()

    def get(self, thread: threading.Thread, stop: threading.Event) -> Any:
        """The next item; raises if the feeder closed or the thread died without sending one."""
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


class _Supply:
    """The pool's slots as a producer sees them: waits are timed and stop when asked."""

    def __init__(
        self, pool: SlotPool, handoff: Handoff, stop: threading.Event, stats: StatsRecorder
    ):
        self.pool = pool
        self.handoff = handoff
        self.stop = stop
        self.stats = stats
        self.give_back = pool.give_back
        self.take_dropped = pool.take_dropped

    def acquire(self) -> HostSlot:
        """A slot: a free one, or a one-off while the consumer starves holding all of them."""
        started = time.perf_counter()
        try:
            while (slot := self.pool.take(self.stop)) is None:
                if self.handoff.starving():
                    return self.pool.overflow()
                self.pool.wait(WAIT_SLICE_S)
            return slot
        finally:
            self.stats.slot_wait_s += time.perf_counter() - started

    def try_acquire(self) -> HostSlot | None:
        return self.pool.take(self.stop)

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise Stopped


def _run(
    producer: Producer,
    stager: Any,
    pool: SlotPool,
    handoff: Handoff,
    stop: threading.Event,
    start: Position,
    stats: StatsRecorder,
) -> None:
    """Fills, stages and hands over batches from `start` on until stopped or failed."""
    try:
        slots = producer.slots(start, _Supply(pool, handoff, stop, stats))
        while True:
            started, slot_waits = time.perf_counter(), stats.slot_wait_s
            item = next(slots, None)
            if item is None:
                return
            if isinstance(item, EpochEnd):
                handoff.put(item, is_batch=False)
                continue
            step, slot = item
            made = time.perf_counter()
            handoff.wait_for_room(stop)
            staging = time.perf_counter()
            stats.producer_wait_s += staging - made
            batch = stager.stage(step, slot.lease(pool.give_back))
            making = made - started - (stats.slot_wait_s - slot_waits)
            stats.produced(busy_s=making + time.perf_counter() - staging, samples=step.num_valid)
            handoff.put(batch, is_batch=True)
            # This frame must not keep the batch alive: its slot returns when the consumer drops it.
            del batch
    except Stopped:
        return
    except BaseException as error:
        handoff.put(Failure(error), is_batch=False)


def _shutdown(stop: threading.Event, handoff: Handoff, thread: threading.Thread) -> None:
    stop.set()
    handoff.drain()
    join_within([thread])
    handoff.drain()


class Pipeline:
    """One background thread producing and staging batches from `start` on.

    Invariant: at most `depth` staged batches wait in the hand-off, and the host memory in use
    is the pool's slots (see `SlotPool`).
    """

    def __init__(
        self,
        producer: Producer,
        stager: Any,
        pool: SlotPool,
        depth: int,
        start: Position,
        stats: StatsRecorder,
        *,
        host: bool,
    ):
        self.host = host
        self.handoff = Handoff(depth, on_starve=pool.wake)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=_run,
            args=(producer, stager, pool, self.handoff, self.stop, start, stats),
            name="feedpipe-producer-0",
            daemon=True,
        )
        self.thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self.stop, self.handoff, self.thread)

    def get(self) -> Any:
        return self.handoff.get(self.thread, self.stop)

    def close(self) -> None:
        self._finalizer()
