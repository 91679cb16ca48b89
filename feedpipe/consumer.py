"""Consumer: the consumer's end of the pipeline: its position, its passes, and its state.

The position is what the consumer has taken, never what was produced: batches staged and not
taken are made again after a restore. Each loop over the feeder is a pass over the rest of the
current epoch; a pass a framework's `fit` reads (`as_dataset`, Keras's adapter) counts only what
the fit trained on, which its ledger (`feedpipe.keras.ledger`) says. A user's loop counts a
batch once it takes it, takes it back with every batch taken after it where the batch's `with`
block raised, and takes it again where a later `with` block on it ends well (see
`Consumer.block_ended`). A failure in the pipeline closes the feeder and is raised by every later
read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from feedpipe.assembly import Assembly
from feedpipe.core._sync import Failure
from feedpipe.core.pipeline import Pipeline
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.remainder import warn_dropped
from feedpipe.core.sampler import EpochEnd
from feedpipe.core.state import Position
from feedpipe.core.stats import FeedStats
from feedpipe.keras.ledger import FitLedger


@dataclasses.dataclass(eq=False, slots=True)
class Pass:
    """One loop over the feeder: its mode, where it started, and the stats it started from."""

    fit: bool
    """A pass a framework's `fit` reads (`as_dataset`, Keras's adapter), not the user's loop."""
    start: Position
    counters: dict
    number: int
    """Passes begun on this feeder so far, this one included."""
    handed: int = 0
    """Batches handed to the consumer; a pass's batches are consecutive steps of one epoch."""
    end: Position | None = None
    """Where the next pass starts, once this one has reached the end of its epoch."""
    taken: Any = None
    """For a pass whose batches the framework gathers itself (see `Consumer.gathered_pass`):
    what its consumer took, as the framework's threads record it (`TakenBatches`); None where
    this feeder hands out the batches and counts them as it does."""
    measured: dict | None = None
    """For a gathered pass: what `taken` had timed when it began (see `Consumer.gathered`)."""
    counted: bool = False
    """For a gathered pass: its batches are in the feeder's stats."""
    reader: Any = None
    """For a pass of `as_dataset`: that dataset's own record, which tells its passes from
    another dataset's (see `FitLedger.reads_ahead`)."""
    aside: bool = False
    """A pass read aside (`predict`, `evaluate`): a whole epoch that leaves the consumer's
    position, and its stats, as they were."""
    given_back: Position | None = None
    """For a user's loop whose batches were given back (see `Consumer.block_ended`): the
    position it had taken, which it takes again once it asks for its next batch."""
    redone: set[int] = dataclasses.field(default_factory=set)
    """For a user's loop whose batches were given back: the steps of those whose `with` block
    has since ended well (a retry), taken again once every batch before them is."""

    def catch_up(self, steps_per_epoch: int) -> None:
        """Reads how far the consumer of a gathered pass has got: `handed`, and `end` once it
        took the epoch's last batch."""
        if self.taken is None:
            return
        step = self.taken.after(self.number)
        self.handed = 0 if step is None else step - self.start.step
        if step == steps_per_epoch:
            self.end = Position(self.start.epoch + 1, 0)

    def after(self, count: int) -> Position:
        """The position once the consumer has used the first `count` batches of this pass."""
        if count == self.handed and self.end is not None:
            return self.end
        return Position(self.start.epoch, self.start.step + count)


SUPERSEDED = (
    "This pass of a fit over the feeder (model.fit(feeder) or feeder.as_dataset()) was "
    "superseded: another loop over the feeder or its dataset began, or set_state() was called, "
    "before it ended. A feeder is one stream with one consumer: finish or drop one iterator "
    "before starting the next, and build a second fp.Feeder to read the same data twice at once."
)


def _locked(method):
    """`method` under its consumer's `lock`."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class Consumer:
    """The position of one feeder's consumer, and the passes that move it.

    Invariant: at most one pass is active; a user's loop refuses a second, and a fit's pass is
    superseded by the next one begun (TensorFlow finalises its iterators late).
    """

    def __init__(self, assembly: Assembly, stats: StatsRecorder):
        self.assembly = assembly
        self.stats = stats
        self.position = Position(0, 0)
        """What the consumer has taken, as the step of the epoch it goes on from."""
        self._active: Pass | None = None
        self.passes = 0
        """Passes begun so far."""
        self.last_fit: Pass | None = None
        """The latest pass of `as_dataset`, ended or not: what a `fit` has been reading."""
        self.failure: BaseException | None = None
        """The error that closed the feeder: every later read raises it again."""
        self.closed = False
        self.lock = threading.RLock()
        """Held while the position or the passes change: a framework's threads begin and read
        the passes of `as_dataset` while the user's thread ends a fit or reads the state."""
        self.fits = FitLedger(self)
        """What the fits reading this feeder trained on."""
        self.lent: Pass | None = None
        """The user's loop that handed out batches last, until another pass begins or the
        position is set: the loop whose batches a `with` block may give back."""
        self.begun_at = self.position
        """Where the last pass began: a loop that raises gives back batches from there on."""
        self.aside_from: Position | None = None
        """Inside `set_aside`, the position its block returns to."""
        self.settle()

    @property
    def active(self) -> Pass | None:
        """The pass being iterated, if any."""
        return self._active

    @active.setter
    def active(self, this: Pass | None) -> None:
        # Whatever ends a gathered pass, its batches still waiting in the framework's threads
        # must be refused when taken, as `iterate` refuses a superseded pass's.
        left, self._active = self._active, this
        if left is not None and left is not this and left.taken is not None:
            left.taken.revoke(left.number)
            if not left.counted:
                left.counted = True
                self.stats.gathered(**self.gathered(left))

    # ---- passes ---------------------------------------------------------------------------

    def iterate(
        self,
        *,
        fit: bool,
        host: bool,
        steps: int | None = None,
        reader: Any = None,
        aside: bool = False,
    ) -> Iterator[Any]:
        """One pass over the rest of the current epoch (`steps` batches, where given), staged
        on the devices or, with `host`, kept on the host; with `aside` (Keras's `predict` and
        `evaluate`), a whole epoch read aside: the current one from its first batch where the
        position is at an epoch's start, else the next, and the position stays where it was.

        A loop left early keeps its position (the next loop resumes there), a batch whose
        `with` block raised given back with every batch after it (see `block_ended`). A `fit` pass
        (`as_dataset`, Keras's adapter) left early does not count unless a `FitTracker` says
        which of its batches the step used, because TensorFlow prefetches batches the step never
        takes and Keras peeks at a batch to build the model: the next pass starts again where
        it began. Such a pass, if TensorFlow finalises it late, is superseded, and raises if
        read again. `reader` is the record of the dataset read (see `Pass.reader`).
        """
        with self.lock:
            this = self.begin_pass(fit=fit, steps=steps, reader=reader, aside=aside)
            pipeline = self.assembly.start(host, this.start, self.stats)
        plan = self.assembly.plan
        after = None  # the item after the one being handed over, where it was read already
        try:
            while True:
                item, after = (self._next(pipeline) if after is None else self._taken(after)), None
                with self.lock:
                    if self.active is not this:
                        raise RuntimeError(SUPERSEDED)
                    if isinstance(item, EpochEnd):
                        if this.handed == 0 and this.start.step > 0:
                            # A state of an older release taken after the last batch of a
                            # source of unknown length can say (e, steps): that epoch is over,
                            # and this pass is the next one, never an empty one.
                            this.start = Position(item.epoch + 1, 0)
                            if not aside:
                                self.position = this.start
                            continue
                        self._end_epoch(this, item)
                        return
                    if not aside:
                        self.position = Position(item.epoch, item.step + 1)
                    this.handed += 1
                    item.handed_over()
                    if not fit:
                        self.lent = this
                        item._lender = (weakref.WeakMethod(self.block_ended), this)
                if plan is None:
                    # A source of unknown length learns its epoch's end by reading on: it is
                    # read before the batch goes, so that the state after an epoch's last step
                    # says (e + 1, 0), as it does where the length is known. A failure read
                    # so is raised once this batch is done, as it would be without reading on.
                    after = pipeline.get()
                    last = isinstance(after, EpochEnd)
                else:
                    last = item.step + 1 == len(plan)
                if last:
                    # The epoch's end is taken with its last batch: Keras never asks past it,
                    # nor does a loop that takes len(feeder) batches (islice, zip with range).
                    end = self._next(pipeline) if after is None else after
                    with self.lock:
                        if self.active is this:
                            self._end_epoch(this, end)
                    yield item
                    self._asks_for_next(this)
                    return
                yield item
                self._asks_for_next(this)
                del item  # the slot returns when the consumer drops the batch, not this frame
        finally:
            # At interpreter exit a suspended loop is finalised after modules are torn down.
            with self.lock:
                if self.active is this and not sys.is_finalizing():
                    self.stats.loop_ended()
                    if aside:
                        self._end_aside(this)
                    elif fit:
                        self.supersede()
                    else:
                        self.active = None
                        self.assembly.stop()  # staged batches are made again by the next loop
                        self.settle()

    def block_ended(self, loop: Pass, epoch: int, step: int, *, failed: bool) -> None:
        """A `with` block on batch `step` of `epoch`, handed out by the user's `loop`, ended.

        Where it `failed` (an exception left it: Ctrl-C, an error in the step), that batch and
        every batch the loop took after it are given back: `get_state()` and the next loop go
        on from it, also where the loop took the next batch before the step (one batch read
        ahead) or its epoch is over. Where it ended well after a give-back (a retry), the batch
        counts as taken again, and once every batch given back is, the loop's position is whole
        again. The loop asking for its next batch takes back everything given back: the loop
        went on, past the step that raised.
        """
        if not failed and loop.given_back is None:
            return  # the step as every step ends: nothing to take again
        with self.lock:
            if self.lent is not loop or not self._handed_by(loop, epoch, step):
                return
            if failed:
                if loop.given_back is None:
                    loop.given_back = self.position
                if Position(epoch, step) < self.position:
                    self.position = Position(epoch, step)
                loop.redone = {done for done in loop.redone if done < step}
            else:
                if loop.given_back is None or (epoch, step) < tuple(self.position):
                    return
                loop.redone.add(step)
                at = self.position.step
                while at in loop.redone:
                    at += 1
                if at == loop.start.step + loop.handed:  # every batch given back is taken again
                    self.position, loop.given_back, loop.redone = loop.given_back, None, set()
                else:
                    self.position = Position(epoch, at)
            if self.active is not loop:  # its epoch was over: the pipeline runs on into the next
                self.assembly.stop()
                self.settle()

    @staticmethod
    def _handed_by(loop: Pass, epoch: int, step: int) -> bool:
        """Whether batch `step` of `epoch` is one of the batches `loop` handed out."""
        first = loop.start.step
        return epoch == loop.start.epoch and first <= step < first + loop.handed

    @_locked
    def _asks_for_next(self, loop: Pass) -> None:
        """The user's `loop` asks for its next batch: what it gave back is taken again, the
        steps that raised over (the loop went on, past the error)."""
        if loop.given_back is None or self.lent is not loop:
            return
        self.position, loop.given_back, loop.redone = loop.given_back, None, set()
        if self.active is not loop:
            self.settle()

    @_locked
    def begin_pass(
        self,
        *,
        fit: bool,
        steps: int | None,
        taken: Any = None,
        reader: Any = None,
        aside: bool = False,
    ) -> Pass:
        """Begins a pass from the consumer's position, superseding a `fit` pass still open;
        with `aside`, a pass of a whole epoch that leaves the position as it is (see
        `iterate`)."""
        if self.closed:
            if self.failure is not None:
                raise self.failure
            raise RuntimeError("The feeder is closed; build a new fp.Feeder to read again.")
        ahead = fit and self.fits.reads_ahead(reader)
        if self.fits.read_ahead and not ahead:
            self.forget_unsettled()  # back to where the tracked fit ended
        if self.active is not None:
            if not self.active.fit:
                raise RuntimeError(
                    "The feeder is already being iterated; finish or break that loop first "
                    "(one consumer per feeder)."
                )
            self.supersede()
        if not fit:
            self.fits.end_interrupted()
        if steps is not None:
            self.fits.check_passes_from(self.position, steps, None)
        self.passes += 1
        counters = self.stats.consumer_counters()
        start = self.position
        if aside and start.step > 0:
            start = Position(start.epoch + 1, 0)
            self.assembly.stop()  # what it staged goes on from the position
        this = Pass(fit, start, counters, self.passes, taken=taken, reader=reader, aside=aside)
        self.begun_at = start
        self.active = this
        self.lent = None
        if fit and not aside:
            self.last_fit = this
            self.fits.begun(ahead)
        return this

    @_locked
    def gathered_pass(self, steps: int | None, taken: Any) -> Pass:
        """Begins a pass of `as_dataset()` whose batches the framework gathers itself from the
        source's arrays, in its own threads, with no Python per batch; `gathered_rows` plans
        its batches' rows as the framework reads them.

        The consumer's position follows from what `taken` records of the pass (see
        `Pass.catch_up`), read when the pass ends; until then `position` is where it began.
        """
        this = self.begin_pass(fit=True, steps=steps, taken=taken, reader=taken)
        self.assembly.stop()  # nothing the feeder's thread stages is read in such a pass
        this.measured = taken.measured()
        taken.open(this.number)
        return this

    def gathered_rows(self, this: Pass) -> Iterator[tuple[int, Any, Any]]:
        """The batches of the gathered pass `this` to its epoch's end, a chunk of steps at a
        time (`Sampler.padded_chunks`): each chunk's first step, the rows of its batches
        (padded as a slot pads: the real rows repeated in order, so `HostSlot.pad` and this
        agree row for row) and each batch's count of real rows."""
        return self.assembly.plan.padded_chunks(this.start.epoch, this.start.step)

    def gathered(self, this: Pass) -> dict:
        """What the consumer of the gathered pass `this` has taken so far, for the stats: its
        steps and samples, their time (the mean time from one taken batch to the next, times
        the steps), and the producer's (the framework's gathering) time and samples."""
        per_epoch = len(self.assembly.plan)
        this.catch_up(per_epoch)
        now, then = this.taken.measured(), this.measured
        steps = max(this.handed, 0)
        if self.fits.tracker is not None:  # batches read ahead of the step were not trained on
            trained = self.fits.tracked()
            begun = this.start.epoch * per_epoch + this.start.step
            steps = max(0, min(steps, trained.epoch * per_epoch + trained.step - begun))
        intervals = now["intervals"] - then["intervals"]
        step_s = (now["step_us"] - then["step_us"]) / 1e6
        return {
            "steps": steps,
            "samples": self.assembly.plan.real_samples(this.start.step, this.start.step + steps),
            "wall_s": step_s / intervals * steps if intervals else 0.0,
            "busy_s": (now["busy_us"] - then["busy_us"]) / 1e6,
            "produced": now["made"] - then["made"],
        }

    def _next(self, pipeline: Pipeline) -> Any:
        """The next item of the hand-off; a failure closes the feeder and raises its error."""
        return self._taken(pipeline.get())

    def _taken(self, item: Any) -> Any:
        """`item` of the hand-off, taken; a failure closes the feeder and raises its error."""
        if isinstance(item, Failure):
            self.failure = item.error
            self.close()
            raise item.error
        return item

    def _end_epoch(self, this: Pass, end: EpochEnd) -> None:
        this.end = Position(end.epoch + 1, 0)
        if this.aside:
            self._end_aside(this)
            return
        self.position = this.end
        if end.dropped and self.assembly.plan is None:
            warn_dropped(end.epoch, end.dropped)
        self.active = None
        if not this.fit:
            self.settle()
        else:
            self.fold_skips()

    def _end_aside(self, this: Pass) -> None:
        """Ends the pass read aside `this`: what was staged after it is made again from the
        position, and its batches leave the stats as they were."""
        self.active = None
        self.assembly.stop()
        self.stats.restore_consumer(this.counters)

    @_locked
    def supersede(self) -> None:
        """Ends the pass of `as_dataset` being read: the consumer's position is the end of its
        epoch where a gathered pass's last batch was taken, else what a tracker says it used,
        else where the pass began (its batches will be made and taken again)."""
        left, self.active = self.active, None
        self.assembly.stop()
        if left is not None and left.aside:
            self.stats.restore_consumer(left.counters)
            return
        if left is not None and self.assembly.plan is not None:
            left.catch_up(len(self.assembly.plan))
        if left is not None and left.end is not None:
            self.position = left.end  # a gathered pass whose last batch was taken
        elif self.fits.tracker is not None:
            self.position = self.fits.tracked()
        elif left is not None:
            self.position = left.start
            self.stats.restore_consumer(left.counters)

    @_locked
    def end_open_pass(self) -> None:
        """Ends a fit pass left open (Keras's look at a batch, a pass read in part), so that
        the rest of the epoch is counted from what the step trained on."""
        if self.fits.read_ahead:
            self.forget_unsettled()
        elif self.active is not None and self.active.fit:
            self.supersede()

    # ---- where the consumer is ------------------------------------------------------------

    @_locked
    def settle(self) -> None:
        """The position is the consumer's now (set_state, the end of a `for` loop or of a
        tracked `fit`): later passes of `as_dataset` may be Keras's look at a batch."""
        self._settled = (self.position, self.passes)
        self._settled_counters = self.stats.consumer_counters()
        self.fits.settled()
        self.fold_skips()

    def fold_skips(self) -> None:
        """Folds the skips of the batches that no pass goes back to into their epoch's count
        (`SkipLedger.fold_before`): those before every position the consumer may return to,
        where it was settled, the start of the last pass (a loop that raised gives its batches
        back), what a tracked fit trained, where a block read aside ends."""
        if self.assembly.skips is None:
            return
        returns = [self.position, self.begun_at]
        if self.fits.tracker is None:
            returns.append(self._settled[0])
        else:
            returns.append(self.fits.tracked())
        if self.aside_from is not None:
            returns.append(self.aside_from)
        self.assembly.skips.fold_before(min(returns))

    @_locked
    def forget_unsettled(self) -> None:
        """Passes of `as_dataset` since the position was last settled trained nothing (Keras's
        look at a batch to build the model): the position and the stats go back to then."""
        position, passes = self._settled
        if self.passes == passes:
            return
        if self.active is not None:
            self.active.counted = True  # Keras's look, not a step
        self.active = None
        self.assembly.stop()
        self.position = position
        self.stats.restore_consumer(self._settled_counters)
        self.settle()

    @_locked
    def move_to(self, position: Position) -> None:
        """Ends any pass and goes on from `position` (a tracked fit's end)."""
        if position != self.position or self.active is not None:
            self.active = None
            self.assembly.stop()
            self.position = position

    @_locked
    def untake(self, batch: Any) -> None:
        """`batch` and the batches taken after it trained nothing (the step raised): the next
        loop begins at it. Call once the loop that took them is closed."""
        self.assembly.stop()
        self.position = Position(batch.epoch, batch.step)
        self.settle()

    def steps_left(self, position: Position | None = None) -> int | None:
        """Batches left in the epoch of `position` (the consumer's by default; None where the
        length is unknown): a feeder left or restored mid-epoch serves the rest of that epoch
        in a fit's first pass."""
        plan = self.assembly.plan
        if plan is None:
            return None
        position = self.position if position is None else position
        return len(plan) - self.assembly.stream().state(position)["step"]

    def consumed(self) -> Position:
        """The batches the consumer has used, as a position."""
        if self.fits.tracker is not None:
            return self.fits.tracked()
        if self.fits.read_ahead:
            return self._settled[0]
        if self.fits.untracked:
            entry = self.fits.entry
            raise RuntimeError(
                f"get_state() cannot tell which batches model.fit({entry}) trained on: Keras "
                f"takes batches ahead of the step (and reads some to build the model), so the "
                f"batches handed out are not the ones used. Pass the feeder's callback to fit, "
                f"model.fit({entry}, callbacks=[feeder.fit_callback(), ...]), and the state is "
                "exactly the batches the step consumed; in a loop of your own, iterate the feeder "
                "(for batch in feeder), whose state is exact."
            )
        return self.position

    @_locked
    def get_state(self) -> dict:
        """The consumer's position as a state, with the source's own where it keeps one."""
        state = self.assembly.stream().state(self.consumed())
        position = Position(state["epoch"], state["step"])
        source_state = self.assembly.producer.state_at(position)
        if source_state is not None:  # a DALI source: its pipelines' own checkpoints
            state["source"] = source_state
        if self.assembly.skips is not None:  # the epoch's skips count against its budget
            state.update(self.assembly.skips.state(position))
        return state

    @_locked
    def set_state(self, state: dict) -> None:
        """Goes on from where `state` was taken; staged batches are remade."""
        if self.active is not None and not self.active.fit:
            raise RuntimeError(
                "set_state() was called while a loop over the feeder is running; restore "
                "before the loop starts (or break out of it first)."
            )
        assembly = self.assembly
        position = assembly.stream().position(state)
        if position.step > 0:
            assembly.source.check_resumable(position.step * assembly.options.global_batch_size)
        self.active = None
        assembly.stop()
        self.position = position
        self.lent = None
        self.fits.interrupted_at = None
        assembly.producer.restore(self.position, state.get("source"))
        if assembly.skips is not None:
            assembly.skips.restore(state)
        self.settle()

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A block whose reads train nothing (see `Feeder.set_aside`)."""
        self.fits.end_interrupted()
        self.end_open_pass()
        position = self.aside_from = self.position
        if position.step > 0 and self.assembly.plan is not None:
            self.assembly.stop()
            self.position = Position(position.epoch + 1, 0)
        try:
            yield
        finally:
            self.active = None
            self.assembly.stop()
            self.position, self.aside_from = position, None
            self.settle()

    def snapshot(self) -> FeedStats:
        """The stats so far, with what the consumer of a gathered pass being read has taken."""
        snapshot = self.stats.snapshot(**self.assembly.slot_stats())
        if self.assembly.skips is not None:
            taken, unlisted = self.assembly.skips.before(self.position)
            snapshot = dataclasses.replace(
                snapshot, skipped=tuple(taken), skipped_unlisted=unlisted
            )
        this = self.active
        if this is None or this.taken is None or this.counted:
            return snapshot
        got, s = self.gathered(this), snapshot
        return dataclasses.replace(
            s,
            steps=s.steps + got["steps"],
            samples=s.samples + got["samples"],
            wall_s=s.wall_s + got["wall_s"],
            untimed_steps=s.untimed_steps + got["steps"],
            untimed_s=s.untimed_s + got["wall_s"],
            producer_busy_s=s.producer_busy_s + got["busy_s"],
            produced_samples=s.produced_samples + got["produced"],
        )

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Refuses every later pass, and closes the pipeline's parts; idempotent."""
        self.closed = True
        self.assembly.close()
