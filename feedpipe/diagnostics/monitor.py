"""StarvationMonitor: is `model.fit` input-bound, whatever feeds it?

Keras runs a step by calling `model.train_function`, which on TensorFlow and JAX takes the
batch from its input *inside* the call: on TensorFlow a compiled function whose
`iterator.get_next()` sits in the graph (every input `fit` accepts becomes a `tf.data`
iterator); on JAX a function of the training state and an iterator, which it reads with `next`
before the jitted step. On PyTorch `fit` reads the batch from its epoch iterator just before
the call, between the callbacks of two steps. Either way the wait for input is hidden from the
callbacks, so no callback can read it directly. It is derived instead, by a headspace A/B:

- A, the real step: the time from each call of `train_function` (on PyTorch, from the start of
  the read of its batch, which the running fit's input notes) until Keras hands its logs to
  the callbacks (they are numbers by then, so the device has finished the step);
- B, the step alone: the same compiled function on an input that costs nothing, one real batch
  served again and again from memory, timed `headspace_steps` times at the end of every epoch,
  training left as it was (on TensorFlow and PyTorch every variable it changes is saved before
  and put back after; on JAX it runs on a copy of the state). (Not in the middle of an epoch:
  the input would fill its buffers meanwhile, and the steps after would read as fed.)

The input-wait fraction is `1 - B / A`: the share of the real step that was not the step
itself. B is measured after every epoch, because other load on the machine changes the step's
speed: the measurements on both sides of an epoch and their noise bound B over it, so they
bound the fraction, and a bound that spans more than one of the TensorFlow profiler's bands
(see `feedpipe.core.stats`) is judged "cannot tell" rather than guessed. Load that rises and falls
within the epoch escapes both measurements; the delay it caused the process's threads there
(`feedpipe.core._contention`) widens the bound by what it adds over theirs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from feedpipe._frameworks import import_keras
from feedpipe._internals.tf import scalar_summary_metadata
from feedpipe.core._contention import OtherLoadSpan
from feedpipe.core.checks import check_int
from feedpipe.core.stats import MODERATE_FRACTION, verdict
from feedpipe.diagnostics._headspace import (
    CANNOT_TELL,
    KerasSteps,
    StepAlone,
    backend_steps,
    bounded_verdict,
    bracket,
    time_step_alone,
)

if TYPE_CHECKING:
    from feedpipe.core.stats import FeedStats
    from feedpipe.feeder import Feeder

keras = import_keras("fp.StarvationMonitor (a Keras callback)")

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
    """Mean time per step on an input that costs nothing (the headspace measurement): the mean
    of the measurements at the end of the epoch before (none for the fit's first) and at the
    end of this one, each less the delay other load caused it and plus the epoch's (see
    `other_load_s`)."""
    step_alone_low_s: float
    """The least the step alone may have averaged over the epoch: the faster measurement, less
    twice its noise (that of its own steps and of the epoch's, see `bracket`), or less the
    delay other load caused it where the epoch saw less."""
    step_alone_high_s: float
    """The most the step alone may have averaged over the epoch: the slower measurement, plus
    twice its noise, or, where other processes kept the step's threads waiting for a CPU
    longer in the epoch than in a measurement, that measurement less its delay plus the
    epoch's. Far from `step_alone_low_s`: the machine's load changed the step's speed."""
    other_load_s: float = 0.0
    """Seconds per step the process's threads waited in the epoch for a CPU that other
    processes held (see `feedpipe.core._contention`); 0 where the system does not
    count it."""
    producer_samples_per_s: float | None = None
    """What the monitored `Feeder`'s producer alone sustains (see `FeedStats`); None
    without a feeder, or where no batch of the epoch passed through it (TensorFlow gathers
    arrays in memory under `as_dataset()` itself)."""
    feeder_wait_fraction: float | None = None
    """The share of this epoch the monitored `Feeder`'s consumer waited for a staged batch,
    as `feeder.stats()` counts it; None without a feeder, or where no batch of the epoch
    passed through it. Under `fit` that consumer is the train function taking its batch, so
    it sees the same wait as the monitor, less what only the monitor sees: the framework
    taking the batch from the feeder, and the input's threads competing with the step for
    the CPU. A `prefetch` added after `as_dataset()` moves the consumer to tf.data's thread,
    which waits while the step computes too: then it reads higher than the step's wait."""
    backend: str = "tensorflow"
    """Keras's backend: it names what takes each batch from the feeder."""

    @property
    def input_wait_fraction(self) -> float:
        """Share of the real step spent waiting for input: `1 - step_alone_s / real_step_s`."""
        return max(0.0, 1.0 - self.step_alone_s / self.real_step_s)

    @property
    def input_wait_range(self) -> tuple[float, float]:
        """The lowest and highest input-wait fraction the step alone's bounds allow."""
        return (
            max(0.0, 1.0 - self.step_alone_high_s / self.real_step_s),
            max(0.0, 1.0 - self.step_alone_low_s / self.real_step_s),
        )

    @property
    def verdict(self) -> str:
        """`not`, `moderately` or `highly input-bound` by the profiler's thresholds, or
        `cannot tell` when `input_wait_range` spans more than one of them."""
        return bounded_verdict(*self.input_wait_range)

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
        low, high = self.input_wait_range
        figures = {
            "input_wait_fraction": self.input_wait_fraction,
            "input_wait_fraction_low": low,
            "input_wait_fraction_high": high,
            "steps_per_s": self.steps_per_s,
            "step_alone_steps_per_s": self.step_alone_steps_per_s,
        }
        if self.producer_samples_per_s is not None:
            figures["producer_samples_per_s"] = self.producer_samples_per_s
        if self.feeder_wait_fraction is not None:
            figures["feeder_wait_fraction"] = self.feeder_wait_fraction
        return figures

    def __str__(self) -> str:
        low, high = self.input_wait_range
        rates = (
            f"{self.steps_per_s:,.1f} steps/s achieved; the step alone took "
            f"{self.step_alone_low_s * 1e3:,.2f} to {self.step_alone_high_s * 1e3:,.2f} ms"
        )
        if self.verdict == CANNOT_TELL:
            line = (
                f"{CANNOT_TELL}: the step waited for input {low:.1%} to {high:.1%} of the time "
                f"({verdict(low)} to {verdict(high)}): the step alone's speed varied in the "
                f"measurements around this epoch, as other load on the machine makes it ({rates}"
                f"{self._other_load_note()})"
            )
        else:
            line = (
                f"{self.verdict}: the step waited for input {self.input_wait_fraction:.1%} of "
                f"the time (bound {low:.1%} to {high:.1%}; {rates})"
            )
        return line + self._feeder_note()

    def _other_load_note(self) -> str:
        if self.other_load_s < 0.0005:
            return ""
        return (
            f"; other processes kept its threads waiting for a CPU "
            f"{self.other_load_s * 1e3:,.1f} ms a step this epoch"
        )

    def _feeder_note(self) -> str:
        """What the feeder saw of the same wait, and why it differs where it does."""
        if self.feeder_wait_fraction is None:
            return ""
        seen = self.feeder_wait_fraction
        low, high = self.input_wait_range
        note = (
            f"; feeder.stats() this epoch: {seen:.1%} ({verdict(seen)}; its producer alone "
            f"makes {self.producer_samples_per_s:,.0f} samples/s)"
        )
        if low - seen >= MODERATE_FRACTION:
            taking = (
                "TensorFlow taking each batch from it (as_dataset's generator, Python and a "
                "copy per batch)"
                if self.backend == "tensorflow"
                else "Keras taking each batch from it (its iterator, Python per batch)"
            )
            return note + (
                f"; the other {self.input_wait_fraction - seen:.1%} is input work the feeder "
                f"cannot time: {taking} and the input's threads competing with the step for "
                "the CPU"
            )
        if seen - high >= MODERATE_FRACTION:
            return note + (
                "; it reads higher: a prefetch after as_dataset() makes tf.data's thread the "
                "feeder's consumer, and that thread waits while the step computes too"
            )
        return note


class StarvationMonitor(keras.callbacks.Callback):
    """A Keras callback that tells, per epoch, whether `model.fit` waits for its input.

    It works for any input `fit` takes (`tf.data`, `PyDataset`, a generator, a feeder or its
    `as_dataset()`), on Keras's TensorFlow, JAX and PyTorch backends: it wraps
    `model.train_function` for the fit (two clock reads per call; on PyTorch, where `fit` reads
    the batch before the call, the fit's input notes when each read begins) and puts Keras's own
    function back at the end. On the fit's second call it takes one real batch from the stream
    (the step trains on it exactly once, as it would have) and keeps it in memory for the fit;
    at the end of every epoch that has timed steps it runs the same compiled train function
    `headspace_steps` times on that batch served from memory (the headspace), saving and
    restoring every model, optimizer and metric variable around it (on PyTorch also the
    gradients, the modules' training modes and the random generators; on JAX, on a copy of the
    training state, dropped after). Each measured epoch adds `input_wait_fraction`, its bound
    `input_wait_fraction_low` / `_high`, `steps_per_s` and `step_alone_steps_per_s` (and, with a
    `feeder`, `producer_samples_per_s` and `feeder_wait_fraction`) to the epoch logs, appends an
    `EpochStarvation` to `epochs`, prints the verdict when `verbose`, and writes the figures as
    TensorBoard scalars under `log_dir`. An epoch with no timed step (fewer than two calls, or
    three in the first epoch) adds nothing.

    Each measured epoch costs `headspace_steps + 1` extra steps (one warms up), or a quarter
    of a second of them if that is more, and a copy of the model's variables to host memory
    and back. Time spent in callbacks listed *before* the monitor counts as step time: list
    it first (on PyTorch every callback's `on_train_batch_begin` counts too: Keras calls them
    between the read and the step).
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
            headspace_steps: Steps the step alone is timed over after each epoch (rounded up
                to whole calls of `steps_per_execution`), and for at least a quarter of a
                second. Default 10: enough for a standard error that bounds the verdict.
            verbose: 1 prints one line per epoch with the verdict; 0 prints nothing.
            log_dir: Where to write the figures as TensorBoard scalars, one point per epoch
                (TensorFlow writes them, on any backend); None writes nothing.
            feeder: The `Feeder` that feeds the fit (itself or its `as_dataset()`), to
                report what it saw of the same wait and what its producer alone sustains;
                optional.
        """
        super().__init__()
        self._steps_type = backend_steps("StarvationMonitor")
        headspace_steps = check_int(
            "headspace_steps",
            headspace_steps,
            "the step alone is timed over that many steps, and two are the fewest whose spread "
            "bounds the verdict (the default is 10)",
            minimum=2,
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
        if self.log_dir is not None and importlib.util.find_spec("tensorflow") is None:
            raise ImportError(
                f"`log_dir`={self.log_dir!r}: TensorBoard scalars are written by TensorFlow, "
                "which is not installed; pip install tensorflow, or pass log_dir=None and read "
                "the figures from the History or `monitor.epochs`."
            )
        self.feeder = feeder
        self.epochs: list[EpochStarvation] = []
        """One entry per measured epoch of the latest fit."""
        self._original: Any = None
        self._steps: KerasSteps | None = None
        self._read_began: Callable[[], float] | None = None
        """When the read of the coming call's batches began, where `fit` reads them before
        the call (PyTorch); None where the call reads them itself."""
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
        self._resident: Any = None
        """The headspace batch served from memory, taken from the real stream on the fit's
        second call; None until then."""
        self._alone: StepAlone | None = None
        """The latest headspace measurement."""
        self._fit_calls = 0
        self._epoch_calls = 0
        self._started: float | None = None
        """When the call being timed began; None while the current call is not timed."""
        self._call_steps = 1
        self._epoch_busy_s = 0.0
        self._epoch_steps = 0
        self._epoch_calls_timed = 0
        self._epoch_other_load: OtherLoadSpan | None = None
        """Other processes' delay from the epoch's first timed call on."""
        self._feeder_at_begin: Any = None

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
        self._steps = self._steps_type(model)
        self._read_began = self._steps.watch_reads()
        self._spe = int(model.steps_per_execution)
        self._total_steps = (self.params or {}).get("steps")
        self._reset_fit()
        self.epochs = []
        model.train_function = self._wrap(function)

    def _wrap(self, original):
        # TensorFlow's train function takes the input; JAX's takes the state, then the input;
        # PyTorch's takes the batches `fit` has just read, so its call is timed from that read.
        # Runs every call of every fit: `_started` is already None here (each batch's end and
        # each epoch's begin clear it), so only a timed call sets it.
        def train_function(*args):
            self._fit_calls += 1
            self._epoch_calls += 1
            if self._resident is None and self._fit_calls >= 2:
                return self._take_headspace_batch(original, *args)
            if self._epoch_calls > 1:  # an epoch's first call is not timed
                if self._epoch_other_load is None:
                    self._epoch_other_load = OtherLoadSpan()
                began = self._read_began
                self._started = time.perf_counter() if began is None else began()
            return original(*args)

        setattr(train_function, _ORIGINAL, original)
        return train_function

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_calls = 0
        self._started = None
        self._epoch_busy_s = 0.0
        self._epoch_steps = 0
        self._epoch_calls_timed = 0
        self._epoch_other_load = None
        self._feeder_at_begin = None if self.feeder is None else self.feeder.stats()

    def on_train_batch_begin(self, batch, logs=None):
        total = self._total_steps
        self._call_steps = min(self._spe, total - batch) if total else self._spe

    def on_train_batch_end(self, batch, logs=None):
        # Keras has turned the step's logs into numbers by now: the device finished the step.
        if self._started is not None:
            self._epoch_busy_s += time.perf_counter() - self._started
            self._epoch_steps += self._call_steps
            self._epoch_calls_timed += 1
            self._started = None

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch_steps == 0:
            return
        other_load_s = self._epoch_other_load.per_step_s(self._epoch_steps)
        before, self._alone = self._alone, self._time_step_alone()
        step_alone_s, low_s, high_s = bracket(
            *filter(None, [before, self._alone]),
            compared_over=self._epoch_calls_timed,
            other_load_s=other_load_s,
        )
        producer = feeder_wait = None
        stats = None if self.feeder is None else self.feeder.stats()
        # A feeder whose batches TensorFlow gathered itself (arrays under as_dataset) timed
        # no wait this epoch (it counts those steps untimed), so it has nothing to say of it.
        if stats is not None and stats.timed_steps > self._feeder_at_begin.timed_steps:
            producer = stats.producer_samples_per_s
            feeder_wait = _wait_fraction_between(self._feeder_at_begin, stats)
        result = EpochStarvation(
            epoch=epoch,
            steps=self._epoch_steps,
            real_step_s=self._epoch_busy_s / self._epoch_steps,
            step_alone_s=step_alone_s,
            step_alone_low_s=low_s,
            step_alone_high_s=high_s,
            other_load_s=other_load_s,
            producer_samples_per_s=producer,
            feeder_wait_fraction=feeder_wait,
            backend=keras.backend.backend(),
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
        self._steps = None
        self._read_began = None
        self._resident = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---- the headspace -------------------------------------------------------------------------

    def _take_headspace_batch(self, original, *args):
        """Runs this call's steps on elements taken here, keeping the first for the headspace.

        The step trains on each element exactly once, through the same compiled step.
        """
        *state, iterator = args
        elements = self._steps.take(iterator, self._spe)
        if not elements:
            raise StopIteration  # what Keras's own function raises on an exhausted iterator
        outputs = original(*state, self._steps.feed(elements))
        self._resident = self._steps.resident(elements[0])
        return outputs

    def _time_step_alone(self) -> StepAlone:
        """The compiled step on the resident batch, training unchanged."""
        with self._steps.detached(self._original) as run:
            return time_step_alone(
                lambda: run(self._resident), -(-self.headspace_steps // self._spe), self._spe
            )

    def _write_scalars(self, result: EpochStarvation) -> None:
        import tensorflow as tf  # TensorBoard's writer, on any Keras backend

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        scalar = scalar_summary_metadata()
        with self._writer.as_default():
            for name, value in result.logs().items():
                tf.summary.write(
                    name, tf.constant(value, tf.float32), step=result.epoch, metadata=scalar
                )
        self._writer.flush()


def _wait_fraction_between(begin: FeedStats, end: FeedStats) -> float:
    """The share of the consumer's time it waited for a staged batch between two snapshots."""
    wall_s = (end.wall_s - end.untimed_s) - (begin.wall_s - begin.untimed_s)
    return (end.consumer_wait_s - begin.consumer_wait_s) / wall_s if wall_s > 0 else 0.0
