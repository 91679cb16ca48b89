"""The same compiled Keras step on one batch already on its device, leaving training as it was.

`StarvationMonitor` and `diagnose` time a model's own compiled train step on one batch taken
from the real stream: the headspace measurement. This module times it and bounds what it
measured; each backend's `KerasSteps` (`feedpipe.tf.keras_step`, `feedpipe.jax.keras_step`,
`feedpipe.torch.keras_step`) serves the batch again and again from memory through the step's
own input path and leaves training as it was.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import optree

from feedpipe._frameworks import import_keras
from feedpipe.core._contention import OtherLoadSpan
from feedpipe.core.stats import verdict

HEADSPACE_MIN_S = 0.25
"""The step alone is timed for at least this long, so that the machine's load over a quarter
of a second sets it, not its load over the few milliseconds that ten fast steps take."""
CANNOT_TELL = "cannot tell"
"""The verdict when the measurement's error bound spans more than one of the profiler's bands."""


def bounded_verdict(low: float, high: float) -> str:
    """The profiler's verdict when both ends of an input-bound fraction's bound share it, else
    `CANNOT_TELL`: a verdict the measurement cannot support would send users after the wrong
    remedy."""
    judged = verdict(low)
    return judged if verdict(high) == judged else CANNOT_TELL


@dataclasses.dataclass(frozen=True, slots=True)
class StepAlone:
    """One measurement of the step alone."""

    times_s: list[float]
    """Seconds per step, one entry per call."""
    other_load_s: float = 0.0
    """Seconds per step its threads waited for a CPU that other processes held (see
    `feedpipe.core._contention`)."""


def bracket(
    *measurements: StepAlone, compared_over: int, other_load_s: float = 0.0
) -> tuple[float, float, float]:
    """The step alone over a stretch of `compared_over` steps it was timed on both sides of:
    its estimate, and the least (never below zero) and most it may have averaged.

    Each measurement bounds it as its mean less or plus twice its noise. The noise counts both
    samples, the measurement and the stretch (`sd * sqrt(1/n + 1/compared_over)`); the
    machine's load, changing between the measurements, widens the bound further. Load that
    rose and fell within the stretch is seen only in the delay other processes caused there,
    `other_load_s` per step: each measurement less the delay it saw, plus the stretch's, bounds
    the step alone too, and the estimate is their mean.
    """
    means, noise, loaded = [], [], []
    for measured in measurements:
        times = measured.times_s
        means.append(statistics.fmean(times))
        spread = statistics.stdev(times) if len(times) > 1 else 0.0
        noise.append(2 * spread * (1 / len(times) + 1 / max(compared_over, 1)) ** 0.5)
        loaded.append(max(0.0, means[-1] - measured.other_load_s) + other_load_s)
    low = min(m - n for m, n in zip([*means, *loaded], noise + noise, strict=True))
    high = max(m + n for m, n in zip([*means, *loaded], noise + noise, strict=True))
    return min(max(statistics.fmean(loaded), low), high), max(0.0, low), high


def time_step_alone(run: Callable[[], Any], calls: int, steps_per_call: int = 1) -> StepAlone:
    """The step alone by `run()`: at least `calls` calls and at least `HEADSPACE_MIN_S`, after
    one untimed call that warms up (the first may trace)."""
    finish(run())
    times: list[float] = []
    began, other_load = time.perf_counter(), OtherLoadSpan()
    while len(times) < calls or time.perf_counter() - began < HEADSPACE_MIN_S:
        started = time.perf_counter()
        finish(run())
        times.append((time.perf_counter() - started) / steps_per_call)
    return StepAlone(times, other_load.per_step_s(len(times) * steps_per_call))


def finish(outputs: Any) -> None:
    """Waits until the device has computed a step's outputs, whichever framework made them.

    A JAX array waits for itself. A TensorFlow or PyTorch tensor is read, which waits for the
    ops it depends on: only small ones (the loss, the metrics), as a copy of a large output would
    be timed too (a PyTorch tensor detached first: a loss requires its gradient).
    """
    for leaf in optree.tree_leaves(outputs):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()
        elif hasattr(leaf, "detach") and math.prod(leaf.shape) <= 1024:
            leaf.detach().cpu()
        elif hasattr(leaf, "numpy") and math.prod(leaf.shape) <= 1024:
            leaf.numpy()


class KerasSteps(Protocol):
    """Keras's compiled train function on one backend, as the headspace runs it."""

    def inputs(self, *data: Any, **options: Any) -> Iterator:
        """What `fit` hands the train function for `data` (an input, or `x, y` arrays with
        `batch_size=`), epoch after epoch."""

    def build(self, element: Any) -> None:
        """Builds the model, its loss, metrics and optimizer as `fit` does from `element`."""

    def take(self, iterator: Any, count: int) -> list:
        """Up to `count` elements of an input `fit` made."""

    def feed(self, elements: list) -> Any:
        """`elements` as the train function takes them in place of its input."""

    def resident(self, element: Any) -> Any:
        """An input serving `element` forever, from memory."""

    def detached(self, function: Callable) -> AbstractContextManager[Callable[[Any], Any]]:
        """A call of the train function `function` on an input, training left as it was
        when the context ends."""

    def watch_reads(self) -> Callable[[], float] | None:
        """Called in `on_train_begin` of a running `fit`: None where the train function reads
        its batches itself (its call's time holds the read); else, where `fit` reads them
        before the call (PyTorch), the function telling when the read of the call's batches
        began (`time.perf_counter()`)."""


def backend_steps(user: str) -> type[KerasSteps]:
    """`KerasSteps` for the backend Keras runs on; `user` names the caller in the error for
    any other backend."""
    backend = import_keras(user).backend.backend()
    if backend == "tensorflow":
        from feedpipe.tf.keras_step import TensorFlowSteps

        return TensorFlowSteps
    if backend == "jax":
        from feedpipe.jax.keras_step import JaxSteps

        return JaxSteps
    if backend == "torch":
        from feedpipe.torch.keras_step import TorchSteps

        return TorchSteps
    raise RuntimeError(
        f"{user} needs Keras on TensorFlow, JAX or PyTorch, but Keras runs on {backend!r}; set "
        "KERAS_BACKEND to tensorflow, jax or torch before importing keras."
    )
