"""Fit: what `model.fit(feeder.as_dataset())` tells the feeder, through a Keras callback.

`FitTracker` (made by `feeder.fit_callback()`) gives the feeder the step count Keras gives its
callbacks, so the feeder's state is the batches the step trained on. It reaches the feeder only
through its consumer's ledger of fits (`feedpipe.keras.ledger`), and never imports the
feeder's module.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from feedpipe._internals import (
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
    and raises an error of the source or `transform` from `fit` as itself (its type, message
    and note), where TensorFlow would wrap it.
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
        self.per_call = 1
        """The model's `steps_per_execution`, read once a fit: on JAX, `self.model` attaches
        the training state to the model's variables (Keras's `Callback.model` does, so that a
        callback may read them), and Keras then takes it apart again before the next step;
        read every step, that cost ~0.7 ms a step of a 3-layer MLP on 4 host devices."""

    def on_train_begin(self, logs=None):
        self._check_fit_reads_feeder()
        self.earlier, self.steps, self.finished, self.first_epoch = 0, 0, 0, True
        self.per_call = int(self.model.steps_per_execution)
        self.feeder._consumer.fits.track(self)
        self._wrap_train_function()
        if keras_reading(self.feeder) != "fit":  # the feeder itself hands Keras real rows alone
            _warn_unweighted_metrics(self.model, self.feeder)
        self._quiet_end_of_unknown_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_epoch:
            self.first_epoch = False
            restored = keras_restored_epoch(self.model) == epoch
            self.feeder._consumer.fits.line_up(epoch, restored=restored)
        self.earlier += self.finished
        self.first_pass, self.steps, self.finished = self.feeder._consumer.passes, 0, 0
        params = self.params or {}
        self.epoch_steps = params.get("steps")
        total = params.get("epochs", epoch + 1)
        itself = keras_reading(self.feeder) == "fit"
        self.feeder._consumer.fits.check_epochs(
            self.epoch_steps, total - epoch, total=total, itself=itself
        )

    def on_train_batch_begin(self, batch, logs=None):
        self.feeder._consumer.raise_failure()
        self.steps = batch + self.per_call
        if self.epoch_steps:
            self.steps = min(self.steps, self.epoch_steps)

    def on_test_begin(self, logs=None):
        self.feeder._consumer.raise_failure()
        data = keras_validation_input(self.model)
        self.feeder._consumer.fits.refuse_as_validation(data, self.feeder._reads_this(data))

    def on_train_end(self, logs=None):
        self.feeder._consumer.fits.untrack(self)
        self._speak_again()
        function = self.model.train_function
        if getattr(function, "__self__", None) is self:
            self.model.train_function = self._original

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
        try:
            logs = self._original(*args)
        except Exception as error:
            failure = self.feeder._consumer.failure
            if failure is None or failure is error:
                raise
            raise failure from None
        self.finished = self.steps
        return logs

    def interrupted(self) -> None:
        """The fit raised (in a step, a callback, or Ctrl-C): a step that never returned
        trained nothing, so only the finished steps count."""
        self.steps = self.finished
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
