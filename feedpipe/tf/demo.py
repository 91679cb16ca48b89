"""The demo on TensorFlow: a Keras MLP under `tf.distribute.MirroredStrategy` (see
`feedpipe.demo` for the story and the report).

Without GPUs the replicas are logical CPU devices, made before TensorFlow initialises.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from feedpipe.core.checks import check_int
from feedpipe.demo import (
    CLASSES,
    DEFAULT_REPLICAS,
    FEATURES,
    HIDDEN_UNITS,
    LEARNING_RATE,
    MOMENTUM,
    SyntheticRecords,
)
from feedpipe.feeder import Feeder


def configure_devices(count: int) -> list[str]:
    """The replica devices: the first `count` GPUs if there are any, else `count` CPU devices.

    Logical CPU devices can only be made before TensorFlow initialises its runtime, so this
    must run before any op; a machine without GPUs then still trains on several replicas.
    """
    check_int("--devices", count, "pass the replicas to train on, e.g. --devices 4")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(min(count, len(gpus)))]
    cpu = tf.config.list_physical_devices("CPU")[0]
    # Raises once TensorFlow is running; then the CPU devices it has are checked below.
    with contextlib.suppress(RuntimeError):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    available = len(tf.config.list_logical_devices("CPU"))
    if available < count:
        raise RuntimeError(
            f"TensorFlow was initialised with {available} CPU device(s) before the demo could "
            f"make {count}; run the demo in a fresh process or pass --devices {available}."
        )
    return [f"/cpu:{i}" for i in range(count)]


def build_model() -> keras.Model:
    """A three-layer MLP whose step outlasts reading its batch, so the input can be hidden."""
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def make_train_step(
    strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.Optimizer
) -> Callable:
    """One compiled step, `step(inputs, mask, num_valid) -> loss`, shared by both runs.

    Each replica sums the loss of its real rows (the mask zeroes padding) and divides by the
    real samples of the whole global batch; the optimizer sums the replicas' gradients, so a
    padded last batch weighs exactly its real samples.
    """
    per_sample_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(inputs, mask, num_valid):
        features, labels = inputs
        with tf.GradientTape() as tape:
            losses = per_sample_loss(labels, model(features, training=True))
            loss = tf.reduce_sum(tf.where(mask, losses, 0.0)) / num_valid
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(inputs, mask, num_valid):
        losses = strategy.run(replica_step, args=(inputs, mask, num_valid))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return step


class Training:
    """The demo's `Training` on TensorFlow: a seeded Keras MLP and SGD with momentum, mirrored
    on `devices` replicas, and its step compiled once with `tf.function`."""

    model = f"{HIDDEN_UNITS}-unit MLP"

    def __init__(self, devices: int | None):
        self.devices = configure_devices(DEFAULT_REPLICAS if devices is None else devices)
        on_gpus = self.devices[0].startswith("/gpu")
        self.on = "GPUs" if on_gpus else "logical CPU devices: no GPU found"
        self.strategy = tf.distribute.MirroredStrategy(self.devices)
        keras.utils.set_random_seed(0)  # the same initial weights, and final loss, every run
        with self.strategy.scope():
            model = build_model()
            optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM)
            # The slots must exist before the step is traced: variables made inside
            # `strategy.run` in a tf.function are not mirrored.
            optimizer.build(model.trainable_variables)
        self._step = make_train_step(self.strategy, model, optimizer)
        self.variables = [*model.variables, *optimizer.variables]
        """Every variable the step trains: the weights and the optimizer's state."""

    def place(self, features: np.ndarray, labels: np.ndarray, real: np.ndarray) -> tuple:
        """Each replica's rows as tensors on its device, as `batch.distributed()` gives them."""
        rows = len(real) // self.strategy.num_replicas_in_sync
        devices = self.strategy.extended.worker_devices

        def place(context):
            i = context.replica_id_in_sync_group
            part = slice(i * rows, (i + 1) * rows)
            with tf.device(devices[i]):
                return (
                    (tf.constant(features[part]), tf.constant(labels[part])),
                    tf.constant(real[part]),
                )

        return self.strategy.experimental_distribute_values_from_function(place)

    def step(self, inputs, mask, num_valid: int) -> float:
        return float(self._step(inputs, mask, tf.constant(num_valid, tf.float32)))

    def snapshot(self) -> Callable[[], None]:
        values = [v.numpy() for v in self.variables]

        def restore() -> None:
            for variable, value in zip(self.variables, values, strict=True):
                variable.assign(value)

        return restore

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to pin: TensorFlow sizes its thread pools once, when it starts."""
        return contextlib.nullcontext()

    def feeder(self, dataset: SyntheticRecords, global_batch_size: int) -> Feeder:
        return Feeder(dataset, global_batch_size, strategy=self.strategy)

    def progress_bar(self, steps: int) -> Callable[[int, float], None]:
        """Keras's bar: live on a terminal; one summary line when the output is a file or a
        pipe."""
        bar = keras.utils.Progbar(steps, verbose=1 if sys.stdout.isatty() else 2)
        return lambda done, loss: bar.update(done, [("loss", loss)])
