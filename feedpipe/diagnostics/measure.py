"""Measuring: the producer alone, the consumer alone and both together, on the user's own
input and step (DESIGN.md's headspace A/B).

1. *producer alone*: batches taken from the input as fast as it makes them;
2. *consumer alone*: the step on one batch already on its devices, the synthetic upper bound;
3. *both together*: the real training rate, each step's wait for its batch and its compute.

The step is a callable taking one batch (`_CallableRun`: waits are timed directly), or a
compiled Keras model (`_KerasRun`), which then runs its own compiled train function exactly as
`model.fit` does; its waits sit inside that compiled step, so they are derived from the
consumer-alone time (a headspace measurement, through the same compiled input path on one
batch served from memory). The consumer alone is then timed before and after the together
measurement: other load on the machine changes the step's speed, and the two bound the derived
waits. The model's variables are put back when the measurement ends, and a Feeder input goes
on from where it was (`Feeder.set_aside`). Also here: the machine's figures that the
remedies' estimates use (cores, a memcpy's time, memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import optree

from feedpipe.core._contention import OtherLoadSpan
from feedpipe.core.batch import Batch
from feedpipe.core.checks import check_int
from feedpipe.diagnostics._headspace import StepAlone, backend_steps, bracket, finish
from feedpipe.diagnostics.verdict import Diagnosis, StepTiming
from feedpipe.feeder import Feeder

DEFAULT_STEPS = 50
"""Steps timed per measurement: enough for a median that one slow step does not move."""
DEFAULT_WARMUP = 5
"""Untimed steps before each measurement: tracing, worker start-up and a full staging ring."""
SMALL_ARRAYS_BYTES = 2**30
"""Arrays up to this size count as small: Keras's own array input keeps a second copy."""


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """What `measure` found: the diagnosis without remedies, and what the remedies also need
    to know of the batches."""

    diagnosis: Diagnosis
    image_like: bool
    """Whether the batches hold uint8 images."""


def measure(source: Any, step: Any, *, steps: int, warmup: int, progress: bool) -> Measurement:
    """Measures the producer alone, the consumer alone and both together; the arguments are
    `diagnose`'s. The diagnosis returned has no remedies yet."""
    check_int("steps", steps, f"pass the steps to time, e.g. steps={DEFAULT_STEPS}")
    check_int("warmup", warmup, f"pass the untimed steps, e.g. warmup={DEFAULT_WARMUP}")
    if is_keras_model(step):
        step_kind = f"Keras model {step.name!r} (its compiled train function)"
    elif callable(step):
        step_kind = f"{getattr(step, '__name__', type(step).__name__)}()"
    else:
        raise TypeError(
            f"`step` must be a callable taking one batch or a compiled Keras model; got "
            f"{type(step).__name__}."
        )
    measured_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    needed = 2 * warmup + 2 * steps
    bar = _Progress(progress)
    feeder = source if isinstance(source, Feeder) else None
    # A feeder goes on from where it was: the diagnosis trains nothing.
    with contextlib.nullcontext() if feeder is None else feeder.set_aside():
        run = _KerasRun(source, step) if is_keras_model(step) else _CallableRun(source, step)
        try:
            first = run.warm_up(warmup, bar)
            batch_bytes = _nbytes(first)
            image_like = _image_like(first)
            del first
            consumer = run.consumer_alone(steps, bar)
            began, cpu_began = time.perf_counter(), time.process_time()
            producer = run.producer_alone(steps, bar)
            cpu_share = (time.process_time() - cpu_began) / (time.perf_counter() - began)
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
        if feeder is not None:
            bar.start("what a sample costs (the source alone, in 1 and in 4 threads)", 1)
            sample_cost = feeder.sample_cost()
            bar.step()
    alone_range = None
    if again is not None:
        alone_s, low_s, high_s = bracket(
            consumer, again, compared_over=len(together), other_load_s=run.together_other_load_s
        )
        together = split_waits(together, alone_s)
        alone_range = (low_s, high_s)
    diagnosis = Diagnosis(
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
        feeder=None if feeder is None else feeder.describe(),
        sample_cost=None if feeder is None else sample_cost,
        producer_cpu_share=cpu_share,
    )
    return Measurement(diagnosis, image_like)


def is_keras_model(step: Any) -> bool:
    """Whether `step` is a Keras model (Keras is not imported to tell)."""
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


def endless(source: Any) -> Iterator:
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
    if isinstance(batch, Batch):
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


def _small_arrays_on_cpu(source: Any) -> tuple | None:
    """`(x, y)` or `(x, y, sample_weight)`, where `source` is a Feeder reading a tuple of that
    many arrays in memory, `SMALL_ARRAYS_BYTES` at most, onto CPUs only; else None. The arrays
    are the feeder's `source`, as the user gave them."""
    if not isinstance(source, Feeder):
        return None
    described = source.describe()
    nbytes = described.source.nbytes
    if described.accelerated or nbytes is None or nbytes > SMALL_ARRAYS_BYTES:
        return None
    data = source.source
    return data if isinstance(data, tuple) and len(data) in (2, 3) else None


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
        self.batches = endless(source)
        self.kept = None

    def _staged(self) -> int | None:
        """Batches staged on the devices now, where the input is a Feeder."""
        return self.source.stats().staged if isinstance(self.source, Feeder) else None

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
        (see `feedpipe.core._contention`)."""

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


def split_waits(together: list[StepTiming], alone_s: float) -> list[StepTiming]:
    """Each step's time split into its wait (what exceeds `alone_s`) and its compute."""
    split = []
    for timing in together:
        took = timing.wait_s + timing.compute_s
        wait = max(0.0, took - alone_s)
        split.append(StepTiming(wait, took - wait, timing.staged))
    return split


# ---- the machine, for the remedies' estimates -----------------------------------------------


def memcpy_s(nbytes: int) -> float:
    """Seconds one memcpy of `nbytes` takes here (the fastest of three)."""
    src = np.ones(max(nbytes, 1), np.uint8)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best


def memory_bytes() -> int:
    """This machine's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
