"""The background thread that produces, stages and hands over batches, and its shutdown.

Errors and epoch ends travel through the hand-off as values. Every wait is sliced and
re-checks the stop event (and, for the consumer, that the thread is still alive), so nothing
blocks forever. `close()` runs in a fixed order: stop, drain so a blocked thread wakes, join
with a timeout, drain again; it is idempotent and also runs from `weakref.finalize`.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from feedpipe.core._sync import WAIT_SLICE_S, Failure, Stopped, join_within
from feedpipe.core.handoff import Handoff
from feedpipe.core.producers import Producer
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import EpochEnd
from feedpipe.core.slots import HostSlot, SlotPool
from feedpipe.core.state import Position


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
        self.service_waited = stats.service_waited

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
            batch = stager.stage(step, slot.lease(pool.give_back))
            making = made - started - (stats.slot_wait_s - slot_waits)
            stats.produced(
                busy_s=making + time.perf_counter() - staging,
                samples=step.num_valid,
                gather_s=making,
            )
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
        self.handoff = Handoff(depth, stats, on_starve=pool.wake)
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
