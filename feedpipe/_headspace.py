"""The same compiled Keras step on one batch already on its device, leaving training as it was.

`StarvationMonitor` and `diagnose` time a model's own compiled train step on one batch taken
from the real stream: the headspace measurement. These helpers put that batch on the step's
device, save every variable a step changes and put it back afterwards, and wait for a step's
outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf


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


def finish(outputs: Any) -> None:
    """Waits until the device has computed a step's small outputs (its loss, its metrics).

    Reading a value waits for the ops it depends on; large outputs are left unread, as a
    copy of them would be timed too.
    """
    for leaf in tf.nest.flatten(outputs):
        if isinstance(leaf, tf.Tensor | tf.Variable) and leaf.shape.num_elements() <= 1024:
            leaf.numpy()
