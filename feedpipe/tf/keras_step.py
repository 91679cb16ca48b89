"""Keras's compiled train step on TensorFlow, as the headspace measurement runs it.

On TensorFlow, `model.train_function(iterator)` reads its batches inside the compiled step,
from the distributed iterator `fit` makes of its input. The headspace serves one batch again
and again through that same compiled input path, and puts back every variable the steps
changed: training has no functional state to set aside.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from feedpipe._internals.keras import build_for_batch, keras_dataset

_INLINE = tf.data.Options()
_INLINE.experimental_optimization.inject_prefetch = False
"""No prefetch thread behind the resident element: handing it over costs the step nothing, on
a busy machine too, where waking a thread can wait for a CPU."""


class TensorFlowSteps:
    """The train function of `model` on TensorFlow (a `diagnostics._headspace.KerasSteps`)."""

    def __init__(self, model: keras.Model):
        self.model = model

    def inputs(self, *data: Any, **options: Any) -> Iterator:
        """What `fit` hands the train function for `data`, epoch after epoch: the distributed
        iterator of the dataset Keras's own adapter makes (a feeder's `as_dataset()`)."""
        from feedpipe.feeder import Feeder

        (source, *_) = data
        if len(data) == 1 and isinstance(source, Feeder):
            dataset = source.as_dataset().repeat()
        elif len(data) == 1 and isinstance(source, tf.data.Dataset):
            dataset = source.repeat()
        elif len(data) == 1 and not options:
            # A generator or PyDataset is read for one pass: Keras would replay the batches it
            # peeked at if it were repeated.
            dataset = keras_dataset(source)
        else:
            dataset = keras_dataset(*data, **options).repeat()
        return iter(self.model.distribute_strategy.experimental_distribute_dataset(dataset))

    def build(self, element: Any) -> None:
        build_for_batch(self.model, element)

    def take(self, iterator: Any, count: int) -> list:
        """Up to `count` elements of a distributed iterator, without its end raising."""
        if not hasattr(iterator, "get_next_as_optional"):
            return list(itertools.islice(iterator, count))
        elements = []
        for _ in range(count):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                break
            elements.append(optional.get_value())
        return elements

    def feed(self, elements: list) -> Any:
        """`elements` as the train function takes them in place of its iterator: Keras's
        compiled step for data that is not a `tf.data` iterator takes a list."""
        return elements

    def resident(self, element: Any) -> Any:
        """An iterator of the kind `model.fit` hands its train function, serving `element`
        forever.

        The train function then runs exactly the path it runs on the real input (the
        `get_next` inside the compiled step, the outputs wrapped in an Optional), on an input
        that costs nothing to make. Timed on a plain list instead, a step under a millisecond
        reads up to a quarter faster, and that difference would pass for input wait. A
        distributed element (one part per replica) is served to each replica as its own part.
        """
        strategy = self.model.distribute_strategy
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

    def watch_reads(self) -> None:
        """None: the train function reads its batches itself, inside the call."""

    @contextlib.contextmanager
    def detached(self, function: Callable) -> Iterator[Callable[[Any], Any]]:
        """`function` to call on an input, every variable it changes put back afterwards."""
        restore = save_state(self.model)
        try:
            yield function
        finally:
            restore()


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
