"""The same compiled Keras step on one batch already on its device, leaving training as it was.

`StarvationMonitor` and `diagnose` time a model's own compiled train step on one batch taken
from the real stream: the headspace measurement. These helpers put that batch on the step's
device or serve it again and again from memory, save every variable a step changes and put it
back afterwards, and wait for a step's outputs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from feedpipe.core.stats import verdict
from feedpipe.diagnostics._contention import OtherLoadSpan

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
    `feedpipe.diagnostics._contention`)."""


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


def save_state(model: keras.Model) -> Callable[[], None]:
    """Copies every variable a training step may change to host memory; returns the function
    that puts them back (weights, optimizer slots and counters, metrics, seed states)."""
    variables = _state_variables(model)
    saved = [np.array(variable.numpy(), copy=True) for variable in variables]

    def restore() -> None:
        for variable, value in zip(variables, saved, strict=True):
            variable.assign(value)

    return restore


def _state_variables(model: keras.Model) -> list[tf.Variable]:
    """Every variable a training step may change, as per-device components, each once."""
    optimizer = model.optimizer
    found = [
        *model.variables,
        *(optimizer.variables if optimizer is not None else ()),
        *model.metrics_variables,
    ]
    strategy = model.distribute_strategy
    seen: set[int] = set()
    components = []
    for variable in found:
        backing = variable.value if isinstance(variable, keras.Variable) else variable
        # A mirrored or sync-on-read variable is restored replica by replica, as it was.
        for component in strategy.experimental_local_results(backing):
            if id(component) not in seen:
                seen.add(id(component))
                components.append(component)
    return components


def on_step_device(element: Any, strategy: tf.distribute.Strategy | None = None) -> Any:
    """The element's tensors on the device the step runs on, so that timing it copies nothing.

    Distributed values already sit on their replicas' devices and are kept as they are; so is
    an element for several replicas, which the strategy splits. Without a strategy, or with
    the default one, the step runs on the first GPU if there is one.
    """
    leaves = tf.nest.flatten(element)
    if any(isinstance(leaf, tf.distribute.DistributedValues) for leaf in leaves):
        return element
    try:
        replica_devices = strategy.extended.worker_devices if strategy is not None else ()
    except RuntimeError:  # the default strategy has no worker devices
        replica_devices = ()
    if replica_devices:
        device = replica_devices[0] if len(replica_devices) == 1 else None
    else:
        gpus = tf.config.list_logical_devices("GPU")
        device = gpus[0].name if gpus else None
    if device is None:
        return element
    with tf.device(device):
        return tf.nest.map_structure(
            lambda leaf: tf.identity(leaf) if isinstance(leaf, tf.Tensor) else leaf, element
        )


_INLINE = tf.data.Options()
_INLINE.experimental_optimization.inject_prefetch = False
"""No prefetch thread behind the resident element: handing it over costs the step nothing, on
a busy machine too, where waking a thread can wait for a CPU."""


def resident_iterator(element: Any, strategy: tf.distribute.Strategy) -> Any:
    """An iterator of the kind `model.fit` hands its train function, serving `element` forever.

    The train function then runs exactly the path it runs on the real input (the `get_next`
    inside the compiled step, the outputs wrapped in an Optional), on an input that costs
    nothing to make: one element held in memory. A step timed on it is the step alone as
    `fit` runs it; timed on a plain list instead, a step under a millisecond reads up to a
    quarter faster, and that difference would pass for input wait. A distributed element
    (one part per replica) is served to each replica as its own part.
    """
    leaves = tf.nest.flatten(element)
    if not any(isinstance(leaf, tf.distribute.DistributedValues) for leaf in leaves):
        dataset = tf.data.Dataset.from_tensors(element).repeat().with_options(_INLINE)
        return iter(strategy.experimental_distribute_dataset(dataset))
    parts = [
        tf.nest.map_structure(
            lambda leaf, i=i: strategy.experimental_local_results(leaf)[i], element
        )
        for i in range(len(strategy.experimental_local_results(leaves[0])))
    ]

    def replica_batches(_context: tf.distribute.InputContext) -> tf.data.Dataset:
        # Each replica takes the next element in turn: replica i gets part i.
        dataset = tf.data.Dataset.from_tensors(parts[0])
        for part in parts[1:]:
            dataset = dataset.concatenate(tf.data.Dataset.from_tensors(part))
        return dataset.repeat().with_options(_INLINE)

    return iter(strategy.distribute_datasets_from_function(replica_batches))


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
    """Waits until the device has computed a step's small outputs (its loss, its metrics).

    Reading a value waits for the ops it depends on; large outputs are left unread, as a
    copy of them would be timed too.
    """
    for leaf in tf.nest.flatten(outputs):
        if isinstance(leaf, tf.Tensor | tf.Variable) and leaf.shape.num_elements() <= 1024:
            leaf.numpy()
