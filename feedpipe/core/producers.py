"""Producers: who makes each batch and in what order; scheduling only.

A producer turns the plan of each epoch into filled slots, in order, behind one small interface
(`Producer.slots`). `ThreadProducer` makes them in the feeder's background thread
(`workers=0`). `WorkerProducer` hands the work to a pool of workers (`feedpipe.core.workers`):
the rows of each batch of an indexed source are split among them, and each worker of a
generator fills whole batches from its own shard. Either way the batches come out in the same
order with the same rows. The per-sample work is `feedpipe.core.writer`'s, wherever it runs.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from feedpipe.core._sync import WAIT_SLICE_S
from feedpipe.core.gather import Gathering, GatherPool
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import EpochEnd, Sampler, Step
from feedpipe.core.skips import SkipLedger, SkippedSample, describe, named
from feedpipe.core.slots import HostSlot
from feedpipe.core.state import Position
from feedpipe.core.workers import unpack_skips
from feedpipe.core.writer import RowStream, SampleWriter, Skip, cover


class SlotSupply(Protocol):
    """Where a producer gets host slots, and how it learns that it should stop."""

    def acquire(self) -> HostSlot:
        """A free slot; waits for one (raises `Stopped` when asked to stop)."""

    def try_acquire(self) -> HostSlot | None:
        """A free slot if there is one now, else None."""

    def give_back(self, slot: HostSlot) -> None:
        """Returns a slot the producer will not deliver."""

    def check_stop(self) -> None:
        """Raises `Stopped` if the pipeline is stopping."""

    def service_waited(self, seconds: float, lagging: bool = False) -> None:
        """Records time spent waiting for rows made elsewhere (tf.data service); `lagging`:
        one worker held them back while the others went on."""

    def take_dropped(self) -> list[int]:
        """Idents of one-off shared slots dropped since the last call."""


class Producer:
    """Makes the filled slots of every epoch from `start` on, in order.

    A producer whose source has a state of its own beyond the position (DALI's pipelines)
    returns it from `state_at` and takes it back in `restore`; for the others the position is
    the whole state.
    """

    slots_in_flight = 1
    """Slots being filled at once."""

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        raise NotImplementedError

    def state_at(self, position: Position) -> object | None:
        """What the source needs, besides `position`, to continue from it (JSON-safe)."""
        return None

    def restore(self, position: Position, state: object | None) -> None:
        """Makes the next stream start at `position`, from `state_at`'s `state`."""

    def close(self) -> None:
        """Forgets work still out once the workers are gone."""


def _last_batch(
    epoch: int, index: int, slot: HostSlot, count: int, rule: Remainder, read: int, supply
) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
    """The end of a stream's epoch: its last `count` rows in `slot`, after `read` samples."""
    if not (count and rule.pads):
        supply.give_back(slot)
        rule.check_stream_end(count, epoch, read)
        yield EpochEnd(epoch, dropped=count)
        return
    slot.pad(count)
    yield Step(epoch, index, None, count), slot
    yield EpochEnd(epoch)


def book_skips(step: Step, skipped: list[Skip], ledger: SkipLedger) -> Step:
    """`step` with its `skipped` rows left out, each booked in `ledger` (which raises past the
    budget); raises the last error where no real row of the batch is left."""
    for skip in skipped:
        kind, message = describe(skip.error)
        ledger.record(SkippedSample(step.epoch, skip.index, step.index, kind, message), skip.error)
    step = step.skipping([skip.row for skip in skipped])
    if step.num_valid <= 0:
        error = skipped[-1].error
        error.add_note(
            f'feedpipe: errors="skip" skipped every sample of step {step.index} of epoch '
            f"{step.epoch} (indices {named(skipped)}); a batch needs one real sample to be "
            "trained on. Fix the samples or the transform."
        )
        raise error
    return step


def handed_on(step: Step, slot: HostSlot, skipped: list[Skip], ledger: SkipLedger | None) -> Step:
    """`step` as its filled `slot` is handed on: the rows `errors="skip"` left out booked and
    covered with a real row, the rest of the batch padded."""
    if skipped:
        step = book_skips(step, skipped, ledger)
        cover(slot, [skip.row for skip in skipped], len(step.rows))
    slot.pad(len(step.rows))
    return step


def cut_rows(rows: np.ndarray, pieces: int, block_size: int) -> Iterator[tuple[int, np.ndarray]]:
    """`rows` cut into at most `pieces` runs, each where it begins, on whole source blocks
    where it can (a block is read once)."""
    size = -(-len(rows) // pieces)
    size = -(-size // block_size) * block_size
    for lo in range(0, len(rows), size):
        yield lo, rows[lo : lo + size]


class ThreadProducer(Producer):
    """Produces in the calling thread: the feeder's background thread when `workers=0`.

    With a `gather` pool (in-memory arrays without a transform, in batches big enough to
    share), each batch's rows are gathered in the pool's threads, and the next batch's gather
    starts before this one is handed on, so it runs while this one is staged. Invariant: the
    batches, their order and their rows are those of the plain path.
    """

    def __init__(
        self,
        writer: SampleWriter,
        global_batch_size: int,
        sampler: Sampler | None,
        rule: Remainder,
        ledger: SkipLedger | None = None,
        gather: GatherPool | None = None,
    ):
        self.writer = writer
        self.global_batch_size = global_batch_size
        self.sampler = sampler
        self.rule = rule
        self.ledger = ledger
        """Where `errors="skip"` books the samples it skips (None: `errors="raise"`)."""
        if gather is not None and not (writer.vectorised and sampler is not None):
            raise ValueError("A gather pool serves only arrays without a transform.")
        self.gather = gather
        """The threads gathering each batch of arrays (None: one `np.take` a field, here)."""

    @staticmethod
    def in_flight(gathering: bool) -> int:
        """Slots being filled at once: two where the next batch is gathered ahead (a plan
        sizes the slots by it before the producer exists)."""
        return 2 if gathering else 1

    @property
    def slots_in_flight(self) -> int:
        return self.in_flight(self.gather is not None)

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        for epoch in itertools.count(start.epoch):
            first = start.step if epoch == start.epoch else 0
            if self.gather is not None:
                yield from self._gathered_epoch(epoch, first, supply)
            elif self.sampler is not None:
                yield from self._indexed_epoch(epoch, first, supply)
            else:
                yield from self._stream_epoch(epoch, first, supply)

    def _indexed_epoch(self, epoch: int, first: int, supply: SlotSupply) -> Iterator:
        for step in self.sampler.steps(epoch, first):
            slot = supply.acquire()
            skipped = self.writer.fill(slot, step)
            if skipped:
                step = book_skips(step, skipped, self.ledger)
            yield step, slot
        self.writer.source.on_epoch_end()
        yield EpochEnd(epoch, self.sampler.dropped_per_epoch)

    def _gathered_epoch(self, epoch: int, first: int, supply: SlotSupply) -> Iterator:
        """`_indexed_epoch` with each batch gathered in the pool, the next one started before
        this one is handed on, into a slot that is free now (none is waited for: the pool
        holds one for it while the consumer keeps up)."""
        steps = self.sampler.steps(epoch, first)
        upcoming = next(steps, None)
        ahead: Gathering | None = None
        try:
            while upcoming is not None:
                if ahead is None:
                    ahead = self.gather.submit(supply.acquire(), upcoming)
                gathering, ahead = ahead, None
                gathering.wait()
                step, slot = gathering.step, gathering.slot
                slot.pad(len(step.rows))
                upcoming = next(steps, None)
                if upcoming is not None and (spare := supply.try_acquire()) is not None:
                    ahead = self.gather.submit(spare, upcoming)
                yield step, slot
        finally:
            if ahead is not None:  # started, never to be handed on: its slot goes back once
                with contextlib.suppress(Exception):  # no thread writes to it any more
                    ahead.wait()
                supply.give_back(ahead.slot)
        self.writer.source.on_epoch_end()
        yield EpochEnd(epoch, self.sampler.dropped_per_epoch)

    def close(self) -> None:
        """Stops the gather threads."""
        if self.gather is not None:
            self.gather.close()

    def _stream_epoch(self, epoch: int, first: int, supply: SlotSupply) -> Iterator:
        size = self.global_batch_size
        rows = RowStream(self.writer, epoch, size)
        rows.skip(first * size)
        for index in itertools.count(first):
            slot = supply.acquire()
            count = rows.read_into(slot)
            if count < size:
                yield from _last_batch(epoch, index, slot, count, self.rule, rows.position, supply)
                return
            yield Step(epoch, index, None, count), slot


MAX_TASKS_PER_WORKER = 2
"""Tasks queued at each worker: one running and one waiting, so no worker idles between them."""


class _Filling:
    """A slot that workers are filling: the step it will hold and the tasks still out."""

    __slots__ = (
        "abandoned",
        "errors",
        "give_back",
        "rows",
        "skipped",
        "slot",
        "step",
        "tasks",
        "worker",
    )

    def __init__(self, step: Step, slot: HostSlot, give_back, tasks: int, worker: int = -1):
        self.step = step
        self.slot = slot
        self.give_back = give_back
        self.tasks = tasks
        self.worker = worker
        self.rows = 0
        self.errors: list[tuple[int, BaseException]] = []
        self.skipped: list[Skip] = []
        self.abandoned = False

    def check(self) -> None:
        """Raises the error of the lowest row that failed, if any."""
        if self.errors:
            raise min(self.errors, key=lambda pair: pair[0])[1]


class WorkerProducer(Producer):
    """Produces with a pool of workers, delivering filled slots in the order of the plan.

    An indexed source's batch is cut into one run of rows per worker, so every worker helps
    with the oldest batch first and a batch is ready as soon as possible. A generator's workers
    each fill whole batches from their own shard, taken in strict rotation; when a shard runs
    out, its last partial batch is set aside, and at the end of the epoch those rows are
    merged into full batches and one last partial batch, which follows the remainder rule.
    Invariant: a slot goes back to the pool only when no worker will write to it again.
    """

    def __init__(
        self,
        workers,
        source,
        global_batch_size: int,
        sampler: Sampler | None,
        rule: Remainder,
        ledger: SkipLedger | None = None,
    ):
        self.workers = workers
        self.ledger = ledger
        """Where `errors="skip"` books the samples it skips (None: `errors="raise"`)."""
        self.size = global_batch_size
        self.sampler = sampler
        self.rule = rule
        self.block_size = source.block_size
        self._ids = itertools.count()
        self._tasks: dict[int, tuple[_Filling | None, int]] = {}
        """Tasks out: what each fills and its first row (None: a task without a slot)."""
        self._held: set[_Filling] = set()
        self._generation = 0

    @staticmethod
    def in_flight(indexed: bool, workers: int) -> int:
        """Slots being filled at once: two batches of an indexed source, one per shard (a plan
        sizes the slots by it before the producer exists)."""
        return 2 if indexed else workers

    @property
    def slots_in_flight(self) -> int:
        return self.in_flight(self.sampler is not None, self.workers.count)

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        self._generation += 1
        try:
            if self.sampler is not None:
                yield from self._indexed(start, supply)
            else:
                for epoch in itertools.count(start.epoch):
                    first = start.step if epoch == start.epoch else 0
                    yield from self._stream_epoch(epoch, first, supply)
        finally:
            # Tasks still out go on writing their slots: those return once they answer.
            for filling in self._held:
                if filling.tasks:
                    filling.abandoned = True
                else:
                    filling.give_back(filling.slot)
            self._held.clear()

    def settle(self, supply: SlotSupply) -> None:
        """Waits for the tasks still out (a stream of slots ended early leaves some), so every
        slot they fill is back in the pool: another producer takes over from here."""
        while self._tasks:
            self._collect(supply)

    def close(self) -> None:
        """Forgets the tasks still out once the workers are gone (none will answer), so the
        slots they were filling are freed with the pool."""
        self._tasks.clear()
        self._held.clear()

    # ---- talking to the workers -----------------------------------------------------------

    def _send(self, worker: int, filling: _Filling | None, first_row: int, task: tuple) -> None:
        task_id = next(self._ids)
        self._tasks[task_id] = (filling, first_row)
        if filling is not None:
            self.workers.share(worker, filling.slot)
        self.workers.submit(worker, (task[0], task_id, *task[1:]))

    def _collect(self, supply: SlotSupply) -> None:
        """Waits a little for replies and books them; raises if stopped or a worker failed."""
        supply.check_stop()
        self.workers.forget(supply.take_dropped())
        for reply in self.workers.replies(WAIT_SLICE_S):
            filling, first_row = self._tasks.pop(reply.task)
            if filling is None:
                if reply.kind == "error":
                    raise reply.value
                continue
            filling.tasks -= 1
            if reply.kind == "error":
                filling.errors.append((first_row, reply.value))
            elif filling.step is not None and filling.step.rows is not None:  # a "rows" task
                rows, skipped = reply.value
                filling.rows += rows
                filling.skipped += unpack_skips(skipped, self.workers.names[reply.worker])
            else:
                filling.rows += reply.value
            if filling.abandoned and not filling.tasks:
                filling.give_back(filling.slot)

    def _deliver(self, filling: _Filling) -> None:
        self._held.discard(filling)
        filling.check()
        if filling.slot.overflow and filling.slot.shared is not None:
            # No worker writes a one-off slot again: a batch the consumer keeps holds memory,
            # not a descriptor.
            filling.slot.shared.close()

    # ---- indexed sources ------------------------------------------------------------------

    def _plan(self, start: Position) -> Iterator[Step | EpochEnd]:
        for epoch in itertools.count(start.epoch):
            yield from self.sampler.steps(epoch, start.step if epoch == start.epoch else 0)
            yield EpochEnd(epoch, self.sampler.dropped_per_epoch)

    def _indexed(self, start: Position, supply: SlotSupply) -> Iterator:
        plan = self._plan(start)
        upcoming = next(plan)
        order: collections.deque[_Filling | EpochEnd] = collections.deque()
        runs: collections.deque = collections.deque()
        filling_now = 0
        while True:
            while filling_now < self.slots_in_flight:
                if isinstance(upcoming, EpochEnd):
                    order.append(upcoming)
                    runs.append(upcoming)
                    upcoming = next(plan)
                    continue
                slot = supply.try_acquire() if filling_now else supply.acquire()
                if slot is None:
                    break
                pieces = list(cut_rows(upcoming.rows, self.workers.count, self.block_size))
                filling = _Filling(upcoming, slot, supply.give_back, tasks=len(pieces))
                self._held.add(filling)
                order.append(filling)
                runs.extend((filling, lo, rows) for lo, rows in pieces)
                filling_now += 1
                upcoming = next(plan)
            self._dispatch(runs)
            delivered = False
            while order and (isinstance(order[0], EpochEnd) or not order[0].tasks):
                head = order.popleft()
                delivered = True
                if isinstance(head, EpochEnd):
                    yield head
                    continue
                self._deliver(head)
                filling_now -= 1
                yield handed_on(head.step, head.slot, head.skipped, self.ledger), head.slot
            if not delivered:
                self._collect(supply)

    def _dispatch(self, runs: collections.deque) -> None:
        """Sends queued runs of rows to the least busy workers, up to their task limit."""
        while runs:
            if isinstance(runs[0], EpochEnd):
                epoch = runs.popleft().epoch
                for worker in range(self.workers.count):
                    self._send(worker, None, 0, ("epoch_end", epoch))
                continue
            queued = self.workers.outstanding
            worker = min(range(self.workers.count), key=queued.__getitem__)
            if queued[worker] >= MAX_TASKS_PER_WORKER:
                return
            filling, lo, rows = runs.popleft()
            epoch = filling.step.epoch
            self._send(worker, filling, lo, ("rows", filling.slot.ident, epoch, lo, rows))

    # ---- generators -----------------------------------------------------------------------

    def _stream_epoch(self, epoch: int, first: int, supply: SlotSupply) -> Iterator:
        rotation = collections.deque(range(self.workers.count))
        order: collections.deque[_Filling] = collections.deque()
        busy: set[int] = set()
        tails: list[_Filling] = []
        index = read = 0
        while rotation or order:
            while rotation and rotation[0] not in busy:
                slot = supply.try_acquire() if order else supply.acquire()
                if slot is None:
                    break
                worker = rotation[0]
                rotation.rotate(-1)
                filling = _Filling(None, slot, supply.give_back, tasks=1, worker=worker)
                self._held.add(filling)
                order.append(filling)
                busy.add(worker)
                self._send(worker, filling, 0, ("stream", slot.ident, epoch, self._generation))
            delivered = False
            while order and not order[0].tasks:
                head = order.popleft()
                delivered = True
                busy.discard(head.worker)
                self._deliver(head)
                read += head.rows
                if head.rows < self.size:  # this shard is exhausted
                    rotation.remove(head.worker)
                    self._held.add(head)
                    tails.append(head)
                elif index >= first:
                    yield Step(epoch, index, None, self.size), head.slot
                    index += 1
                else:  # replayed to reach the position being resumed
                    head.give_back(head.slot)
                    index += 1
            if not delivered:
                self._collect(supply)
        yield from self._merge_tails(epoch, index, first, tails, read, supply)

    def _merge_tails(self, epoch, index, first, tails, read, supply) -> Iterator:
        """The rows of the shards' partial batches, as full batches and one last batch."""
        rows = [(tail.slot, row) for tail in tails for row in range(tail.rows)]
        done = 0
        while True:
            count = min(self.size, len(rows) - done)
            slot = supply.acquire()
            for row in range(count):
                slot.copy_row(row, *rows[done + row])
            done += count
            if count < self.size:
                for tail in tails:
                    self._held.discard(tail)
                    tail.give_back(tail.slot)
                if index < first:  # resumed after the epoch's last batch
                    supply.give_back(slot)
                    yield EpochEnd(epoch)
                    return
                yield from _last_batch(epoch, index, slot, count, self.rule, read, supply)
                return
            if index >= first:
                yield Step(epoch, index, None, count), slot
            else:
                supply.give_back(slot)
            index += 1
