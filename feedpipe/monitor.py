"""StarvationMonitor: is `model.fit` input-bound, whatever feeds it?

Keras runs a step by calling `model.train_function(iterator)`; for a `tf.data` iterator (every
input `fit` accepts becomes one) that call is a compiled function which takes the batch with
`iterator.get_next()` *inside* the graph. The wait for input is hidden inside the step, so no
callback can read it directly. It is derived instead, by a headspace A/B:

- A, the real step: the time from each call of `train_function` until Keras hands its logs to
  the callbacks (they are numbers by then, so the device has finished the step);
- B, the step alone: the same compiled step on one batch already on the device, run
  `headspace_steps` times once per fit, with every variable it changes saved before and put
  back after, so training is not changed.

The input-wait fraction is `1 - B / A`: the share of the real step that was not the step
itself. It is judged with the TensorFlow profiler's thresholds (see `feedpipe.stats`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from feedpipe._headspace import finish, on_step_device, save_state
from feedpipe.stats import verdict

_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
    data_class=summary_pb2.DATA_CLASS_SCALAR,
)
"""What TensorBoard's scalar dashboard reads; written here by TensorFlow alone, since
`tf.summary.scalar` needs the `tensorboard` package installed (viewing still does)."""

if TYPE_CHECKING:
    from feedpipe.feeder import Feeder

_ORIGINAL = "_feedpipe_original_train_function"
"""The attribute the monitor's wrapper keeps Keras's own `train_function` under."""


@dataclasses.dataclass(frozen=True, slots=True)
class EpochStarvation:
    """What `StarvationMonitor` measured over one epoch of `model.fit`."""

    epoch: int
    """Keras's epoch index (from 0; the progress bar shows `epoch + 1`)."""
    steps: int
    """Steps timed: every step of the epoch but its first call (the first of the fit traces
    the step; the first of a later epoch fills the restarted input) and the call that took
    the headspace batch."""
    real_step_s: float
    """Mean time per timed step with the real input: the step plus its wait for input."""
    step_alone_s: float
    """Mean time per step on a batch already on the device (the headspace measurement)."""
    producer_samples_per_s: float | None = None
    """What the monitored `Feeder`'s producer alone sustains (see `FeedStats`); None
    without a feeder."""

    @property
    def input_wait_fraction(self) -> float:
        """Share of the real step spent waiting for input: `1 - step_alone_s / real_step_s`."""
        return max(0.0, 1.0 - self.step_alone_s / self.real_step_s)

    @property
    def verdict(self) -> str:
        """`not`, `moderately` or `highly input-bound`, by the profiler's thresholds."""
        return verdict(self.input_wait_fraction)

    @property
    def steps_per_s(self) -> float:
        """Steps per second achieved with the real input."""
        return 1.0 / self.real_step_s

    @property
    def step_alone_steps_per_s(self) -> float:
        """Steps per second the step alone sustains: the ceiling a faster input could reach."""
        return 1.0 / self.step_alone_s

    def logs(self) -> dict[str, float]:
        """The figures added to Keras's epoch logs (and so to `History`)."""
        figures = {
            "input_wait_fraction": self.input_wait_fraction,
            "steps_per_s": self.steps_per_s,
            "step_alone_steps_per_s": self.step_alone_steps_per_s,
        }
        if self.producer_samples_per_s is not None:
            figures["producer_samples_per_s"] = self.producer_samples_per_s
        return figures

    def __str__(self) -> str:
        producer = (
            ""
            if self.producer_samples_per_s is None
            else f"; the feeder's producer alone makes {self.producer_samples_per_s:,.0f} samples/s"
        )
        return (
            f"{self.verdict}: the step waited for input {self.input_wait_fraction:.1%} of the "
            f"time ({self.steps_per_s:,.1f} steps/s achieved; the step alone runs "
            f"{self.step_alone_steps_per_s:,.1f} steps/s{producer})"
        )


class StarvationMonitor(keras.callbacks.Callback):
    """A Keras callback that tells, per epoch, whether `model.fit` waits for its input.

    It works for any input `fit` takes (`tf.data`, `PyDataset`, a generator,
    `Feeder.as_dataset()`): it wraps `model.train_function` for the fit (two clock reads per
    call) and puts Keras's own function back at the end. Once per fit it takes one real batch
    from the stream (the step trains on it exactly once, as it would have) and, at the end of
    the first epoch that has timed steps, runs the same compiled step `headspace_steps` times
    on it (the headspace), saving and restoring every model, optimizer and metric variable
    around it. Each measured epoch adds `input_wait_fraction`, `steps_per_s` and
    `step_alone_steps_per_s` (and `producer_samples_per_s` with a `feeder`) to the epoch
    logs, appends an `EpochStarvation` to `epochs`, prints the verdict when `verbose`, and
    writes the figures as TensorBoard scalars under `log_dir`. An epoch with no timed step
    (fewer than two calls, or three in the first epoch) adds nothing.

    Time spent in callbacks listed *before* the monitor counts as step time: list it first.
    With `steps_per_execution` > 1 the headspace runs its steps one Python call each, while
    the real input runs them in one compiled loop: for steps well under a millisecond the step
    alone then reads slow, and the fraction low. The TensorFlow backend only.
    """

    def __init__(
        self,
        headspace_steps: int = 10,
        verbose: int = 1,
        log_dir: str | os.PathLike | None = None,
        *,
        feeder: Feeder | None = None,
    ):
        """Configures the monitor.

        Args:
            headspace_steps: Steps the step alone is timed over, once per fit (rounded up to
                whole calls of `steps_per_execution`). Default 10: a mean that evens out
                one slow step, for about 11 extra steps (one warms up) per fit.
            verbose: 1 prints one line per epoch with the verdict; 0 prints nothing.
            log_dir: Where to write the figures as TensorBoard scalars, one point per epoch;
                None writes nothing.
            feeder: The `Feeder` whose `as_dataset()` feeds the fit, to report what its
                producer alone sustains; optional.
        """
        super().__init__()
        backend = keras.backend.backend()
        if backend != "tensorflow":
            raise RuntimeError(
                f"StarvationMonitor needs the TensorFlow backend, but Keras runs on {backend!r}; "
                "set KERAS_BACKEND=tensorflow before importing keras."
            )
        if isinstance(headspace_steps, bool) or not isinstance(headspace_steps, int):
            raise TypeError(f"`headspace_steps`={headspace_steps!r} must be an integer.")
        if headspace_steps < 1:
            raise ValueError(
                f"`headspace_steps`={headspace_steps} must be >= 1; the step alone is timed "
                "over that many steps."
            )
        if verbose not in (0, 1):
            raise ValueError(f"`verbose`={verbose!r} must be 0 (silent) or 1 (one line per epoch).")
        if feeder is not None and not callable(getattr(feeder, "stats", None)):
            raise TypeError(
                f"`feeder` must be a feedpipe.Feeder (it has `stats()`); got "
                f"{type(feeder).__name__}."
            )
        self.headspace_steps = headspace_steps
        self.verbose = int(verbose)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.feeder = feeder
        self.epochs: list[EpochStarvation] = []
        """One entry per measured epoch of the latest fit."""
        self._original: Any = None
        self._writer: Any = None
        self._spe = 1
        self._total_steps: int | None = None
        self._reset_fit()

    def __repr__(self) -> str:
        return (
            f"StarvationMonitor(headspace_steps={self.headspace_steps}, verbose={self.verbose}, "
            f"log_dir={self.log_dir!r}, feeder={self.feeder!r})"
        )

    # ---- the fit's lifecycle -----------------------------------------------------------------

    def _reset_fit(self) -> None:
        self._batch: Any = None
        """The headspace batch, taken from the real stream on the fit's second call."""
        self._step_alone_s: float | None = None
        self._fit_calls = 0
        self._epoch_calls = 0
        self._started: float | None = None
        """When the call being timed began; None while the current call is not timed."""
        self._call_steps = 1
        self._epoch_busy_s = 0.0
        self._epoch_steps = 0

    def on_train_begin(self, logs=None):
        model = self.model
        function = model.train_function
        # A fit that raised never reached on_train_end: take its wrapper off, never wrap twice.
        while hasattr(function, _ORIGINAL):
            function = getattr(function, _ORIGINAL)
        if function is None:
            raise RuntimeError(
                "StarvationMonitor found no `model.train_function`; use it as a callback of "
                "`model.fit`, which makes that function before calling on_train_begin."
            )
        self._original = function
        self._spe = int(model.steps_per_execution)
        self._total_steps = (self.params or {}).get("steps")
        self._reset_fit()
        self.epochs = []
        model.train_function = self._wrap(function)

    def _wrap(self, original):
        def train_function(iterator):
            self._fit_calls += 1
            self._epoch_calls += 1
            if self._step_alone_s is None and self._batch is None and self._fit_calls >= 2:
                self._started = None
                return self._take_headspace_batch(original, iterator)
            self._started = time.perf_counter() if self._epoch_calls > 1 else None
            return original(iterator)

        setattr(train_function, _ORIGINAL, original)
        return train_function

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_calls = 0
        self._started = None
        self._epoch_busy_s = 0.0
        self._epoch_steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        total = self._total_steps
        self._call_steps = min(self._spe, total - batch) if total else self._spe

    def on_train_batch_end(self, batch, logs=None):
        # Keras has turned the step's logs into numbers by now: the device finished the step.
        if self._started is not None:
            self._epoch_busy_s += time.perf_counter() - self._started
            self._epoch_steps += self._call_steps
            self._started = None

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch_steps == 0:
            return
        if self._step_alone_s is None:
            self._step_alone_s = self._measure_step_alone()
        producer = None if self.feeder is None else self.feeder.stats().producer_samples_per_s
        result = EpochStarvation(
            epoch=epoch,
            steps=self._epoch_steps,
            real_step_s=self._epoch_busy_s / self._epoch_steps,
            step_alone_s=self._step_alone_s,
            producer_samples_per_s=producer,
        )
        self.epochs.append(result)
        if logs is not None:
            logs.update(result.logs())
        if self.verbose:
            # The progress bar's last in-place update is still on its line: start a new one.
            lead = "\n" if self.params and self.params.get("verbose") in (1, "auto") else ""
            print(f"{lead}StarvationMonitor epoch {epoch + 1}: {result}", flush=True)
        if self.log_dir is not None:
            self._write_scalars(result)

    def on_train_end(self, logs=None):
        model = self.model
        if getattr(model.train_function, _ORIGINAL, None) is self._original:
            model.train_function = self._original
        self._original = None
        self._batch = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---- the headspace -------------------------------------------------------------------------

    def _take_headspace_batch(self, original, iterator):
        """Runs this call's steps on elements taken here, keeping the first for the headspace.

        The step trains on each element exactly once, through the same compiled step Keras
        uses for data that is not a `tf.data` iterator.
        """
        if hasattr(iterator, "get_next_as_optional"):
            elements = []
            for _ in range(self._spe):
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                elements.append(optional.get_value())
        else:
            elements = list(itertools.islice(iterator, self._spe))
        if not elements:
            raise StopIteration  # what Keras's own function raises on an exhausted iterator
        outputs = original(elements)
        self._batch = on_step_device(elements[0], self.model.distribute_strategy)
        return outputs

    def _measure_step_alone(self) -> float:
        """Seconds per step of the compiled step on the headspace batch; training unchanged."""
        restore = save_state(self.model)
        batches = [self._batch] * self._spe
        calls = math.ceil(self.headspace_steps / self._spe)
        try:
            finish(self._original(batches))  # the first eager call may trace
            start = time.perf_counter()
            for _ in range(calls):
                outputs = self._original(batches)
            finish(outputs)
            elapsed = time.perf_counter() - start
        finally:
            restore()
        self._batch = None
        return elapsed / (calls * self._spe)

    def _write_scalars(self, result: EpochStarvation) -> None:
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default():
            for name, value in result.logs().items():
                tf.summary.write(
                    name, tf.constant(value, tf.float32), step=result.epoch, metadata=_SCALAR
                )
        self._writer.flush()
