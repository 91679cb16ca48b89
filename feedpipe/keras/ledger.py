"""Ledger: what a Keras `fit` reading a feeder has trained on, and which fits can go on.

TensorFlow and Keras take batches ahead of the step, and Keras reads one to build the model, so
during a `fit` the batches a feeder handed out are not the ones trained on. A fit's
`FitTracker` (`feedpipe.keras.fit`) reports its steps here; the consumer's position follows
from them (`tracked`). A fit that raised (an error, Ctrl-C) never says it ended: the next read
of the feeder ends it (`end_interrupted`). The ledger also refuses fits whose epochs cannot be
the feeder's, naming the call that goes on. It imports no framework: the consumer keeps one.
"""

from __future__ import annotations

from typing import Any

from feedpipe.core.state import Position


class FitLedger:
    """The fits that read one consumer's feeder: the one running (its tracker), where it began,
    and where the last one was interrupted."""

    def __init__(self, consumer: Any):
        """`consumer` is the `feedpipe.consumer.Consumer` whose position the fits move."""
        self.consumer = consumer
        self.tracker: Any = None
        """The `FitTracker` of the `model.fit` reading the feeder, if any."""
        self.fit_start = Position(0, 0)
        """Where the tracked `fit` began."""
        self.untracked = False
        """Passes of `as_dataset` were read since the position was settled, with no tracker."""
        self.ended_reader: Any = None
        """The dataset the last tracked `fit` read (its record, `FitPass.reader`), until the
        position is next settled: TensorFlow's threads may begin passes of it after the fit
        ended (a `repeat().prefetch()` reads on until Keras drops its iterator)."""
        self.read_ahead = False
        """The passes begun since the tracked `fit` ended were all such passes: they trained
        nothing, and the position is still where the fit ended."""
        self.interrupted_at: Position | None = None
        """Where the last tracked `fit` stopped, if it raised (an error, Ctrl-C)."""
        self.entry = "feeder"
        """What the latest fit was given, as the user wrote it in `model.fit(...)`: the feeder
        itself, or on TensorFlow "feeder.as_dataset()"; messages name it."""

    def track(self, tracker: Any) -> None:
        """A tracked `fit` begins: passes of `as_dataset` since the position was last settled
        were Keras's look at a batch to build the model, not training. A fit on the same
        dataset that raised goes on from what it trained. No pass begun before it is one of
        its own, where the epochs' length is unknown and passes mark their ends (`tracked`)."""
        with self.consumer.lock:
            self.end_interrupted()
            self.consumer.forget_unsettled()
            self.fit_start = self.consumer.position
            tracker.first_pass = self.consumer.passes  # an earlier fit's passes are not its
            self.tracker = tracker

    def untrack(self, tracker: Any) -> None:
        """A tracked `fit` ended: the position becomes what it trained on."""
        with self.consumer.lock:
            if self.tracker is not tracker:
                return
            self.consumer.move_to(self.tracked())  # while the tracker says what it trained
            self.tracker = None
            self.consumer.settle()
            last = self.consumer.last_fit
            self.ended_reader = None if last is None else last.reader

    def reads_ahead(self, reader: Any) -> bool:
        """Whether a pass of `as_dataset` read from `reader` is read ahead of the tracked `fit`
        that ended last: the dataset that fit read, with nothing else read or restored since.
        A second iterator of that same dataset, made by the user after the fit, cannot be told
        from TensorFlow's; give each fit the feeder's callback (or a dataset of its own)."""
        return self.tracker is None and reader is not None and reader is self.ended_reader

    def begun(self, ahead: bool) -> None:
        """A pass of `as_dataset` begins (`ahead`: read ahead of the ended fit, see
        `reads_ahead`): with no tracker, what it trains is unknown."""
        if ahead:
            self.read_ahead = True
        elif self.tracker is None:
            self.untracked = True

    def settled(self) -> None:
        """The position is the consumer's now (see `Consumer.settle`)."""
        self.untracked = self.read_ahead = False
        self.ended_reader = None

    def end_interrupted(self) -> None:
        """A `fit` that raised (an error, Ctrl-C) never tells its tracker it ended: what it
        trained on becomes the position before anything else reads the feeder."""
        with self.consumer.lock:
            if self.tracker is not None:
                self.tracker.interrupted()
                self.untrack(self.tracker)
                self.interrupted_at = self.consumer.position

    def tracked(self) -> Position:
        """The position after the batches the tracked `fit` has trained on: the fit's start
        moved on by its steps, whatever reads ahead (`prefetch`) or repeats the dataset; where
        the epochs' length is unknown, the passes of the dataset mark their ends."""
        consumer = self.consumer
        if consumer.assembly.plan is not None:
            return consumer.assembly.stream().after(self.fit_start, self.tracker.trained)
        last, tracker = consumer.last_fit, self.tracker
        if last is None or last.number <= tracker.first_pass:
            return consumer.position  # this epoch's pass has not begun: it begins there
        return last.after(min(tracker.finished, last.handed))

    def line_up(self, epoch: int, *, restored: bool) -> None:
        """Lines Keras's first epoch of a tracked fit, `epoch`, up with the feeder's. Where
        `BackupAndRestore` `restored` the model to begin that epoch, Keras trains it from its
        first step, and so does the feeder, wherever it was, as a fit on arrays would. A feeder
        that has trained nothing goes on from the start of Keras's `initial_epoch`; one at
        another epoch is refused, naming the `initial_epoch` that goes on with it."""
        if epoch == 0 and not restored:
            return  # a first fit, or a fit again in the same process: Keras counts anew
        with self.consumer.lock:
            position = self.tracked()
            stream = self.consumer.assembly.stream()
            if position == Position(0, 0) or restored:
                self.consumer.set_state(stream.state(Position(epoch, 0)))
                self.fit_start = self.consumer.position
                return
            state = stream.state(position)
        if state["epoch"] != epoch:
            raise ValueError(
                f"Keras begins this fit at epoch {epoch} (initial_epoch={epoch}), but the "
                f"feeder goes on with epoch "
                f"{state['epoch']} (step {state['step']}): Keras would count the feeder's "
                f"epochs from the wrong one and train another number of them than asked. Pass "
                f"initial_epoch={state['epoch']} (the feeder's state's 'epoch'), or restore the "
                "feeder's state saved with the model first, feeder.set_state(state)."
            )

    def pass_length(self, steps: int | None, epoch_steps: int | None) -> float:
        """Batches of the pass the tracked `fit`'s Keras epoch reads: `steps` where known, else
        (a source of unknown length, read to its end: Keras's `epoch_steps` unset) its batches
        handed once its last one has gone, which the feeder learns as it hands that one over;
        else unbounded."""
        if steps is not None:
            return steps
        last = self.consumer.last_fit
        if (
            epoch_steps is not None
            or last is None
            or last.number <= self.tracker.first_pass
            or last.end is None
        ):
            return float("inf")
        return last.handed

    def steps_left(self) -> int | None:
        """Batches left in the epoch the tracked `fit` trains next (None where the length is
        unknown): its next pass serves those."""
        return self.consumer.steps_left(self.tracked())

    def refuse_as_validation(self, data: Any, reads_feeder: bool) -> None:
        """Refuses a fit whose `validation_data` reads this feeder: validation would take the
        epoch after each one trained, so training would see every other epoch."""
        if data is not None and reads_feeder:
            raise ValueError(
                "`validation_data` reads the feeder this fit trains on: each validation would "
                "take the feeder's next epoch, and training would see every other one. Give "
                "validation data of its own: a second fp.Feeder over the validation samples, "
                "or arrays, validation_data=(x_val, y_val)."
            )

    def check_epochs(
        self, steps: int | None, epochs: int, *, total: int, itself: bool = False
    ) -> None:
        """Refuses a tracked fit's `epochs` epochs (of `total`) of `steps` batches that are
        not the feeder's next, from what the fit has trained (a `prefetch` may have taken the
        next epoch's first batches already). A fit that reads the feeder `itself` (Keras's
        adapter) runs Keras epochs of a whole epoch's batches: its first pass, begun mid-epoch,
        ends with that epoch, which Keras takes as an epoch that ran out early."""
        plan = self.consumer.assembly.plan
        if itself and plan is not None and steps == len(plan):
            return
        if plan is None:
            self._check_unknown_epochs(steps, epochs, total=total, itself=itself)
            return
        self.check_passes_from(self.tracked(), steps, epochs, total=total)

    def _check_unknown_epochs(
        self, steps: int | None, epochs: int, *, total: int, itself: bool
    ) -> None:
        """Refuses a fit of several epochs begun mid-epoch on a source of unknown length:
        Keras takes its first epoch's steps, here the rest of the feeder's, for every epoch,
        and would run short ones (its warning that the input ran out is the feeder's to quiet
        at an epoch's end, so nothing would say so)."""
        position = self.tracked()
        if steps is not None or epochs <= 1 or position.step == 0:
            return
        epoch, step = position
        entry = "feeder" if itself else "feeder.as_dataset()"
        if position == self.interrupted_at:
            what = (
                f"The last fit on this feeder was interrupted (Ctrl-C or an error) at step "
                f"{step} of epoch {epoch}"
            )
        else:
            what = f"The feeder is at step {step} of epoch {epoch} (restored there)"
        raise ValueError(
            f"{what}, and its source does not say how many samples it has, so Keras would take "
            f"the rest of that epoch's length for each of the {epochs} epochs of this fit and "
            f"run short ones. Finish that epoch in a fit of its own, model.fit({entry}, "
            f"epochs=1, callbacks=[feeder.fit_callback(), ...]), then go on with "
            f"model.fit({entry}, epochs={total - 1}, ...)."
        )

    def check_passes_from(
        self, position: Position, steps: int | None, epochs: int | None, total: int | None = None
    ) -> None:
        """Refuses passes of `steps` batches (`epochs` of them) from `position` that are not
        the feeder's epochs.

        Keras runs every epoch of a fit for the same number of steps, the dataset's length,
        fixed when `as_dataset()` is called: the rest of an epoch needs a fit of its own on
        a dataset, where `model.fit(feeder)` goes on by itself.
        """
        assembly = self.consumer.assembly
        if assembly.plan is None:
            return
        state = assembly.stream().state(position)
        epoch, step = state["epoch"], state["step"]
        left = len(assembly.plan) - step
        if steps == left and (step == 0 or epochs is None or epochs <= 1):
            return
        entry = "feeder.as_dataset()" if assembly.layer.name == "tensorflow" else "feeder"
        runs = "" if epochs is None else f" (model.fit runs {epochs} such epochs)"
        if step > 0 and position == self.interrupted_at:
            more = "" if total is None else f"epochs={total}, "
            raise ValueError(
                f"This dataset cannot go on after an interrupted fit: the last fit on this "
                f"feeder stopped (Ctrl-C or an error) at step {step} of epoch {epoch}, which "
                f"has {left} batches left; each pass over this "
                f"dataset has {steps} batches{runs}, and Keras runs every epoch of a fit for "
                f"the same number of steps. Pass the feeder itself, which goes on: "
                f"model.fit(feeder, {more}"
                "callbacks=[feeder.fit_callback(), ...]) trains the rest of epoch "
                f"{epoch}, then whole epochs."
            )
        if step == 0 and epochs is not None and steps is not None:
            self._refuse_other_epochs(steps, epoch)
        if step == 0:
            fix = (
                f"this dataset was made mid-epoch and serves only the rest of that epoch; for "
                f"the next epochs make a new one, model.fit({entry}, "
                f"initial_epoch={epoch}, epochs=...)"
            )
        else:
            fix = (
                f"after a restore mid-epoch, finish that epoch in a fit of its own on a dataset "
                f"made after the restore, model.fit({entry}, initial_epoch={epoch}, "
                f"epochs={epoch + 1}), then go on with model.fit({entry}, "
                f"initial_epoch={epoch + 1}, epochs=...)"
            )
        raise ValueError(
            f"Each pass over this dataset has {steps} batches{runs}, but the feeder is at step "
            f"{step} of epoch {epoch}, which has {left} batches left, and later epochs have "
            f"{len(assembly.plan)}: Keras runs every epoch of a fit for the same number of "
            f"steps. Leave steps_per_epoch unset; {fix}."
        )

    def _refuse_other_epochs(self, steps: int, epoch: int) -> None:
        """Refuses a fit begun at the start of the feeder's `epoch` whose epochs of `steps`
        batches are not the feeder's: Keras's `steps_per_epoch`, or, unset, the length of a
        dataset made mid-epoch."""
        batches, entry = len(self.consumer.assembly.plan), self.entry
        size = self.consumer.assembly.options.global_batch_size
        if entry == "feeder":
            what = f"steps_per_epoch={steps}"
            fix = "Leave steps_per_epoch unset"
        else:
            what = (
                f"This fit's epochs have {steps} batches (its steps_per_epoch, or unset, the "
                "length of the dataset)"
            )
            fix = (
                "Leave steps_per_epoch unset and make the dataset at an epoch's start (one made "
                "mid-epoch has the rest of that epoch alone)"
            )
        first = f"initial_epoch={epoch}, " if epoch > 0 else ""
        raise ValueError(
            f"{what}, but the feeder's epochs have {batches} batches of {size}: Keras runs "
            f"every epoch of a fit for the same number of steps, so this fit's epochs would not "
            f"be the feeder's. {fix}, "
            f"model.fit({entry}, {first}epochs=...): each epoch is then the feeder's "
            f"{batches} batches. Or build the feeder so that its epoch is the one you want: "
            f"{steps} batches of {size} are an fp.Feeder over {steps * size} samples."
        )
