"""Consumer: the consumer's end of the pipeline: its position, its passes, and its state.

The position is what the consumer has taken, never what was produced: batches staged and not
taken are made again after a restore. Each loop over the feeder is a pass over the rest of the
current epoch, run by one loop (`Consumer.iterate`) that hands out the batches and moves the
position; what differs between a user's loop, a fit's pass, a pass read aside and a gathered
pass is their kind's (`feedpipe.passes`). A pass a framework's `fit` reads (`as_dataset`,
Keras's adapter) counts only what the fit trained on, which its ledger (`feedpipe.keras.ledger`)
says. A failure in the pipeline closes the feeder and is raised by every later read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

from feedpipe.assembly import Assembly
from feedpipe.core._sync import Failure
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.state import Position
from feedpipe.core.stats import FeedStats
from feedpipe.keras.ledger import FitLedger
from feedpipe.passes import KINDS, FitPass, GatheredPass, Loop, Pass


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
        self.last_fit: FitPass | None = None
        """The latest pass of `as_dataset`, ended or not: what a `fit` has been reading."""
        self.failure: BaseException | None = None
        """The error that closed the feeder: every later read raises it again."""
        self.closed = False
        self.lock = threading.RLock()
        """Held while the position or the passes change: a framework's threads begin and read
        the passes of `as_dataset` while the user's thread ends a fit or reads the state."""
        self.fits = FitLedger(self)
        """What the fits reading this feeder trained on."""
        self.lent: Loop | None = None
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
        left, self._active = self._active, this
        if left is not None and left is not this:
            left.on_closed(self)

    # ---- passes ---------------------------------------------------------------------------

    def iterate(
        self, kind: str, *, host: bool, steps: int | None = None, reader: Any = None
    ) -> Iterator[Any]:
        """One pass of `kind` (`feedpipe.passes.KINDS`: a user's "loop", a "fit"'s pass, a
        pass read "aside") over the rest of the current epoch (`steps` batches, where given),
        staged on the devices or, with `host`, kept on the host, run by the loop every kind
        shares (`Pass.run`); what a pass left early counts, or one read aside reads, is its
        kind's. `reader` is the record of the dataset read (see `FitPass.reader`).
        """
        with self.lock:
            fields = {} if reader is None else {"reader": reader}
            this = self.begin_pass(KINDS[kind], steps=steps, **fields)
            pipeline = self.assembly.start(host, this.start, self.stats)
        yield from this.run(self, pipeline)

    def block_ended(self, loop: Loop, epoch: int, step: int, *, failed: bool) -> None:
        """A `with` block on a batch the user's `loop` handed out ended (`Loop.block_ended`)."""
        loop.block_ended(self, epoch, step, failed=failed)

    @_locked
    def begin_pass(self, kind: type[Pass], *, steps: int | None, **fields: Any) -> Pass:
        """Begins a pass of `kind` from the consumer's position, superseding a `fit` pass
        still open (a user's loop refuses a second)."""
        if self.closed:
            if self.failure is not None:
                raise self.failure
            raise RuntimeError("The feeder is closed; build a new fp.Feeder to read again.")
        ahead = self.fits.reads_ahead(fields.get("reader"))
        if self.fits.read_ahead and not ahead:
            self.forget_unsettled()  # back to where the tracked fit ended
        if self.active is not None:
            if isinstance(self.active, Loop):
                raise RuntimeError(
                    "The feeder is already being iterated; finish or break that loop first "
                    "(one consumer per feeder)."
                )
            self.supersede()
        kind.prepare(self)
        if steps is not None:
            self.fits.check_passes_from(self.position, steps, None)
        self.passes += 1
        this = kind(self.position, self.stats.consumer_counters(), self.passes, **fields)
        this.on_begin(self, ahead)
        self.begun_at = this.start
        self.active = this
        self.lent = None
        return this

    def gathered_pass(self, steps: int | None, taken: Any) -> GatheredPass:
        """Begins a pass of `as_dataset()` whose batches the framework gathers itself, what
        `taken` records of it (see `GatheredPass`); `gathered_rows` plans its batches' rows."""
        return self.begin_pass(GatheredPass, steps=steps, taken=taken, reader=taken)

    def gathered_rows(self, this: GatheredPass) -> Iterator[tuple[int, Any, Any]]:
        """The batches of the gathered pass `this` to its epoch's end, a chunk of steps at a
        time (`Sampler.padded_chunks`): each chunk's first step, the rows of its batches
        (padded as a slot pads: the real rows repeated in order, so `HostSlot.pad` and this
        agree row for row) and each batch's count of real rows."""
        return self.assembly.plan.padded_chunks(this.start.epoch, this.start.step)

    def take(self, item: Any) -> Any:
        """`item` of the hand-off, taken; a failure closes the feeder and raises its error."""
        if isinstance(item, Failure):
            self.failure = item.error
            self.close()
            raise item.error
        return item

    @_locked
    def supersede(self) -> None:
        """Ends the pass of `as_dataset` being read (see `Pass.on_superseded`); with none, the
        position is what a tracker says the fit used."""
        left, self.active = self.active, None
        self.assembly.stop()
        if left is not None:
            left.on_superseded(self)
        elif self.fits.tracker is not None:
            self.position = self.fits.tracked()

    @_locked
    def end_open_pass(self) -> None:
        """Ends a fit pass left open (Keras's look at a batch, a pass read in part), so that
        the rest of the epoch is counted from what the step trained on."""
        if self.fits.read_ahead:
            self.forget_unsettled()
        elif self.active is not None and not isinstance(self.active, Loop):
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
            self.active.forgotten()
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
        if isinstance(self.active, Loop):
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
        return snapshot if self.active is None else self.active.with_taken(self, snapshot)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Refuses every later pass, and closes the pipeline's parts; idempotent."""
        self.closed = True
        self.assembly.close()
