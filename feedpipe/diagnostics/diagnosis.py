"""Diagnose: is the step starved of input, by how much, and what would help most.

Three measurements on the user's own input and step, DESIGN.md's headspace A/B:

1. *producer alone*: batches taken from the input as fast as it makes them;
2. *consumer alone*: the step on one batch already on its devices, the synthetic upper bound;
3. *both together*: the real training rate, each step's wait for its batch and its compute.

From them: the input-bound fraction (judged with the TensorFlow profiler's thresholds), the
overlap efficiency (together ÷ the slower side alone), real ÷ synthetic, and remedies ranked by
the rate each could reach. The step is a callable taking one batch, or a compiled Keras model,
which then runs its own compiled train function exactly as `model.fit` does; its waits sit
inside that compiled step, so they are derived from the consumer-alone time (a headspace
measurement, through the same compiled input path on one batch served from memory). The
consumer alone is then timed before and after the together measurement: other load on the
machine changes the step's speed, and the two bound the derived waits, so a verdict the bound
cannot support reads "cannot tell". The model's variables are put back when the diagnosis
ends. Writing the HTML report is `feedpipe.diagnostics.report`'s job, which reads a `Diagnosis`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optree

from feedpipe.core.source import ArraySource, TFDatasetSource
from feedpipe.core.stage import DeviceBatch
from feedpipe.core.stats import verdict
from feedpipe.diagnostics._contention import OtherLoadSpan
from feedpipe.diagnostics._headspace import (
    CANNOT_TELL,
    StepAlone,
    backend_steps,
    bounded_verdict,
    bracket,
    finish,
)
from feedpipe.feeder import Feeder

DEFAULT_STEPS = 50
"""Steps timed per measurement: enough for a median that one slow step does not move."""
DEFAULT_WARMUP = 5
"""Untimed steps before each measurement: tracing, worker start-up and a full staging ring."""
OVERLAP_SLACK = 0.95
"""Together within 5 % of the slower side alone counts as fully overlapped."""
SCHEMA_VERSION = 2
"""The version of `Diagnosis.to_dict()`'s layout (and so of `feedpipe diagnose --json`): 2
added the step alone's bound, the measurement's time and this number."""


class TargetError(ValueError):
    """A diagnose target that cannot be loaded, or returns something other than (input, step)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepTiming:
    """One step of the together measurement."""

    wait_s: float
    """Time the step waited for its batch."""
    compute_s: float
    """Time the step itself took."""
    staged: int | None
    """Batches already staged on the devices when the step asked (a `Feeder` input only,
    whatever the step)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Remedy:
    """One change that would feed the step better, with the rate it could reach."""

    action: str
    """What to change."""
    why: str
    """The measurement behind it."""
    expected_steps_per_s: float
    """The rate the change could reach: an estimate from the three measurements."""
    gain: float
    """`expected_steps_per_s` over the rate measured together."""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What `diagnose` measured and concluded; `str()` is the printed report."""

    input_kind: str
    step_kind: str
    batch_bytes: int
    producer_batch_s: tuple[float, ...]
    """Seconds to take each batch, producer alone."""
    consumer_step_s: tuple[float, ...]
    """Seconds of each step on a batch already on the devices, consumer alone (for a Keras
    model: timed before the together measurement and again after it)."""
    together: tuple[StepTiming, ...]
    """The together measurement, step by step. Derived waits are each step's time beyond the
    consumer-alone time, at least zero: for the timeline; the fraction comes from the means."""
    waits_derived: bool
    """True when the waits are derived (step time less the consumer-alone time), because the
    input is read inside a compiled step; False when they were timed directly."""
    remedies: tuple[Remedy, ...] = ()
    step_alone_range_s: tuple[float, float] | None = None
    """The least and most seconds the step alone may have taken per step while together ran:
    the consumer-alone measurements before and after it, each widened by twice its noise and by
    the delay other load caused the together measurement beyond its own (see
    `feedpipe._headspace.bracket`). Derived waits only; None where waits were timed
    directly."""
    measured_at: str = ""
    """When the measurement began, as an ISO 8601 time with its UTC offset."""
    keras_arrays_step_s: tuple[float, ...] = ()
    """Seconds of each step of the same model fed by Keras's own array input, as
    `model.fit(x, y)` feeds it, on the feeder's arrays: timed last, step by step in turn with
    `feeder_beside_step_s`, where the input is a Feeder over small numpy arrays onto CPUs and
    the step a Keras model; empty otherwise."""
    feeder_beside_step_s: tuple[float, ...] = ()
    """Seconds of each step fed by the feeder, taken in turn with `keras_arrays_step_s` so that
    both see the same load (the feeder gains time to stage while the other runs: an upper
    bound on its rate, so the comparison favours it)."""

    @property
    def producer_steps_per_s(self) -> float:
        """Batches per second the input makes on its own."""
        return _rate(self.producer_batch_s)

    @property
    def consumer_steps_per_s(self) -> float:
        """Steps per second the step runs on batches already on its devices."""
        return _rate(self.consumer_step_s)

    @property
    def together_steps_per_s(self) -> float:
        """Steps per second of real training: input and step together."""
        return _rate([s.wait_s + s.compute_s for s in self.together])

    @property
    def input_bound_fraction(self) -> float:
        """Share of the together time the step waited for its batch. With derived waits, one
        less the consumer-alone time over the mean step: from means, because clipping each
        step's noise at zero would count noise as wait."""
        took = [s.wait_s + s.compute_s for s in self.together]
        if self.step_alone_range_s is not None:
            return _waited(took, statistics.fmean(self.consumer_step_s))
        total = math.fsum(took)
        return math.fsum(s.wait_s for s in self.together) / total if total > 0 else 0.0

    @property
    def input_bound_range(self) -> tuple[float, float]:
        """The least and most the input-bound fraction may be: with derived waits, as the step
        alone ranges over `step_alone_range_s`; timed directly, the fraction itself."""
        if self.step_alone_range_s is None:
            return (self.input_bound_fraction, self.input_bound_fraction)
        low_s, high_s = self.step_alone_range_s
        took = [s.wait_s + s.compute_s for s in self.together]
        return (_waited(took, high_s), _waited(took, low_s))

    @property
    def verdict(self) -> str:
        """`not`, `moderately` or `highly input-bound` by the profiler's thresholds, or
        `cannot tell` when `input_bound_range` spans more than one of them."""
        return bounded_verdict(*self.input_bound_range)

    @property
    def overlap_efficiency(self) -> float:
        """Together ÷ the slower side alone: 1.0 when input and step fully overlap."""
        bound = min(self.producer_steps_per_s, self.consumer_steps_per_s)
        return self.together_steps_per_s / bound if bound > 0 else 0.0

    @property
    def real_over_synthetic(self) -> float:
        """Together ÷ consumer alone: near 1.0, the input costs the step nothing."""
        consumer = self.consumer_steps_per_s
        return self.together_steps_per_s / consumer if consumer > 0 else 0.0

    def to_dict(self) -> dict:
        """Every figure, the per-step timings and the remedies, JSON-serialisable."""
        low, high = self.input_bound_range
        return {
            "schema_version": SCHEMA_VERSION,
            "measured_at": self.measured_at,
            "verdict": self.verdict,
            "input_bound_fraction": self.input_bound_fraction,
            "input_bound_fraction_low": low,
            "input_bound_fraction_high": high,
            "producer_steps_per_s": self.producer_steps_per_s,
            "consumer_steps_per_s": self.consumer_steps_per_s,
            "together_steps_per_s": self.together_steps_per_s,
            "overlap_efficiency": self.overlap_efficiency,
            "real_over_synthetic": self.real_over_synthetic,
            "input_kind": self.input_kind,
            "step_kind": self.step_kind,
            "batch_bytes": self.batch_bytes,
            "waits_derived": self.waits_derived,
            "step_alone_range_s": (
                None if self.step_alone_range_s is None else list(self.step_alone_range_s)
            ),
            "remedies": [dataclasses.asdict(r) for r in self.remedies],
            "producer_batch_s": list(self.producer_batch_s),
            "consumer_step_s": list(self.consumer_step_s),
            "together": [dataclasses.asdict(s) for s in self.together],
            "keras_arrays_step_s": list(self.keras_arrays_step_s),
            "feeder_beside_step_s": list(self.feeder_beside_step_s),
        }

    def __str__(self) -> str:
        low, high = self.input_bound_range
        if self.verdict == CANNOT_TELL:
            judged = (
                f"{CANNOT_TELL}: the step waited for input {low:.1%} to {high:.1%} of the time "
                f"({verdict(low)} to {verdict(high)})"
            )
        elif high > low:
            judged = (
                f"{self.verdict}: the step waited for input {self.input_bound_fraction:.1%} of "
                f"the time (bound {low:.1%} to {high:.1%})"
            )
        else:
            judged = (
                f"{self.verdict}: the step waited for input {self.input_bound_fraction:.1%} of "
                "the time"
            )
        lines = [
            f"{judged} ({len(self.together)} steps; {self.step_kind} fed by {self.input_kind})",
            f"  producer alone   {self.producer_steps_per_s:10.1f} steps/s",
            f"  consumer alone   {self.consumer_steps_per_s:10.1f} steps/s  (batch already on "
            "the devices: the synthetic upper bound)",
            f"  together         {self.together_steps_per_s:10.1f} steps/s  "
            f"(overlap efficiency {self.overlap_efficiency:.2f}, real/synthetic "
            f"{self.real_over_synthetic:.2f})",
        ]
        if self.keras_arrays_step_s:
            lines.append(
                f"  model.fit(x, y)  {_rate(self.keras_arrays_step_s):10.1f} steps/s  (Keras's "
                f"own array input, step by step in turn with the feeder's "
                f"{_rate(self.feeder_beside_step_s):,.1f})"
            )
        if self.step_alone_range_s is not None:
            low_s, high_s = self.step_alone_range_s
            lines.append(
                "  (the input is read inside the compiled step: waits are each step's time "
                f"less the consumer-alone time, {low_s * 1e3:.2f} to {high_s * 1e3:.2f} ms "
                "measured before and after together)"
            )
        lines.append("remedies, by the rate each could reach:")
        for rank, remedy in enumerate(self.remedies, 1):
            lines.append(
                f"  {rank}. {remedy.action}: up to {remedy.expected_steps_per_s:,.1f} steps/s "
                f"({remedy.gain:.2f}x)\n     {remedy.why}"
            )
        return "\n".join(lines)


def _waited(took: list[float], alone_s: float) -> float:
    """The share of the mean step in `took` beyond `alone_s`: the wait, were the step alone
    `alone_s`."""
    return max(0.0, 1.0 - alone_s / statistics.fmean(took)) if took else 0.0


def _rate(durations) -> float:
    total = math.fsum(durations)
    return len(durations) / total if total > 0 else 0.0


# ---- the input and the step -------------------------------------------------------------------


def _is_keras_model(step: Any) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(step, keras.Model)


def _input_kind(source: Any) -> str:
    if isinstance(source, Feeder):
        return f"fp.Feeder(workers={source.options.workers}, depth={source.options.depth})"
    if _is_tf_dataset(source):
        return "tf.data.Dataset"
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(source, keras.utils.PyDataset):
        return f"keras PyDataset (workers={source.workers})"
    return type(source).__name__


def _endless(source: Any) -> Iterator:
    """The input's batches, starting a new pass whenever one ends, until a pass is empty."""
    while True:
        empty = True
        for batch in source:
            empty = False
            yield batch
        if empty:
            return


def _is_tf_dataset(source: Any) -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(source, tf.data.Dataset)


def _arrays(batch: Any) -> Iterator[Any]:
    """The batch's arrays, whichever framework holds them: a feeder's batch by its replicas'
    rows, a TensorFlow distributed value (one batch under a strategy) by its replicas' parts."""
    if isinstance(batch, DeviceBatch):
        batch = batch.replicas
    tf = sys.modules.get("tensorflow")
    for leaf in optree.tree_leaves(batch):
        if tf is not None and isinstance(leaf, tf.distribute.DistributedValues):
            yield from leaf.values
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            yield leaf


def _nbytes(batch: Any) -> int:
    return sum(math.prod(leaf.shape) * _itemsize(leaf.dtype) for leaf in _arrays(batch))


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a numpy, JAX (`itemsize`) or TensorFlow (`size`) dtype."""
    return getattr(dtype, "itemsize", None) or dtype.size


def _on_step_device(batch: Any) -> Any:
    """TensorFlow tensors moved to the step's device (`feedpipe.tf.keras_step`); any other
    batch as it is (JAX arrays already sit on theirs)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not any(isinstance(leaf, tf.Tensor) for leaf in tf.nest.flatten(batch)):
        return batch
    from feedpipe.tf.keras_step import on_step_device

    return on_step_device(batch)


def _is_cpu(device: Any) -> bool:
    """A TensorFlow device name or a JAX device on a CPU."""
    platform = getattr(device, "platform", None)
    return platform == "cpu" if platform is not None else "CPU" in str(device).upper()


def _on_service(feeder: Feeder) -> bool:
    """Whether the feeder reads tf.data service (its client module is loaded only then)."""
    client = sys.modules.get("feedpipe.service.client")
    return client is not None and isinstance(feeder._producer, client.ServiceProducer)


def _ran_out() -> tuple[type[Exception], ...]:
    """What an exhausted input raises: TensorFlow's iterators raise `OutOfRangeError`."""
    tf = sys.modules.get("tensorflow")
    return (StopIteration,) if tf is None else (StopIteration, tf.errors.OutOfRangeError)


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


class _Progress:
    """A labelled progress line on stderr (so `--json` output stays clean): the measurement
    under way and its steps, updated in place on a terminal, one line per measurement else."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.live = enabled and sys.stderr.isatty()
        self.label, self.total, self.done = "", 0, 0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        if self.enabled and not self.live:
            print(f"feedpipe diagnose: {label}, {_steps(total)}", file=sys.stderr, flush=True)

    def step(self) -> None:
        self.done += 1
        if self.live:
            end = "\n" if self.done == self.total else ""
            line = f"\rfeedpipe diagnose: {self.label} {self.done}/{_steps(self.total)}"
            print(line, end=end, file=sys.stderr, flush=True)


class _CallableRun:
    """Measures a callable step fed from the input's own iterator; waits are timed directly."""

    waits_derived = False

    def __init__(self, source: Any, step: Callable[[Any], Any]):
        self.source, self.step = source, step
        self.batches = _endless(source)
        self.kept = None

    def _staged(self) -> int | None:
        return self.source._staged() if isinstance(self.source, Feeder) else None

    def warm_up(self, count: int, progress: _Progress) -> Any:
        progress.start("warm-up", count)
        for _ in range(count):
            batch = next(self.batches)
            finish(self.step(batch))
            progress.step()
        self.kept = batch if isinstance(self.source, Feeder) else _on_step_device(batch)
        return batch

    def consumer_alone(self, count: int, progress: _Progress) -> StepAlone:
        progress.start("consumer alone (a batch already on the devices)", count)
        times = []
        for _ in range(count):
            started = time.perf_counter()
            finish(self.step(self.kept))
            times.append(time.perf_counter() - started)
            progress.step()
        self.kept = None  # a kept Feeder batch would hold a host slot
        return StepAlone(times)

    def consumer_again(self, count: int, progress: _Progress) -> StepAlone | None:
        """The consumer alone after together: needed only where waits are derived."""
        return None

    def keras_arrays(
        self, warmup: int, count: int, progress: _Progress
    ) -> tuple[list[float], list[float]]:
        """The step fed by Keras's own array input, and by the feeder in turn with it: only for
        a Keras model."""
        return [], []

    def producer_alone(self, count: int, progress: _Progress) -> list[float]:
        progress.start("producer alone (batches taken as fast as the input makes them)", count)
        times = []
        for _ in range(count):
            started = time.perf_counter()
            next(self.batches)
            times.append(time.perf_counter() - started)
            progress.step()
        return times

    def together(self, warmup: int, count: int, progress: _Progress) -> list[StepTiming]:
        progress.start("together (input and step, the first steps untimed)", warmup + count)
        timings = []
        for i in range(warmup + count):
            staged = self._staged()
            asked = time.perf_counter()
            batch = next(self.batches)
            got = time.perf_counter()
            finish(self.step(batch))
            done = time.perf_counter()
            del batch
            if i >= warmup:
                timings.append(StepTiming(got - asked, done - got, staged))
            progress.step()
        return timings

    def restore(self) -> None:
        """Ends the measurement's reading of the input; a callable step has nothing to put
        back."""
        self.batches.close()


class _KerasRun(_CallableRun):
    """Measures a compiled Keras model through its own train function, as `model.fit` runs it.

    Producer alone takes batches from the distributed iterator `fit` would use; consumer alone
    runs the train function on an iterator serving one of them from memory (the same compiled
    input path, on an input that costs nothing), before together and again after it; together
    runs the train function on the real iterator, which reads the input inside the compiled
    step, so each step's wait is derived from the consumer-alone time. Every variable is put
    back at the end.
    """

    waits_derived = True

    def __init__(self, source: Any, model: Any):
        if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
            raise TypeError(
                "The step is a Keras model that is not compiled; call model.compile(...) "
                "before diagnosing it."
            )
        self.source = source
        self.model = model
        self.steps = backend_steps("diagnose")(model)
        self.batches = self.steps.inputs(source)
        self.train: Callable[[Any], Any] = model.train_function
        self.spe = int(model.steps_per_execution)
        """Steps each call runs: times are per call, divided by it."""
        self._detached = contextlib.ExitStack()
        self.kept = None
        self.together_other_load_s = 0.0
        """Per step, the delay other processes caused the together measurement's timed steps
        (see `feedpipe.diagnostics._contention`)."""

    def warm_up(self, count: int, progress: _Progress) -> Any:
        progress.start("warm-up", count)
        batch = next(self.batches)
        # Every variable must exist before training is set aside, and before the train
        # function is made (on JAX it is compiled for the variables' shardings).
        self.steps.build(batch)
        self.model.make_train_function()
        self.train = self._detached.enter_context(self.steps.detached(self.model.train_function))
        for _ in range(count):
            finish(self.train(self.batches))
            progress.step()
        self.kept = self.steps.resident(batch)
        return batch

    def consumer_alone(self, count: int, progress: _Progress) -> StepAlone:
        finish(self.train(self.kept))  # the first call on this iterator traces
        return self._time_alone("consumer alone (one batch served from memory)", count, progress)

    def consumer_again(self, count: int, progress: _Progress) -> StepAlone:
        alone = self._time_alone("consumer alone again, after together", count, progress)
        self.kept = None
        return alone

    def keras_arrays(
        self, warmup: int, count: int, progress: _Progress
    ) -> tuple[list[float], list[float]]:
        """The train function fed as `model.fit(x, y)` would feed it the feeder's arrays, step
        by step in turn with the feeder, where the feeder reads small `(x, y)` or
        `(x, y, sample_weight)` arrays onto CPUs."""
        data = _small_arrays_on_cpu(self.source)
        if data is None:
            return [], []
        batches = self.steps.inputs(*data, batch_size=self.source.options.global_batch_size)
        progress.start(
            "model.fit(x, y) on the same arrays, in turn with the feeder (the first untimed)",
            warmup + count,
        )
        direct, beside = [], []
        for i in range(warmup + count):
            for iterator, times in ((batches, direct), (self.batches, beside)):
                started = time.perf_counter()
                finish(self.train(iterator))
                if i >= warmup:
                    times.append((time.perf_counter() - started) / self.spe)
            progress.step()
        return direct, beside

    def _time_alone(self, label: str, count: int, progress: _Progress) -> StepAlone:
        progress.start(label, count)
        times = []
        other_load = OtherLoadSpan()
        for _ in range(count):
            started = time.perf_counter()
            finish(self.train(self.kept))
            times.append((time.perf_counter() - started) / self.spe)
            progress.step()
        return StepAlone(times, other_load.per_step_s(count * self.spe))

    def together(self, warmup: int, count: int, progress: _Progress) -> list[StepTiming]:
        """Each step's whole time as `compute_s`; `diagnose` splits off the wait once the
        consumer alone has been timed again."""
        progress.start("together (input and step, the first steps untimed)", warmup + count)
        timings = []
        for i in range(warmup + count):
            if i == warmup:
                other_load = OtherLoadSpan()
            staged = self._staged()
            started = time.perf_counter()
            finish(self.train(self.batches))
            if i >= warmup:
                took = (time.perf_counter() - started) / self.spe
                timings.append(StepTiming(0.0, took, staged))
            progress.step()
        self.together_other_load_s = other_load.per_step_s(count * self.spe)
        return timings

    def restore(self) -> None:
        """Leaves training as it was before the warm-up."""
        self._detached.close()
        # Dropped, so that no thread of TensorFlow's reads the feeder on behind this point.
        self.batches = self.kept = None


def _split_waits(together: list[StepTiming], alone_s: float) -> list[StepTiming]:
    """Each step's time split into its wait (what exceeds `alone_s`) and its compute."""
    split = []
    for timing in together:
        took = timing.wait_s + timing.compute_s
        wait = max(0.0, took - alone_s)
        split.append(StepTiming(wait, took - wait, timing.staged))
    return split


# ---- remedies ---------------------------------------------------------------------------------


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _memcpy_s(nbytes: int) -> float:
    """Seconds one memcpy of `nbytes` takes here (the fastest of three)."""
    src = np.ones(max(nbytes, 1), np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best


def _image_like(batch: Any) -> bool:
    """Whether the batch holds uint8 images (rank 4 with 1, 3 or 4 channels first or last)."""
    for leaf in _arrays(batch):
        shape = leaf.shape
        if (
            getattr(leaf.dtype, "name", None) == "uint8"
            and len(shape) == 4
            and (shape[-1] in (1, 3, 4) or shape[1] in (1, 3, 4))
        ):
            return True
    return False


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _epoch_bytes(feeder: Feeder | None, batch_bytes: int) -> int | None:
    """The bytes of one epoch's batches, where the input says how many there are."""
    try:
        return None if feeder is None else len(feeder) * batch_bytes
    except TypeError:
        return None


HANDOFF_MARGIN = 2.0
"""The feeder's own producer at least this many times faster than the batches reaching the
step: the hand-off from `as_dataset()` into TensorFlow, not the feeder, limits the input."""
DIRECT_MARGIN = 1.1
"""Keras's own array input must beat the feeder by this much, side by side, to be suggested:
a smaller edge is within what a busy machine moves between two steps."""
SMALL_ARRAYS_BYTES = 2**30
"""Arrays up to this size count as small: Keras's own array input keeps a second copy."""


def _handoff_bound(diagnosis: Diagnosis, feeder: Feeder | None) -> str | None:
    """Where a Feeder feeds a Keras model and its own producer is far faster than the batches
    that reach the step: the measurement that says the hand-off limits the input."""
    producer = diagnosis.producer_steps_per_s
    if feeder is None or not diagnosis.waits_derived or producer >= diagnosis.consumer_steps_per_s:
        return None
    own = feeder.stats().producer_samples_per_s / feeder.options.global_batch_size
    if own < HANDOFF_MARGIN * producer:
        return None
    return (
        f"the feeder's own producer makes {own:,.0f} batches/s, yet {producer:,.1f}/s reach "
        f"the step, which could take {diagnosis.consumer_steps_per_s:,.1f}/s: handing each "
        "batch from as_dataset() into TensorFlow (Python and a copy per batch) is the "
        "bottleneck, not the feeder"
    )


def _small_arrays_on_cpu(source: Any) -> tuple | None:
    """`(x, y)` or `(x, y, sample_weight)`, where `source` is a Feeder reading a tuple of that
    many numpy arrays, `SMALL_ARRAYS_BYTES` at most, onto CPUs only; else None."""
    if not isinstance(source, Feeder) or not all(_is_cpu(d) for d in source.devices):
        return None
    arrays = getattr(source._source, "arrays", None)  # an ArraySource: arrays in memory
    if arrays is None or sum(a.nbytes for a in arrays) > SMALL_ARRAYS_BYTES:
        return None
    data = optree.tree_unflatten(source._source.treespec, arrays)
    return data if isinstance(data, tuple) and len(data) in (2, 3) else None


def _service_remedy(diagnosis: Diagnosis, feeder: Feeder, cores: int) -> tuple[str, str] | None:
    """`(action, why)` naming tf.data service, where the step outruns the input and this
    host's cores, all of them, would not make the step's rate; None elsewhere.

    The per-sample cost is measured: the cores that made the producer's rate (its workers, one
    for a thread, at most every core) spent `cores busy / (producer rate x samples per step)`
    seconds of one core on each sample. Assuming the work scales with cores, as the workers
    remedy does, the step's rate needs that cost times its samples per second in service
    worker cores; a feeder already on the service needs its worker cores scaled by the step's
    rate over the producer's. Either way each sample crosses the network once, at the step's
    rate.
    """
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    samples = feeder.split.global_batch_size
    network = diagnosis.batch_bytes * consumer
    crossing = (
        f"each sample then crosses the network once: {network / 2**20:,.1f} MiB/s "
        f"({network * 8e-9:,.2f} Gbit/s)"
    )
    if _on_service(feeder):
        scale = math.ceil(consumer / producer * 10) / 10
        return (
            f"more tf.data service workers: {scale:.1f}x the worker cores now (feedpipe "
            f"service worker --dispatcher {feeder._producer.service.removeprefix('grpc://')})",
            f"the service's workers make {producer * samples:,.1f} samples/s; if they, not the "
            f"network, are the limit and the work scales with cores, {scale:.1f}x their cores "
            f"reach the step; {crossing}",
        )
    if isinstance(feeder._source, TFDatasetSource):  # its own threads: the cores busy unknown
        return None
    busy = min(max(feeder.options.workers, 1), cores)
    if producer * cores / busy >= consumer:
        return None
    core_s = busy / (producer * samples)
    needed = math.ceil(round(consumer * samples * core_s, 9))
    if isinstance(feeder._source, ArraySource):
        what, costs = "offload the per-sample work", ""
    else:
        what = (
            "write the per-sample work as a TensorFlow-ops `transform` over arrays (such as "
            "file paths) and offload it"
        )
        costs = " and costs no more in TensorFlow ops"
    return (
        f"{what} to tf.data service: fp.Feeder(arrays, ..., transform=<TensorFlow ops>, "
        f'service="grpc://host:port") with {needed} worker cores in all (feedpipe service '
        "worker --dispatcher host:port)",
        f"all {cores} cores here would make {producer * cores / busy:,.1f} batches/s at most "
        f"({producer * samples:,.1f} samples/s from {busy} of them: {core_s * 1e3:,.2f} ms of "
        f"one core a sample); if the work scales with cores{costs}, {consumer:,.1f} steps/s of "
        f"{samples} samples need {needed} worker cores; {crossing}",
    )


def rank_remedies(
    diagnosis: Diagnosis,
    source: Any,
    *,
    cores: int,
    memcpy_s: float,
    memory_bytes: int,
    image_like: bool = False,
) -> tuple[Remedy, ...]:
    """Remedies for what `diagnosis` measured, best first, each with the rate it could reach.

    Estimates, from the three rates: staging deeper or ahead can reach the slower side alone;
    parallel production scales the producer with the free cores up to the step's rate;
    tf.data service, where even every core here falls short, reaches the step's rate with as
    many worker cores as the measured per-sample cost needs;
    caching removes the producer's per-sample work (one gather per batch remains); fewer host
    copies save the copies a Python pipeline makes beyond the one into a slot.
    """
    producer = diagnosis.producer_steps_per_s
    consumer = diagnosis.consumer_steps_per_s
    achieved = diagnosis.together_steps_per_s
    feeder = source if isinstance(source, Feeder) else None
    found: list[tuple[str, str, float]] = []

    def add(action: str, why: str, expected: float) -> None:
        if expected > achieved * 1.02:
            found.append((action, why, expected))

    bound = min(producer, consumer)
    if diagnosis.verdict == CANNOT_TELL:
        low, high = diagnosis.input_bound_range
        low_s, high_s = diagnosis.step_alone_range_s or (0.0, 0.0)
        return (
            Remedy(
                "none until the verdict is clear: measure again on a quieter machine, or with "
                "more --steps",
                f"the step alone took {low_s * 1e3:.2f} to {high_s * 1e3:.2f} ms before and "
                "after together (other load on this machine changed its speed), so the step "
                f"waited between {low:.1%} and {high:.1%} of the time: {verdict(low)} to "
                f"{verdict(high)}, and a remedy picked now could be the wrong one",
                achieved,
                1.0,
            ),
        )
    if diagnosis.verdict == "not input-bound":
        return (
            Remedy(
                "none for the input: the step is the bottleneck",
                f"the step waits {diagnosis.input_bound_fraction:.1%} of the time; make the "
                "step itself faster (mixed precision, jit_compile, a larger per-replica batch)",
                consumer,
                consumer / achieved if achieved > 0 else 1.0,
            ),
        )
    staged = [s.staged for s in diagnosis.together if s.staged is not None]
    if achieved < OVERLAP_SLACK * bound:
        why = (
            f"together reaches {diagnosis.overlap_efficiency:.2f} of the slower side alone "
            f"({bound:,.1f} steps/s): production and the step do not fully overlap"
        )
        if feeder is None:
            add("stage batches ahead on the devices: fp.Feeder(...)", why, bound)
        elif producer >= consumer and staged and min(staged) == 0:
            # Fast enough on average, yet the ring ran dry: more of it rides out the jitter.
            depth = feeder.options.depth
            empty = sum(count == 0 for count in staged) / len(staged)
            add(
                f"deeper staging: depth={2 * depth} (now {depth})",
                why + f"; the step found no batch staged at {empty:.0%} of its steps",
                bound,
            )
    if diagnosis.keras_arrays_step_s and feeder is not None:
        direct = _rate(diagnosis.keras_arrays_step_s)
        beside = _rate(diagnosis.feeder_beside_step_s)
        if direct > DIRECT_MARGIN * beside:
            add(
                f"model.fit(x, y, batch_size={feeder.options.global_batch_size}) on the arrays "
                "directly, without fp.Feeder (if they need no per-sample `transform`)",
                f"measured here, step by step in turn: Keras's own array input ran "
                f"{direct:,.1f} steps/s, the feeder {beside:,.1f}; for these arrays in memory "
                "on a CPU, feedpipe does not help",
                achieved * direct / beside,
            )
    handoff = _handoff_bound(diagnosis, feeder)
    if handoff is not None:
        add(
            "fp.train(model, feeder, ...) instead of model.fit(feeder.as_dataset()): the "
            "feeder's own loop takes batches already on the devices, with no hand-off",
            handoff,
            consumer,
        )
    if producer < consumer and handoff is None:
        why = (
            f"the input alone makes {producer:,.1f} batches/s, the step could take "
            f"{consumer:,.1f}/s"
        )
        own_threads = feeder._source.own_threads if feeder is not None else None
        if own_threads is not None:  # a DaliSource: DALI's threads do the work
            if own_threads < cores:
                add(
                    f"more DALI threads: DaliSource(..., num_threads={cores}) (now {own_threads})",
                    why + f"; {cores} cores can run the pipeline's operators in parallel",
                    min(consumer, producer * cores / own_threads),
                )
        elif feeder is not None:
            used = max(feeder.options.workers, 1)
            if used < cores and not _on_service(feeder):
                add(
                    f"more workers: workers={cores} (now {feeder.options.workers})",
                    why + f"; {cores} cores can run the per-sample work in parallel",
                    min(consumer, producer * cores / used),
                )
            # tf.data service feeds TensorFlow's layer alone.
            tensorflow = feeder.layer.name == "tensorflow"
            offload = _service_remedy(diagnosis, feeder, cores) if tensorflow else None
            if offload is not None:
                action, beyond = offload
                add(action, f"{why}; {beyond}", consumer)
        else:
            add(
                f"move the per-sample work into a map-style source or `transform` and run it "
                f"in fp.Feeder(..., workers={cores})",
                why + f"; {cores} cores can run it in parallel, free of the GIL",
                min(consumer, producer * cores),
            )
        epoch_bytes = _epoch_bytes(feeder, diagnosis.batch_bytes)
        if epoch_bytes is None or epoch_bytes <= memory_bytes / 2:
            size = "" if epoch_bytes is None else f" ({epoch_bytes / 2**20:,.0f} MiB an epoch)"
            gather_s = 2 * memcpy_s
            add(
                "cache the decoded samples in memory (numpy arrays as the source)",
                why + f"; if the samples are the same every epoch{size}, only a gather per "
                "batch remains from the second epoch on",
                min(consumer, 1 / gather_s if gather_s > 0 else consumer),
            )
        extra_copies_s = 2 * memcpy_s
        if feeder is None and 1 / producer > extra_copies_s:
            add(
                "fewer host copies: fp.Feeder writes each sample once, into its replica's slot",
                why + f"; a batch's memcpy costs {memcpy_s * 1e3:.2f} ms here, and a Python "
                "pipeline usually copies it about three times",
                min(consumer, 1 / (1 / producer - extra_copies_s)),
            )
        if image_like and own_threads is None:
            add(
                "decode and augment the images with DALI (feedpipe.dali; pip install "
                "feedpipe[dali]), on the GPU where there is one",
                why + "; the batches hold uint8 images",
                min(consumer, producer * cores),
            )
    if not found and achieved < OVERLAP_SLACK * bound:
        ready = (
            ", and the feeder always had a batch staged when the step asked"
            if staged and min(staged) > 0
            else ""
        )
        found.append(
            (
                "none predicted to help: the input and the step slow each other down",
                f"each alone is faster than together ({producer:,.1f} and {consumer:,.1f} "
                f"against {achieved:,.1f} steps/s){ready}: run at once, they share the CPU's "
                "cores and Python's GIL; on a GPU the step would leave those to the input",
                achieved,
            )
        )
    if not found:  # input-bound, yet no remedy is predicted to beat the rate reached
        found.append(
            (
                "none predicted to help: measure again with more --steps",
                f"the step waits {diagnosis.input_bound_fraction:.1%} of the time, yet together "
                f"reaches {diagnosis.overlap_efficiency:.2f} of the slower side alone and no "
                "change above would be more than 2 % faster; short measurements put start-up "
                "waits in that figure",
                achieved,
            )
        )
    found.sort(key=lambda item: -item[2])
    return tuple(
        Remedy(action, why, expected, expected / achieved if achieved > 0 else math.inf)
        for action, why, expected in found
    )


# ---- the measurement --------------------------------------------------------------------------


def diagnose(
    source: Any,
    step: Any,
    *,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
) -> Diagnosis:
    """Measures the producer alone, the consumer alone and both together; ranks remedies.

    Args:
        source: the input: an `fp.Feeder` (which goes on afterwards from where it was), a
            `tf.data.Dataset`, a `keras.utils.PyDataset`, or any iterable of batches (a
            generator is read on, never restarted).
        step: a callable taking one batch (a `Batch` for a Feeder), or a compiled Keras model,
            which is trained as `model.fit` trains it; its variables are put back afterwards.
        steps: steps timed in each measurement.
        warmup: untimed steps before the first and the together measurement.
        progress: show a labelled progress line on stderr.

    Returns:
        The `Diagnosis`; `print(diagnosis)` gives the verdict, the rates and the remedies, and
        `feedpipe.report.write_report(diagnosis, directory)` draws it as an HTML page.
    """
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}`={value!r} must be an integer >= 1.")
    if _is_keras_model(step):
        step_kind = f"Keras model {step.name!r} (its compiled train function)"
    elif callable(step):
        step_kind = f"step {getattr(step, '__name__', type(step).__name__)}"
    else:
        raise TypeError(
            f"`step` must be a callable taking one batch or a compiled Keras model; got "
            f"{type(step).__name__}."
        )
    measured_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    needed = 2 * warmup + 2 * steps
    bar = _Progress(progress)
    # A feeder goes on from where it was: the diagnosis trains nothing.
    with source._set_aside() if isinstance(source, Feeder) else contextlib.nullcontext():
        run = _KerasRun(source, step) if _is_keras_model(step) else _CallableRun(source, step)
        try:
            first = run.warm_up(warmup, bar)
            batch_bytes = _nbytes(first)
            image_like = _image_like(first)
            del first
            consumer = run.consumer_alone(steps, bar)
            producer = run.producer_alone(steps, bar)
            together = run.together(warmup, steps, bar)
            again = run.consumer_again(steps, bar)
            arrays, beside = run.keras_arrays(warmup, steps, bar)
        except _ran_out() as error:
            raise ValueError(
                f"The input ({_input_kind(source)}) ran out of batches: diagnose takes "
                f"{needed} (2 x warmup={warmup} + 2 x steps={steps}); give an input that "
                "repeats or is longer, or pass fewer steps."
            ) from error
        finally:
            run.restore()
    alone_range = None
    if again is not None:
        alone_s, low_s, high_s = bracket(
            consumer, again, compared_over=len(together), other_load_s=run.together_other_load_s
        )
        together = _split_waits(together, alone_s)
        alone_range = (low_s, high_s)
    measured = Diagnosis(
        _input_kind(source),
        step_kind,
        batch_bytes,
        tuple(producer),
        (*consumer.times_s, *(again.times_s if again else ())),
        tuple(together),
        run.waits_derived,
        step_alone_range_s=alone_range,
        measured_at=measured_at,
        keras_arrays_step_s=tuple(arrays),
        feeder_beside_step_s=tuple(beside),
    )
    return dataclasses.replace(
        measured,
        remedies=rank_remedies(
            measured,
            source,
            cores=_cores(),
            memcpy_s=_memcpy_s(batch_bytes),
            memory_bytes=_memory_bytes(),
            image_like=image_like,
        ),
    )


# ---- targets ----------------------------------------------------------------------------------


def load_target(target: str) -> tuple[Any, Any]:
    """Calls `module:function` or `path/to/file.py:function`; returns its (input, step)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TargetError(
            f"TARGET {target!r} must be `module:function` or `path/to/file.py:function`."
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"TARGET {target!r}: there is no file {where!r}.")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise TargetError(f"TARGET {target!r}: no module named {where!r}.") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise TargetError(f"TARGET {target!r}: {where!r} has no function {name!r}.")
    try:
        returned = function()
    except Exception as error:
        error.add_note(f"feedpipe diagnose: raised by TARGET {target!r}.")
        raise
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise TargetError(
            f"TARGET {target!r} returned {type(returned).__name__}; it must return "
            "(input, step): the input (an fp.Feeder, tf.data.Dataset, PyDataset or iterable "
            "of batches) and the step (a callable taking one batch, or a compiled Keras model)."
        )
    source, step = returned
    if not (callable(step) or _is_keras_model(step)):
        raise TargetError(
            f"TARGET {target!r} returned a step of type {type(step).__name__}; the step must be "
            "a callable taking one batch or a compiled Keras model."
        )
    if not hasattr(source, "__iter__"):
        raise TargetError(
            f"TARGET {target!r} returned an input of type {type(source).__name__}, which cannot "
            "be iterated; return an fp.Feeder, tf.data.Dataset, PyDataset or iterable of batches."
        )
    return source, step
