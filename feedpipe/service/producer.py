"""The service's producer: fills each step's slot from the rows tf.data service jobs send.

Each job is read in a thread of its own, each arriving row written into its step's slot (or kept
until that slot opens), and a step handed on, in the plan's order, once all its rows are in.
Rows a job ended without, or that a lagging, stopped or dead worker holds, are asked of a new
job; a dispatcher that stops answering is waited for, then named in a ConnectionError. What a
row is, and how many travel together, is `feedpipe.service.client`'s `ServiceWork`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from feedpipe._internals.tf import dispatcher_error
from feedpipe.core._sync import WAIT_SLICE_S, Failure
from feedpipe.core.producers import Producer, SlotSupply
from feedpipe.core.sampler import EpochEnd, Sampler, Step
from feedpipe.core.slots import HostSlot
from feedpipe.core.state import Position
from feedpipe.service.client import ELEMENTS_QUEUED, JOB_SHIFT, ServiceWork

ANSWER_S = 2.0
"""Longest a check that the dispatcher is alive, mid-epoch, waits for its answer: a stopped
or hung dispatcher still accepts connections (the kernel does), so only an answer counts."""
STALL_S = 30.0
"""Longest the feeder waits for a row of a job that still owes rows before asking a new job for
them: a job whose worker died sends nothing more and never ends (TensorFlow 2.21). It doubles
for each new job that sends nothing either (slow to start, not lost)."""
DISPATCHER_LOST_S = 60.0
"""Longest the feeder waits for a row while the dispatcher does not answer: time for it to be
restarted (with `--work-dir`, it keeps its jobs); then reading fails with a ConnectionError.
Jobs the dispatcher forgot are asked for again within it too; past it, its error is raised."""
RELEASE_S = 3.0
"""Longest `close()` waits for the jobs' readers to let go of their jobs."""
FORGOTTEN_JOB = ("dispatcher restart", "Failed to get split")
"""What TensorFlow says when a dispatcher restarted without `--work-dir` forgot a job: to the
client it names the restart; through a worker that asks it for the job's next split, the split
is not found (a file the transform cannot find is also NotFound, and says neither)."""
WORKER_FAILED = "Failed to get element from worker"
"""How TensorFlow begins the message of an error a service worker sent while making an element."""
NOTE_SEARCH_S = 10.0
"""Longest the feeder runs `transform` here, on the samples still owed, to name the sample whose
error a service worker sent; the one that raised is among the first few hundred (the rows the
workers were making), unless it raises only on the workers."""


class ServiceProducer(Producer):
    """Fills each step's slot from the rows tf.data service sends, in any order, in full."""

    slots_in_flight = 2

    def __init__(self, work: ServiceWork, service: str, sampler: Sampler):
        self.work = work
        self.service = service
        self.sampler = sampler
        self.jobs = 0
        """Jobs started so far (more than one an epoch: rows asked for again)."""
        self._readers: list[threading.Thread] = []

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        try:
            for epoch in itertools.count(start.epoch):
                first = start.step if epoch == start.epoch else 0
                yield from self._epoch(epoch, self.sampler.steps(epoch, first), supply)
                yield EpochEnd(epoch, self.sampler.dropped_per_epoch)
        finally:
            self._release()

    def _start(self, indices: np.ndarray, epoch: int, positions: np.ndarray) -> _Job:
        job = _Job(functools.partial(self.work.job, self.service, indices, epoch), positions)
        self.jobs += 1
        self._readers = [t for t in self._readers if t.is_alive()] + [job.thread]
        return job

    def _release(self) -> None:
        """Waits up to `RELEASE_S` for the jobs' readers to let go of their jobs (TensorFlow
        ends a job as its iterator goes); a reader blocked by a lost worker or dispatcher is
        left, a daemon, to end when TensorFlow's read returns."""
        deadline = time.monotonic() + RELEASE_S
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))

    def _epoch(self, epoch: int, steps: Iterator[Step], supply: SlotSupply) -> Iterator:
        rows = _Rows(steps, supply, self.slots_in_flight, self.work.held_rows)
        job, patience, last_row = None, STALL_S, time.monotonic()
        waited, lagged = 0.0, False  # for the next step; whether a worker held its rows back
        try:
            while not rows.done():
                if job is None:  # the next rows still missing, as many as one job carries
                    positions, indices = rows.missing(self.work.rows_per_job)
                    job = self._start(indices, epoch, positions)
                supply.check_stop()
                asked = time.perf_counter()
                item = job.get()
                waited += time.perf_counter() - asked
                if isinstance(item, Failure):
                    lost_s = time.monotonic() - last_row
                    if not _forgotten(item.error) or lost_s > DISPATCHER_LOST_S:
                        # The rows the job still owes come first among those missing.
                        owed = rows.missing(self.work.rows_per_job)[1]
                        self._note_sample(item.error, owed, epoch, supply)
                        raise item.error
                    item = _Job.END  # its dispatcher restarted without a journal
                if item is None:  # nothing yet
                    step = rows.steps[0].index  # the next to hand on (rows are not done)
                    if job.idle_s() > patience and self._dispatcher_answers(job, epoch, step):
                        job.abandon()  # a worker died holding rows: ask a new job for them
                        job, lagged = None, True
                        patience *= 2  # unless jobs are slow to start: then wait longer
                    continue
                if item is _Job.END:
                    job = None  # rows it ended without are asked for again
                    continue
                positions, *leaves = item
                if not rows.arrived(positions, leaves):
                    job.abandon()  # a worker lags holding rows: ask a new job for them
                    job, lagged = None, True
                patience, last_row = STALL_S, time.monotonic()
                for delivered in rows.deliver():
                    supply.service_waited(waited, lagging=lagged)
                    waited, lagged = 0.0, False
                    yield delivered
        finally:
            if job is not None:
                job.abandon()
            rows.give_back()

    def _note_sample(
        self, error: BaseException, owed: np.ndarray, epoch: int, supply: SlotSupply
    ) -> None:
        """Adds to an error a service worker sent while making a sample (TensorFlow's message
        names the worker, never the sample) a note naming the sample, as a local run's says:
        the first of the samples still `owed` on which `transform` raises it here too."""
        if not isinstance(error, tf.errors.OpError) or WORKER_FAILED not in error.message:
            return
        until = time.monotonic() + NOTE_SEARCH_S
        index, tried = self.work.failing_sample(error, owed, epoch, until, supply.check_stop)
        if index is not None:
            error.add_note(
                f"feedpipe: raised on a tf.data service worker while producing sample index "
                f"{index} of epoch {epoch} (`transform` raises it on that sample here too)."
            )
        else:
            error.add_note(
                f"feedpipe: raised on a tf.data service worker while producing one of the "
                f"{len(owed)} samples of epoch {epoch} still owed; `transform` raised no such "
                f"error here on the first {tried} of them."
            )

    def _dispatcher_answers(self, job: _Job, epoch: int, step: int) -> bool:
        """Whether the dispatcher answers within `ANSWER_S`; raises once it has not for
        `DISPATCHER_LOST_S` without a row."""
        error = dispatcher_error(self.service.removeprefix("grpc://"), ANSWER_S)
        if error is not None and job.idle_s() > DISPATCHER_LOST_S:
            raise ConnectionError(
                f"the tf.data service dispatcher at {self.service} has not answered for "
                f"{job.idle_s():.0f} s ({error}), at step {step} of epoch {epoch}; "
                "every batch delivered before was whole. Restart it at the same address "
                "(`feedpipe service dispatcher --work-dir DIR --fault-tolerant` keeps its jobs) "
                "and go on from `feeder.get_state()`."
            )
        return error is None


def _forgotten(error: BaseException) -> bool:
    """Whether a job failed because its dispatcher restarted without `--work-dir` and so forgot
    it: its rows can be asked of a new job."""
    return isinstance(error, tf.errors.NotFoundError) and any(
        said in str(error) for said in FORGOTTEN_JOB
    )


class _Job:
    """One service job, read in a thread of its own: TensorFlow's iterator cannot be
    interrupted, and TensorFlow never ends a job whose worker died (nor sends what it held)
    until a worker serves again at that address. Until then such a thread stays blocked; the
    feeder asks a new job for the rows instead."""

    END = object()

    def __init__(self, make: Callable[[int], tf.data.Dataset], positions: np.ndarray):
        self.positions = positions
        """The epoch's row positions its tags index."""
        self.number = secrets.randbits(31)
        """The job's random number, in every tag of its rows (see `JOB_SHIFT`)."""
        self._items: queue.Queue = queue.Queue(maxsize=ELEMENTS_QUEUED)
        self._abandoned = threading.Event()
        self._last = time.monotonic()
        self.thread = threading.Thread(
            target=self._read, args=(make,), name="feedpipe-service-job", daemon=True
        )
        self.thread.start()

    def _read(self, make: Callable[[int], tf.data.Dataset]) -> None:
        """Makes the job (which waits for the dispatcher) and reads it, each element as the
        epoch's positions of its rows, then its fields."""
        owed = len(self.positions)
        try:
            for element in make(self.number):
                tags, *leaves = [value.numpy() for value in element]
                if np.any(tags >> JOB_SHIFT != self.number):
                    continue  # another job's rows, under a reused task number
                if not self._put([self.positions[tags & ((1 << JOB_SHIFT) - 1)], *leaves]):
                    return
                owed -= len(tags)
                if owed <= 0:  # all its rows are in: never wait for the job's end
                    break
            self._put(self.END)
        except BaseException as error:
            self._put(Failure(error))

    def _put(self, item: Any) -> bool:
        """Queues `item` unless the job was abandoned; False once it is."""
        while not self._abandoned.is_set():
            try:
                self._items.put(item, timeout=WAIT_SLICE_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        """The next element (positions, then fields), `END`, None if none came in a wait
        slice, or the `Failure` reading the job met."""
        try:
            item = self._items.get(timeout=WAIT_SLICE_S)
        except queue.Empty:
            return None
        self._last = time.monotonic()
        return item

    def idle_s(self) -> float:
        """Time since the job was asked for or last sent an element."""
        return time.monotonic() - self._last

    def abandon(self) -> None:
        """Stops reading once the thread's blocked read returns (if it ever does), and lets go
        of the elements queued: a reader blocked behind a stopped worker would keep them."""
        self._abandoned.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._items.get_nowait()


class _Rows:
    """An epoch's rows as they arrive, in any order: each is written into its step's slot if
    that slot is open (the next `window` steps, while the pool has slots), else kept until it
    is; a step is handed on, in order, once all its rows are in, and then forgotten.

    Steps are taken from the plan (`Sampler.steps`, lazy) only as far as the rows asked for
    reach (`missing`), so an epoch's or a restore's first job costs the planning of its own
    rows, however long the epoch. A row's position counts this host's rows of the epoch from
    the first step planned.

    Invariant: the rows kept outside the slots are at most those of the next `window` steps
    and `held` more (`HELD_BYTES`), each a copy of its own; a row past them is left missing,
    to be asked for again. Only the steps not yet handed on are known, as far as the furthest
    row asked for.
    """

    def __init__(self, plan: Iterator[Step], supply: SlotSupply, window: int, held: int):
        self.plan = plan
        self.supply = supply
        self.window = window
        self.held = held
        self.steps: list[Step] = []
        """The steps planned and not yet handed on, in order."""
        self.starts: list[int] = []
        """The position of each one's first row."""
        self.base = 0
        """The position of the first one's first row."""
        self.indices = np.zeros(0, np.int64)
        """The sample index of each of their rows, from position `base` on."""
        self.got = np.zeros(0, bool)
        """Whether each of their rows has arrived, from position `base` on."""
        self.kept: dict[int, list[np.ndarray]] = {}
        self.open: dict[int, HostSlot] = {}
        """Slots open, by the epoch's step number."""

    def done(self) -> bool:
        """Whether every step of the epoch has been handed on."""
        return not self.steps and not self._plan(1)

    def _plan(self, rows: int) -> int:
        """Takes steps from the plan until they hold `rows` rows more (fewer at the epoch's
        end); returns how many they hold."""
        planned: list[np.ndarray] = []
        count = 0
        while count < rows and (step := next(self.plan, None)) is not None:
            self.starts.append(self.base + len(self.got) + count)
            self.steps.append(step)
            planned.append(step.rows)
            count += len(step.rows)
        if planned:
            self.indices = np.concatenate([self.indices, *planned])
            self.got = np.concatenate([self.got, np.zeros(count, bool)])
        return count

    def missing(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions and sample indices of the first `count` rows not yet arrived (fewer
        at the epoch's end), planning steps as far as they reach."""
        owed = np.flatnonzero(~self.got)
        if len(owed) < count and self._plan(count - len(owed)):
            owed = np.flatnonzero(~self.got)
        owed = owed[:count]
        return self.base + owed, self.indices[owed]

    def _slot(self, step: int) -> HostSlot | None:
        """The open slot of `self.steps[step]`, opened now if it is near and the pool has one
        free."""
        number = self.steps[step].index
        if number not in self.open and step < self.window:
            slot = self.supply.try_acquire()
            if slot is not None:
                self._open(step, slot)
        return self.open.get(number)

    def _open(self, step: int, slot: HostSlot) -> None:
        """Opens `slot` for `self.steps[step]`, writing into it the step's rows kept so far."""
        self.open[self.steps[step].index] = slot
        lo = self.starts[step]
        hi = lo + len(self.steps[step].rows)
        for position in [p for p in self.kept if lo <= p < hi]:
            self._write(slot, position - lo, self.kept.pop(position))

    @staticmethod
    def _write(slot: HostSlot, row: int, leaves: list[np.ndarray]) -> None:
        for field, leaf in enumerate(leaves):
            slot.row(field, row)[0] = leaf

    def arrived(self, positions: np.ndarray, leaves: list[np.ndarray]) -> bool:
        """Takes an element's rows; False if some came too far ahead to keep (see the class):
        a worker lags, holding a row of an earlier step."""
        past_window = self.starts[self.window] if len(self.steps) > self.window else None
        limit = (self.base + len(self.got) if past_window is None else past_window) + self.held
        kept_all = True
        for row, position in enumerate(positions.tolist()):
            if position < self.base or self.got[position - self.base]:
                continue  # a row sent twice holds the same value: keep the first
            if position >= limit:
                kept_all = False
                continue
            self.got[position - self.base] = True
            step = bisect.bisect_right(self.starts, position) - 1
            slot = self._slot(step)
            if slot is None:  # a copy: a view would keep the element's other rows alive
                self.kept[position] = [leaf[row].copy() for leaf in leaves]
            else:
                self._write(slot, position - self.starts[step], [leaf[row] for leaf in leaves])
        return kept_all

    def deliver(self) -> Iterator[tuple[Step, HostSlot]]:
        """The next steps whose rows are all in, with their filled slots."""
        while self.steps and self.got[: len(self.steps[0].rows)].all():
            slot = self._slot(0)
            if slot is None:
                self._open(0, slot := self.supply.acquire())
            step = self.steps.pop(0)
            del self.open[step.index], self.starts[0]
            size = len(step.rows)
            self.base += size
            self.indices, self.got = self.indices[size:], self.got[size:]
            slot.pad(size)
            yield step, slot

    def give_back(self) -> None:
        """Returns the slots of steps that will not be handed on (the stream stopped)."""
        for slot in self.open.values():
            self.supply.give_back(slot)
        self.open.clear()
