"""Passes: the one loop of a pass over a feeder, and what each kind of pass does in it.

Every pass `Consumer.iterate` begins runs one loop (`Pass.run`), which hands out the batches and
moves the consumer's position; what differs between passes is their kind's, as hooks: as the
pass begins (`on_begin`), as it hands out a batch (`on_item`), as the consumer asks for the next
one (`on_next`), at the epoch's end (`on_epoch_end`), when the consumer leaves the pass early
(`on_exit`), when the next pass supersedes it (`on_superseded`), and once it is no longer the
active pass, whatever ended it (`on_closed`).

The kinds: a user's loop (`Loop`), a pass a framework's `fit` reads (`FitPass`: `as_dataset`,
Keras's adapter), a pass read aside for `predict` and `evaluate` (`AsidePass`), and a pass whose
batches the framework's threads gather themselves (`GatheredPass`, never run by the loop). Each
hook is given the consumer (`feedpipe.consumer.Consumer`) under its lock; this module imports
no consumer.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from feedpipe.core.remainder import warn_dropped
from feedpipe.core.sampler import EpochEnd
from feedpipe.core.state import Position
from feedpipe.core.stats import FeedStats

SUPERSEDED = (
    "This pass of a fit over the feeder (model.fit(feeder) or feeder.as_dataset()) was "
    "superseded: another loop over the feeder or its dataset began, or set_state() was called, "
    "before it ended. A feeder is one stream with one consumer: finish or drop one iterator "
    "before starting the next, and build a second fp.Feeder to read the same data twice at once."
)


@dataclasses.dataclass(eq=False, slots=True)
class Pass:
    """One loop over the feeder: where it started, the stats it started from, and what it has
    handed out; its kind's hooks say what each point of the loop does to the consumer."""

    start: Position
    counters: dict
    number: int
    """Passes begun on this feeder so far, this one included."""
    handed: int = 0
    """Batches handed to the consumer; a pass's batches are consecutive steps of one epoch."""
    end: Position | None = None
    """Where the next pass starts, once this one has reached the end of its epoch."""

    def after(self, count: int) -> Position:
        """The position once the consumer has used the first `count` batches of this pass."""
        if count == self.handed and self.end is not None:
            return self.end
        return Position(self.start.epoch, self.start.step + count)

    def run(self, consumer: Any, pipeline: Any) -> Iterator[Any]:
        """The loop every kind runs: hands `consumer` the batches `pipeline` hands over to the
        epoch's end, calling the kind's hooks; a pass superseded raises if read again."""
        plan = consumer.assembly.plan
        after = None  # the item after the one being handed over, where it was read already
        try:
            while True:
                item, after = consumer.take(pipeline.get() if after is None else after), None
                with consumer.lock:
                    if consumer.active is not self:
                        raise RuntimeError(SUPERSEDED)
                    if isinstance(item, EpochEnd):
                        if self.handed == 0 and self.start.step > 0:
                            # A state of an older release taken after the last batch of a
                            # source of unknown length can say (e, steps): that epoch is over,
                            # and this pass is the next one, never an empty one.
                            self.start = Position(item.epoch + 1, 0)
                            self.reaches(consumer, self.start)
                            continue
                        self.on_epoch_end(consumer, item)
                        return
                    self.on_item(consumer, item)
                    self.handed += 1
                    item.handed_over()
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
                    end = consumer.take(pipeline.get() if after is None else after)
                    with consumer.lock:
                        if consumer.active is self:
                            self.on_epoch_end(consumer, end)
                    yield item
                    with consumer.lock:
                        self.on_next(consumer)
                    return
                yield item
                with consumer.lock:
                    self.on_next(consumer)
                del item  # the slot returns when the consumer drops the batch, not this frame
        finally:
            # At interpreter exit a suspended loop is finalised after modules are torn down.
            with consumer.lock:
                if consumer.active is self and not sys.is_finalizing():
                    consumer.stats.loop_ended()
                    self.on_exit(consumer)

    @classmethod
    def prepare(cls, consumer: Any) -> None:
        """Readies the consumer for a pass of this kind, before its start is read."""

    def on_begin(self, consumer: Any, ahead: bool) -> None:
        """The pass begins (`ahead`: read ahead of the fit that ended, see
        `FitLedger.reads_ahead`)."""

    def reaches(self, consumer: Any, position: Position) -> None:
        """The batches handed out so far take the consumer to `position`."""
        consumer.position = position

    def on_item(self, consumer: Any, item: Any) -> None:
        """`item`, a batch, is handed to the consumer."""
        self.reaches(consumer, Position(item.epoch, item.step + 1))

    def on_next(self, consumer: Any) -> None:
        """The consumer asks for the batch after the one handed out."""

    def on_epoch_end(self, consumer: Any, end: EpochEnd) -> None:
        """The pass reached `end`, its epoch's end."""
        raise NotImplementedError

    def on_exit(self, consumer: Any) -> None:
        """The consumer left the pass before its epoch's end (`break`, an error, a dropped
        iterator) while it was still the active one."""
        raise NotImplementedError

    def on_superseded(self, consumer: Any) -> None:
        """The next pass begins while this one is open: the consumer's position is the end of
        its epoch where it reached it, else what the tracked fit used, else where the pass
        began (its batches will be made and taken again)."""
        if self.end is not None:
            consumer.position = self.end
        elif consumer.fits.tracker is not None:
            consumer.position = consumer.fits.tracked()
        else:
            consumer.position = self.start
            consumer.stats.restore_consumer(self.counters)

    def on_closed(self, consumer: Any) -> None:
        """The pass is no longer the active one, whatever ended it."""

    def forgotten(self) -> None:
        """The pass trained nothing (Keras's look at a batch to build the model)."""

    def with_taken(self, consumer: Any, snapshot: FeedStats) -> FeedStats:
        """The feeder's stats `snapshot` with what this pass took that they do not count yet."""
        return snapshot

    def finish(self, consumer: Any, end: EpochEnd) -> None:
        """The pass ends at `end`, its epoch's end: the consumer goes on from the next epoch."""
        self.end = Position(end.epoch + 1, 0)
        consumer.position = self.end
        if end.dropped and consumer.assembly.plan is None:
            warn_dropped(end.epoch, end.dropped)
        consumer.active = None


@dataclasses.dataclass(eq=False, slots=True)
class Loop(Pass):
    """A user's loop (`for batch in feeder`): it counts a batch once it takes it, takes it back
    with every batch taken after it where the batch's `with` block raised, and takes it again
    where a later `with` block on it ends well (see `block_ended`)."""

    given_back: Position | None = None
    """Where batches were given back: the position the loop had taken, which it takes again
    once it asks for its next batch."""
    redone: set[int] = dataclasses.field(default_factory=set)
    """Where batches were given back: the steps of those whose `with` block has since ended
    well (a retry), taken again once every batch before them is."""

    @classmethod
    def prepare(cls, consumer: Any) -> None:
        """A fit that raised ends before the loop reads its start."""
        consumer.fits.end_interrupted()

    def on_item(self, consumer: Any, item: Any) -> None:
        """`item` is taken, lent to the loop: its `with` block may give it back."""
        self.reaches(consumer, Position(item.epoch, item.step + 1))
        consumer.lent = self
        item._lender = (weakref.WeakMethod(consumer.block_ended), self)

    def on_next(self, consumer: Any) -> None:
        """What the loop gave back is taken again, the steps that raised over (the loop went
        on, past the error)."""
        if self.given_back is None or consumer.lent is not self:
            return
        consumer.position, self.given_back, self.redone = self.given_back, None, set()
        if consumer.active is not self:
            consumer.settle()

    def on_epoch_end(self, consumer: Any, end: EpochEnd) -> None:
        """The position is the loop's: settled."""
        self.finish(consumer, end)
        consumer.settle()

    def on_exit(self, consumer: Any) -> None:
        """The loop keeps its position: the next loop resumes there, the batches staged made
        again."""
        consumer.active = None
        consumer.assembly.stop()
        consumer.settle()

    def block_ended(self, consumer: Any, epoch: int, step: int, *, failed: bool) -> None:
        """A `with` block on batch `step` of `epoch`, handed out by this loop, ended.

        Where it `failed` (an exception left it: Ctrl-C, an error in the step), that batch and
        every batch the loop took after it are given back: `get_state()` and the next loop go
        on from it, also where the loop took the next batch before the step (one batch read
        ahead) or its epoch is over. Where it ended well after a give-back (a retry), the batch
        counts as taken again, and once every batch given back is, the loop's position is whole
        again. The loop asking for its next batch takes back everything given back (`on_next`).
        """
        if not failed and self.given_back is None:
            return  # the step as every step ends: nothing to take again
        with consumer.lock:
            if consumer.lent is not self or not self.handed_out(epoch, step):
                return
            if failed:
                if self.given_back is None:
                    self.given_back = consumer.position
                if Position(epoch, step) < consumer.position:
                    consumer.position = Position(epoch, step)
                self.redone = {done for done in self.redone if done < step}
            else:
                if self.given_back is None or (epoch, step) < tuple(consumer.position):
                    return
                self.redone.add(step)
                at = consumer.position.step
                while at in self.redone:
                    at += 1
                if at == self.start.step + self.handed:  # every batch given back is taken again
                    consumer.position, self.given_back, self.redone = self.given_back, None, set()
                else:
                    consumer.position = Position(epoch, at)
            if consumer.active is not self:  # its epoch was over: the pipeline runs on
                consumer.assembly.stop()
                consumer.settle()

    def handed_out(self, epoch: int, step: int) -> bool:
        """Whether batch `step` of `epoch` is one of the batches this loop handed out."""
        first = self.start.step
        return epoch == self.start.epoch and first <= step < first + self.handed


@dataclasses.dataclass(eq=False, slots=True)
class FitPass(Pass):
    """A pass a framework's `fit` reads (`as_dataset`, Keras's adapter). Left early, it does
    not count unless a `FitTracker` says which of its batches the step used, because TensorFlow
    prefetches batches the step never takes and Keras peeks at a batch to build the model: the
    next pass starts again where it began. TensorFlow finalises its iterators late, so such a
    pass is superseded by the next one begun."""

    reader: Any = None
    """For a pass of `as_dataset`: that dataset's own record, which tells its passes from
    another dataset's (see `FitLedger.reads_ahead`)."""

    def on_begin(self, consumer: Any, ahead: bool) -> None:
        """The pass is what a fit has been reading."""
        consumer.last_fit = self
        consumer.fits.begun(ahead)

    def on_epoch_end(self, consumer: Any, end: EpochEnd) -> None:
        """The skips no pass goes back to are folded (the position is settled once the fit's
        tracker says what it trained)."""
        self.finish(consumer, end)
        consumer.fold_skips()

    def on_exit(self, consumer: Any) -> None:
        consumer.supersede()


@dataclasses.dataclass(eq=False, slots=True)
class AsidePass(FitPass):
    """A pass read aside (Keras's `predict` and `evaluate`): a whole epoch, the current one
    from its first batch where the position is at an epoch's start, else the next, which
    leaves the consumer's position, and its stats, as they were."""

    def on_begin(self, consumer: Any, ahead: bool) -> None:
        """Mid-epoch, the pass reads the next epoch; what was staged goes on from the
        position."""
        if self.start.step > 0:
            self.start = Position(self.start.epoch + 1, 0)
            consumer.assembly.stop()

    def reaches(self, consumer: Any, position: Position) -> None:
        """The consumer's position stays where it was."""

    def on_epoch_end(self, consumer: Any, end: EpochEnd) -> None:
        self.end = Position(end.epoch + 1, 0)
        self.close(consumer)

    def on_exit(self, consumer: Any) -> None:
        self.close(consumer)

    def on_superseded(self, consumer: Any) -> None:
        consumer.stats.restore_consumer(self.counters)

    def close(self, consumer: Any) -> None:
        """Ends the pass: what was staged after it is made again from the position, and its
        batches leave the stats as they were."""
        consumer.active = None
        consumer.assembly.stop()
        consumer.stats.restore_consumer(self.counters)


@dataclasses.dataclass(eq=False, slots=True)
class GatheredPass(FitPass):
    """A pass of `as_dataset()` whose batches the framework gathers itself from the source's
    arrays, in its own threads, with no Python per batch (see `Consumer.gathered_pass`): what
    its consumer took is read from what the framework's threads record."""

    taken: Any = None
    """What the pass's consumer took, as the framework's threads record it (`TakenBatches`)."""
    measured: dict | None = None
    """What `taken` had timed when the pass began (see `taken_so_far`)."""
    counted: bool = False
    """The pass's batches are in the feeder's stats."""

    def on_begin(self, consumer: Any, ahead: bool) -> None:
        """The pass is what a fit has been reading; nothing the feeder's thread stages is read
        in it. Until it ends, the consumer's position is where it began: what `taken` records
        says how far it got (`catch_up`)."""
        FitPass.on_begin(self, consumer, ahead)
        consumer.assembly.stop()
        self.measured = self.taken.measured()
        self.taken.open(self.number)

    def catch_up(self, steps_per_epoch: int) -> None:
        """Reads how far the pass's consumer has got: `handed`, and `end` once it took the
        epoch's last batch."""
        step = self.taken.after(self.number)
        self.handed = 0 if step is None else step - self.start.step
        if step == steps_per_epoch:
            self.end = Position(self.start.epoch + 1, 0)

    def on_superseded(self, consumer: Any) -> None:
        if consumer.assembly.plan is not None:
            self.catch_up(len(consumer.assembly.plan))
        FitPass.on_superseded(self, consumer)

    def on_closed(self, consumer: Any) -> None:
        """Its batches still waiting in the framework's threads are refused when taken, as
        `Pass.run` refuses a superseded pass's; those taken join the stats."""
        self.taken.revoke(self.number)
        if not self.counted:
            self.counted = True
            consumer.stats.gathered(**self.taken_so_far(consumer))

    def forgotten(self) -> None:
        self.counted = True  # Keras's look, not a step

    def taken_so_far(self, consumer: Any) -> dict:
        """What the pass's consumer has taken so far, for the stats: its steps and samples,
        their time (the mean time from one taken batch to the next, times the steps), and the
        producer's (the framework's gathering) time and samples."""
        plan = consumer.assembly.plan
        self.catch_up(len(plan))
        now, then = self.taken.measured(), self.measured
        steps = max(self.handed, 0)
        if consumer.fits.tracker is not None:  # batches read ahead of the step trained nothing
            trained = consumer.fits.tracked()
            begun = self.start.epoch * len(plan) + self.start.step
            steps = max(0, min(steps, trained.epoch * len(plan) + trained.step - begun))
        intervals = now["intervals"] - then["intervals"]
        step_s = (now["step_us"] - then["step_us"]) / 1e6
        return {
            "steps": steps,
            "samples": plan.real_samples(self.start.step, self.start.step + steps),
            "wall_s": step_s / intervals * steps if intervals else 0.0,
            "busy_s": (now["busy_us"] - then["busy_us"]) / 1e6,
            "produced": now["made"] - then["made"],
        }

    def with_taken(self, consumer: Any, snapshot: FeedStats) -> FeedStats:
        if self.counted:
            return snapshot
        got, s = self.taken_so_far(consumer), snapshot
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


KINDS: dict[str, type[Pass]] = {"loop": Loop, "fit": FitPass, "aside": AsidePass}
"""The kinds of pass `Consumer.iterate` runs, by name: a user's loop, a fit's, one read aside."""
