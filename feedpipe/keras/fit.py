"""Fit: what `model.fit(feeder.as_dataset())` tells the feeder, through a Keras callback.

`FitTracker` (made by `feeder.fit_callback()`) gives the feeder the step count Keras gives its
callbacks, so the feeder's state is the batches the step trained on; its `StepGuard` holds a
Ctrl-C that arrives while a step runs until that count, and the model, are whole. It reaches the
feeder only through its consumer's ledger of fits (`feedpipe.keras.ledger`), and never imports
the feeder's module.
"""

from __future__ import annotations

import signal
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras

from feedpipe._internals.keras import (
    give_back_jax_train_state,
    in_keras_fit_with,
    keras_fit_input,
    keras_reading,
    keras_restored_epoch,
    keras_validation_input,
    unweighted_metrics,
)


class FitTracker(keras.callbacks.Callback):
    """Tells a feeder which batches of `feeder.as_dataset()` the `model.fit` step trained on.

    TensorFlow and Keras take batches ahead of the step, so during `fit` the feeder alone
    cannot tell which of those it handed out were trained on. With this callback in the fit's
    callbacks (make it with `feeder.fit_callback()`), `feeder.get_state()`, and a
    `tf.train.Checkpoint` holding the feeder, record exactly those in any callback at any place
    in the list: Keras gives the step count to every callback's `on_train_batch_begin` before
    the step runs, and the checkpoints Keras users write come after it. It also refuses a fit
    whose epochs cannot be the feeder's (after a restore mid-epoch), warns when compiled
    `metrics` will count padding rows, refuses `validation_data` that reads the same feeder,
    raises an error of the source or `transform` from `fit` as itself (its type, message
    and note), where TensorFlow would wrap it, and stops a fit interrupted by Ctrl-C between
    steps (see `StepGuard`), so that the same fit run again goes on from the batches trained.
    """

    def __init__(self, feeder: Any):
        super().__init__()
        self.feeder = feeder
        self.first_pass = 0
        """Passes of the dataset begun before this Keras epoch: the epoch reads the next."""
        self.earlier = 0
        """Steps trained in this fit's earlier Keras epochs."""
        self.steps = 0
        """Steps of this Keras epoch begun, counting the one running."""
        self.finished = 0
        """Steps of this Keras epoch whose step returned: what the fit has trained on, read
        by the callbacks of a step (a checkpoint in `on_train_batch_end` saves the step it
        follows) and right after a fit that raised in a step or was interrupted (a handler of
        `KeyboardInterrupt` saves where the feeder goes on)."""
        self.first_epoch = True
        """The next Keras epoch is the fit's first: Keras's epoch and the feeder's are lined
        up then (`FitLedger.line_up`)."""
        self.epoch_steps: int | None = None
        """Steps Keras runs per epoch (None: the length is unknown); an epoch's last call may
        run fewer than `steps_per_execution`."""
        self.pass_steps: int | None = None
        """Batches of the pass this Keras epoch reads (None: the length is unknown): the rest
        of the feeder's epoch, fewer than `epoch_steps` in the first epoch of a fit on the
        feeder itself begun mid-epoch, which ends with the feeder's."""
        self.begun = 0
        """Steps of this Keras epoch begun before the call running."""
        self.armed = False
        """Keras begins a step of this tracker's fit: `on_train_batch_begin` ran, and the
        train function has not yet been called. A fit that raised leaves the train function
        wrapped until the next fit with a tracker: in a fit without one, it is Keras's own."""
        self.per_call = 1
        """The model's `steps_per_execution`, read once a fit: on JAX, `self.model` attaches
        the training state to the model's variables (Keras's `Callback.model` does, so that a
        callback may read them), and Keras then takes it apart again before the next step;
        read every step, that cost ~0.7 ms a step of a 3-layer MLP on 4 host devices."""
        self.guard = StepGuard(self)
        """Holds a Ctrl-C that arrives while a step runs, for the fit's length."""
        self.trainer: Any = None
        """The model being fit, read once a fit (see `per_call`)."""
        self.jax = False
        """Keras trains on JAX: its step donates the training state it is given."""
        self.counted_from: int | None = None
        """On TensorFlow, the optimizer's count of steps (`iterations`) as the fit began, read
        once, where it is a variable (see `_uncount_step_without_batch`)."""

    def on_train_begin(self, logs=None):
        self._check_fit_reads_feeder()
        self.earlier, self.steps, self.finished, self.first_epoch = 0, 0, 0, True
        self.trainer = self.model
        self.per_call = int(self.trainer.steps_per_execution)
        self.jax = keras.backend.backend() == "jax"
        self.counted_from = _optimizer_count(self.trainer)
        self.feeder._consumer.fits.track(self)  # ends an interrupted fit: its guard first
        self.guard.install()
        self._wrap_train_function()
        # The feeder itself, and as_dataset() on one host, hand Keras real rows alone.
        if keras_reading(self.feeder) != "fit" and self.feeder._pads(keras_fit_input()):
            _warn_unweighted_metrics(self.model, self.feeder)
        self._quiet_end_of_unknown_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch:
            self.first_epoch = False
            restored = keras_restored_epoch(self.trainer) == epoch
            self.feeder._consumer.fits.line_up(epoch, restored=restored)
        self.earlier += self.finished
        self.first_pass, self.steps, self.finished = self.feeder._consumer.passes, 0, 0
        params = self.params or {}
        self.epoch_steps = params.get("steps")
        self.pass_steps = self.feeder._consumer.fits.steps_left()
        total = params.get("epochs", epoch + 1)
        itself = keras_reading(self.feeder) == "fit"
        self.feeder._consumer.fits.check_epochs(
            self.epoch_steps, total - epoch, total=total, itself=itself
        )

    def on_train_batch_begin(self, batch, logs=None):
        self.guard.release()
        self.feeder._consumer.raise_failure()
        self.armed, self.begun, self.steps = True, batch, batch + self.per_call
        limit = self.pass_steps or self.epoch_steps
        if limit:
            self.steps = min(self.steps, limit)
        # Keras's JAX trainer may now empty the model's variables to take the state out.
        self.guard.held = self.jax

    def on_epoch_end(self, epoch, logs=None):
        self.guard.release()

    def on_test_begin(self, logs=None):
        self.guard.release()
        self.feeder._consumer.raise_failure()
        data = keras_validation_input(self.model)
        self.feeder._consumer.fits.refuse_as_validation(data, self.feeder._reads_this(data))

    def on_train_end(self, logs=None):
        self.feeder._consumer.fits.untrack(self)
        self._speak_again()
        function = self.trainer.train_function
        if getattr(function, "__self__", None) is self:
            self.trainer.train_function = self._original
        self.guard.uninstall(deliver=True)

    def _check_fit_reads_feeder(self) -> None:
        """Refuses a fit on other data: its steps would move this feeder's position (a
        callbacks list kept for several fits takes this callback to each)."""
        data = keras_fit_input()
        if data is not None and not self.feeder._reads_this(data) and not _opaque(data):
            raise ValueError(
                f"feeder.fit_callback() is in the callbacks of a fit on other data "
                f"({type(data).__name__}): its steps would count as the feeder's batches. "
                "Pass the callback only to fits on its feeder, model.fit(feeder, "
                "callbacks=[feeder.fit_callback(), ...]) (or feeder.as_dataset()), and a "
                "callbacks list without it to other fits."
            )

    def _wrap_train_function(self) -> None:
        """Keras's train function, raising a source's error as itself: where the step reads
        the batch itself (no strategy reads ahead), TensorFlow wraps it in an `OpError`."""
        function = self.model.train_function
        while getattr(function, "__self__", None).__class__ is FitTracker:
            function = function.__self__._original  # left by a fit that raised
        self._original = function
        self.model.train_function = self._train_function

    def _train_function(self, *args):
        # The step's end is marked here rather than in `on_train_batch_end`: a callback with
        # that hook makes Keras run every callback's in the step's own thread, each step.
        if not self.armed:
            return self._original(*args)
        self.armed = False
        if self.begun >= self.feeder._consumer.fits.pass_length(self.pass_steps, self.epoch_steps):
            # The pass has no batch left (its Keras epoch is longer: see `pass_steps`; or its
            # length is unknown and its last batch has gone). Keras's TensorFlow step would
            # learn it from the dataset's end, once its graph had run every op that needs no
            # batch: the optimizer's `iterations` would count a step that trained nothing, and
            # Adam's next steps would differ, and each Dropout's seed would move on, so its
            # masks would differ from fit(x, y)'s. Keras ends the epoch on this as on that end.
            raise StopIteration
        handing = Handing(args[1], self.guard) if self.jax else None
        try:
            if handing is None:
                self.guard.held = True
            else:  # the wait for the batch is not held: nothing is donated yet
                self.guard.release()
                args = (args[0], handing)
            logs = self._original(*args)
        except BaseException as error:
            if handing is not None and not handing.handed:
                give_back_jax_train_state(self.trainer, args[0])
            self._uncount_step_without_batch()  # the end of the pass, or a batch that failed
            self.guard.release()
            failure = self.feeder._consumer.failure
            if failure is None or failure is error or not isinstance(error, Exception):
                raise
            raise failure from None
        self.finished = self.steps
        if handing is None:  # on JAX, once Keras keeps the state returned (the next callback)
            self.guard.release()
        return logs

    def _uncount_step_without_batch(self) -> None:
        """Keras's TensorFlow step raised for want of its batch: it found the pass's end where
        its length is unknown (a generator's epoch, which Keras learns so), or reading the
        batch failed (the source's error). Its graph had run the ops that need no batch, and
        the optimizer counted a step that trained nothing, which Adam's later steps would
        feel. The count goes back to the steps trained where it is exactly one ahead (an
        optimizer that skips or accumulates steps counts otherwise)."""
        if self.counted_from is None:
            return
        iterations = self.trainer.optimizer.iterations
        trained = self.counted_from + self.trained
        if _count(iterations) == trained + 1:
            iterations.assign(trained)

    def interrupted(self) -> None:
        """The fit raised (in a step, a callback, or Ctrl-C): a step that never returned
        trained nothing, so only the finished steps count."""
        self.steps = self.finished
        self.guard.uninstall(deliver=False)  # the fit ended already
        self._speak_again()

    def _quiet_end_of_unknown_epoch(self) -> None:
        """Where the epoch's length is unknown (a generator source) and no `steps_per_epoch`
        was given, Keras learns it from the first epoch's end and warns then, on every run,
        that the input "ran out of data; interrupting training": the feeder's epochs end so
        by design, and training goes on. That warning is silenced for this fit alone."""
        self._speak_again()
        # A fit on the feeder itself begun mid-epoch ends its first Keras epoch with the
        # feeder's (see `FitLedger.check_epochs`), as Keras's epochs of unknown length do.
        left = self.feeder._consumer.steps_left()
        mid_epoch = left is not None and left != len(self.feeder)
        if (self.params or {}).get("steps") is None or mid_epoch:
            warnings.filterwarnings(
                "ignore", message=_RAN_OUT, category=UserWarning, module=_KERAS_EPOCHS
            )
            self._quieted = warnings.filters[0]

    def _speak_again(self) -> None:
        quieted, self._quieted = getattr(self, "_quieted", None), None
        if quieted in warnings.filters:
            warnings.filters.remove(quieted)

    @property
    def trained(self) -> int:
        """Steps this fit has trained: a step that has not returned (running, or raised)
        trained nothing, as the feeder goes on from it."""
        return self.earlier + self.finished


def _opaque(data: Any) -> bool:
    """Whether `data` is a TensorFlow dataset that may read a feeder where its pipeline cannot
    be seen (a `flat_map` or `interleave` function, a distributed dataset): such a fit is not
    refused."""
    kind = type(data)
    return kind.__module__.startswith("tensorflow") and "Dataset" in kind.__name__


class StepGuard:
    """Holds a Ctrl-C (SIGINT) that arrives while a step of a tracked `fit` runs until the fit
    can stop whole: the step's end recorded, and what it returned kept by Keras.

    Python raises `KeyboardInterrupt` wherever its main thread is when it handles the signal.
    As a compiled step returns, that is after the step applied its update and before the
    tracker records it: the state would be a batch behind, and the same fit run again would
    train that batch twice. On JAX it is also before Keras keeps the state the step returned,
    in exchange for the one it donated to the step: the model's variables would be deleted
    arrays. Held, the signal reaches the handler it replaced once the step's end is recorded,
    and on JAX at the tracker's next callback (the next step's begin, the epoch's end,
    validation, the fit's end), when Keras has kept the state. The wait for a batch is not held
    (on JAX it is in the step, before the state is donated), so Ctrl-C stops a slow source at
    once.

    One Ctrl-C is held, never more: a second one while the first waits reaches the replaced
    handler at once, as it would without the guard (Python's raises `KeyboardInterrupt` in the
    step), for a step that hangs. The step under way may then have applied its update or not,
    and the feeder goes on from its batch (it counts the steps that returned). Whenever a held
    or second Ctrl-C reaches the replaced handler, that handler is put back first: a
    `KeyboardInterrupt` leaves the handler the fit found, as a notebook's next cell expects; a
    handler that returns (the fit goes on) has this one put back after it.
    """

    def __init__(self, tracker: FitTracker):
        self.tracker = weakref.ref(tracker)
        """The tracker of the fit whose steps are held (weakly: a handler left in place by a
        fit that raised keeps nothing of it alive)."""
        self.previous: Any = None
        """The SIGINT handler this one replaced."""
        self.held = False
        """A step runs: a SIGINT now is held."""
        self.pending: Any = None
        """The frame a held SIGINT arrived in."""

    def install(self) -> None:
        """Holds SIGINT during the fit's steps, where a Python handler would raise it (signals
        are handled in the main thread, by Python's handler or a function the user set)."""
        previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is not threading.main_thread() or not callable(previous):
            return
        self.previous, self.held, self.pending = previous, False, None
        signal.signal(signal.SIGINT, self._handle)

    def uninstall(self, *, deliver: bool) -> None:
        """Puts the replaced handler back (unless another was set since); with `deliver`, hands
        it a SIGINT still held, else forgets it."""
        if self.previous is not None and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self.previous)
        if not deliver:
            self.pending = None
        self.release()

    def release(self) -> None:
        """The step's end is recorded and kept: a SIGINT held is handled now."""
        self.held = False
        pending, self.pending = self.pending, None
        if pending is not None:
            self._deliver(signal.SIGINT, pending)

    def _handle(self, signum: int, frame: Any) -> None:
        # A fit that raised out of a step (an error, or a callback's KeyboardInterrupt) leaves
        # `held` set and this handler in place until the feeder is next read: only that fit,
        # still running, holds. A second SIGINT while one is held is not held: both go on.
        if self.held and self.pending is None and in_keras_fit_with(self.tracker(), frame):
            self.pending = frame
            return
        self.held, held, self.pending = False, self.pending, None
        if held is not None:
            self._deliver(signum, held)
        self._deliver(signum, frame)

    def _deliver(self, signum: int, frame: Any) -> None:
        """Hands a SIGINT to the handler this one replaced, put back for it: its
        `KeyboardInterrupt` leaves that handler in place; where it returns, the fit goes on
        under this one again."""
        ours = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) == self._handle
        )
        if ours:
            signal.signal(signal.SIGINT, self.previous)
        self.previous(signum, frame)
        if ours and signal.getsignal(signal.SIGINT) == self.previous:  # none set since
            signal.signal(signal.SIGINT, self._handle)


class Handing(Iterator):
    """Keras's batches for one call of its JAX train function, which reads them itself: once
    one is handed over, the step will donate the training state (see `StepGuard`)."""

    def __init__(self, batches: Iterator, guard: StepGuard):
        self.batches, self.guard = batches, guard
        self.handed = False

    def __next__(self) -> Any:
        batch = next(self.batches)
        self.handed = self.guard.held = True
        return batch


def _optimizer_count(model: keras.Model) -> int | None:
    """The optimizer's count of steps applied, on TensorFlow where it is a variable."""
    if keras.backend.backend() != "tensorflow":
        return None
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    return _count(iterations) if isinstance(iterations, keras.Variable) else None


def _count(variable: keras.Variable) -> int:
    return int(keras.ops.convert_to_numpy(variable))


_RAN_OUT = "Your input ran out of data; interrupting training"
_KERAS_EPOCHS = r"keras\.src\.trainers\.epoch_iterator"


def _warn_unweighted_metrics(model: keras.Model, feeder: Any) -> None:
    """Warns when the compiled `metrics` (which ignore sample_weight) will count padding."""
    assembly = feeder._assembly
    padding = assembly.rule.padding(assembly.source.length)
    if padding == 0:
        return
    unweighted = unweighted_metrics(model)
    if unweighted:
        padding = "padding rows" if padding is None else f"{padding} padding rows"
        warnings.warn(
            f"model.compile(metrics={unweighted!r}) ignores sample_weight, so these metrics "
            f"count the {padding} feedpipe adds to each epoch; pass them as "
            "weighted_metrics= to count real samples only.",
            stacklevel=2,
        )
