"""The Ray producer: fills each step's slot from the answers of Ray tasks, in the plan's order.

A window of upcoming steps is asked for at once, each step cut into tasks of at most
`TASK_ROWS` rows, enough to keep every CPU of the cluster busy. Answers wait in the object
store, wherever they were made, until their step is next: then each is copied into the step's
slot at its place, so the order they arrive in does not matter. A task that has not answered
in `timeout_s` is asked for again, and the first answer is the one written.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

from feedpipe.core._sync import WAIT_SLICE_S
from feedpipe.core.producers import Producer, SlotSupply, cut_rows, handed_on
from feedpipe.core.sampler import EpochEnd, Sampler, Step
from feedpipe.core.skips import SkipLedger
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.state import Position
from feedpipe.core.workers import unpack_skips
from feedpipe.core.writer import Skip
from feedpipe.ray.cluster import RayWork
from feedpipe.ray.tasks import task_layout

TASK_ROWS = 256
"""Rows a task makes at most. The trainer spends about 0.3-0.5 ms on each task (asking,
waiting, reading its answer), so a task of 256 rows costs it 1-2 us a sample; a host batch
larger than this is cut into tasks that run on several CPUs at once."""
TASKS_PER_CPU = 2
"""Tasks out for each CPU of the cluster: one running and one queued, so no CPU idles
between them."""
AHEAD_BYTES = 1 << 30
"""Most bytes of answers the window holds in the object store ahead of the step (never fewer
steps than `depth + 1`)."""


class _Piece:
    """Rows `lo:hi` of a step, the tasks asked to make them, and since when."""

    __slots__ = ("answer", "asked_at", "hi", "lo", "refs")

    def __init__(self, lo: int, hi: int, ref: Any):
        self.lo, self.hi = lo, hi
        self.refs = [ref]
        self.answer: Any = None
        self.asked_at = time.monotonic()


class RayProducer(Producer):
    """Makes each step's rows in Ray tasks and hands the steps on in order."""

    slots_in_flight = 1
    """Answers are copied into a slot only when their step is next."""

    def __init__(
        self,
        work: RayWork,
        sampler: Sampler,
        ledger: SkipLedger | None,
        layout: SlotLayout,
        block_size: int,
        depth: int,
        timeout_s: float | None,
    ):
        self.work = work
        self.sampler = sampler
        self.ledger = ledger
        """Where `errors="skip"` books the samples it skips (None: `errors="raise"`)."""
        self.block_size = block_size
        self.timeout_s = timeout_s
        """A task unanswered this long is asked for again (None: Ray's own retries alone)."""
        self.layout = layout
        self._layouts: dict[int, SlotLayout] = {}
        self._depth = depth
        self._windows: list[collections.deque] = []
        """The steps each running stream of slots has asked for and not handed on."""
        self.asked_again = 0
        """Tasks asked for again after `timeout_s`."""

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        plan = self._plan(start)
        window: collections.deque[tuple[Step, list[_Piece]] | EpochEnd] = collections.deque()
        self._windows.append(window)
        ahead, asked = self._ahead(), 0  # steps to keep asked for; steps asked for now
        try:
            while True:
                while asked < ahead:
                    upcoming = next(plan)
                    if isinstance(upcoming, EpochEnd):
                        window.append(upcoming)
                    else:
                        window.append(self._ask(upcoming))
                        asked += 1
                head = window[0]
                if isinstance(head, EpochEnd):
                    window.popleft()
                    yield head
                    continue
                step, pieces = head
                supply.service_waited(self._wait(step, pieces, supply))
                filled = self._fill(step, pieces, supply)
                window.popleft()
                asked -= 1
                yield filled
        finally:
            self._windows = [other for other in self._windows if other is not window]
            self._cancel(window)

    def _plan(self, start: Position) -> Iterator[Step | EpochEnd]:
        for epoch in itertools.count(start.epoch):
            yield from self.sampler.steps(epoch, start.step if epoch == start.epoch else 0)
            yield EpochEnd(epoch, self.sampler.dropped_per_epoch)

    def _ahead(self) -> int:
        """Steps asked for at once: enough tasks for every CPU of the cluster, within
        `AHEAD_BYTES` of answers, and never fewer than the steps staged ahead."""
        rows = self.layout.split.global_batch_size
        tasks_per_step = math.ceil(rows / TASK_ROWS)
        wanted = math.ceil(TASKS_PER_CPU * self.work.cpus() / tasks_per_step)
        held = max(1, AHEAD_BYTES // max(1, self.layout.batch_bytes))
        return max(self._depth + 1, min(wanted, held))

    def _ask(self, step: Step) -> tuple[Step, list[_Piece]]:
        pieces = math.ceil(len(step.rows) / TASK_ROWS)
        asked = []
        for lo, rows in cut_rows(step.rows, pieces, self.block_size):
            hi = lo + len(rows)
            asked.append(_Piece(lo, hi, self.work.rows(step.epoch, step.index, lo, hi)))
        return step, asked

    def _wait(self, step: Step, pieces: list[_Piece], supply: SlotSupply) -> float:
        """Waits until every piece of `step` has an answer, asking again for those unanswered
        past `timeout_s`; returns the seconds waited."""
        began = time.perf_counter()
        while True:
            missing = [piece for piece in pieces if piece.answer is None]
            if not missing:
                return time.perf_counter() - began
            supply.check_stop()
            refs = [ref for piece in missing for ref in piece.refs]
            ready = set(self.work.ready(refs, WAIT_SLICE_S))
            for piece in missing:
                answered = [ref for ref in piece.refs if ref in ready]
                if answered:
                    piece.answer = answered[0]
                    self.work.cancel([ref for ref in piece.refs if ref is not answered[0]])
                elif (
                    self.timeout_s is not None
                    and time.monotonic() - piece.asked_at > self.timeout_s
                ):
                    again = self.work.rows(step.epoch, step.index, piece.lo, piece.hi)
                    piece.refs.append(again)
                    piece.asked_at = time.monotonic()
                    self.asked_again += 1

    def _fill(self, step: Step, pieces: list[_Piece], supply: SlotSupply) -> tuple[Step, HostSlot]:
        """Copies the answers of `step`'s pieces into a slot, each at its rows."""
        slot = supply.acquire()
        skipped: list[Skip] = []
        try:
            for piece in pieces:
                buffer, packed = self.work.get(piece.answer)
                rows = piece.hi - piece.lo
                if rows not in self._layouts:
                    self._layouts[rows] = task_layout(self.layout.spec, rows)
                answer = HostSlot(self._layouts[rows], buffer=buffer)
                slot.write_rows(piece.lo, answer.regions[0], 0, rows)
                skipped += [
                    Skip(skip.row + piece.lo, skip.index, skip.error)
                    for skip in unpack_skips(packed, "a Ray task")
                ]
                del buffer, answer
        except BaseException:
            supply.give_back(slot)
            raise
        return handed_on(step, slot, skipped, self.ledger), slot

    def _cancel(self, window: collections.deque) -> None:
        """Cancels the tasks of the steps in `window`, none of which will be handed on."""
        asked = [each[1] for each in window if not isinstance(each, EpochEnd)]
        self.work.cancel([ref for pieces in asked for piece in pieces for ref in piece.refs])

    def close(self) -> None:
        """Cancels the tasks still out."""
        windows, self._windows = self._windows, []
        for window in windows:
            self._cancel(window)
