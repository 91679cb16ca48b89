"""The demo on JAX: an MLP in `jax.numpy`, its SGD step jitted once and data-parallel over the
devices (see `feedpipe.demo` for the story and the report).

The parameters are replicated and each global batch is sharded along axis 0, so XLA runs
each replica's rows on its device and sums the gradients across them. Without an accelerator
the replicas are logical CPU devices, made by `XLA_FLAGS` before JAX starts its CPU backend.
Neither TensorFlow nor Keras is imported.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from feedpipe.core.checks import check_int
from feedpipe.demo import (
    CLASSES,
    DEFAULT_REPLICAS,
    FEATURES,
    HIDDEN_UNITS,
    LEARNING_RATE,
    MOMENTUM,
    SyntheticRecords,
    progress_line,
)
from feedpipe.feeder import Feeder
from feedpipe.jax.devices import BATCH_AXIS

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def configure_devices(count: int) -> list[jax.Device]:
    """The replica devices: the first `count` GPUs or TPUs if there are any, else `count` CPU
    devices.

    JAX makes its CPU devices once, when its backend starts, from `XLA_FLAGS`; this sets the
    flag (unless the user did) before asking for the devices, so it must run before any JAX
    computation.
    """
    check_int("--devices", count, "pass the replicas to train on, e.g. --devices 4")
    flags = os.environ.get("XLA_FLAGS", "")
    if HOST_DEVICES_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={count}".strip()
    found = jax.devices()
    if found[0].platform == "cpu" and len(found) < count:
        raise RuntimeError(
            f"JAX was started with {len(found)} CPU device(s) before the demo could make "
            f"{count}; run the demo in a fresh process or pass --devices {len(found)}."
        )
    return found[:count]


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    """Glorot-uniform weights and zero biases, as Keras's `Dense` starts."""
    sizes = [FEATURES, HIDDEN_UNITS, HIDDEN_UNITS, CLASSES]
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        key, layer_key = jax.random.split(key)
        limit = np.sqrt(6 / (fan_in + fan_out))
        params[f"w{i}"] = jax.random.uniform(
            layer_key, (fan_in, fan_out), jnp.float32, -limit, limit
        )
        params[f"b{i}"] = jnp.zeros(fan_out, jnp.float32)
    return params


def logits_of(params: dict[str, jax.Array], features: jax.Array) -> jax.Array:
    """A three-layer MLP whose step outlasts reading its batch, so the input can be hidden."""
    hidden = jax.nn.relu(features @ params["w0"] + params["b0"])
    hidden = jax.nn.relu(hidden @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def masked_mean_loss(params, features, labels, mask, num_valid) -> jax.Array:
    """Cross-entropy summed over the real rows (the mask zeroes padding) and divided by the
    real samples, so a padded last batch weighs exactly its real samples."""
    log_probs = jax.nn.log_softmax(logits_of(params, features))
    losses = -jnp.take_along_axis(log_probs, labels[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(mask, losses, 0.0)) / num_valid


@jax.jit
def train_step(params, velocity, inputs, mask, num_valid):
    """One SGD step with momentum; returns the new parameters, velocity and the loss."""
    features, labels = inputs
    loss, grads = jax.value_and_grad(masked_mean_loss)(params, features, labels, mask, num_valid)
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v - LEARNING_RATE * g, velocity, grads)
    params = jax.tree.map(jnp.add, params, velocity)
    return params, velocity, loss


class Training:
    """The demo's `Training` on JAX: the MLP's parameters replicated on `devices` replicas,
    every global batch sharded over them along axis 0, as the feeder shards its batches."""

    model = f"{HIDDEN_UNITS}-unit MLP in JAX"

    def __init__(self, devices: int | None):
        replicas = configure_devices(DEFAULT_REPLICAS if devices is None else devices)
        self.devices = [str(d) for d in replicas]
        platform = replicas[0].platform
        self.on = (
            "logical CPU devices: no GPU or TPU found"
            if platform == "cpu"
            else f"{platform.upper()}s"
        )
        self._replicas = replicas
        mesh = Mesh(np.array(replicas), (BATCH_AXIS,))
        self.sharding = NamedSharding(mesh, PartitionSpec((BATCH_AXIS,)))
        """The global batch's: axis 0 over the replicas in order, as the feeder's."""
        replicated = NamedSharding(mesh, PartitionSpec())
        params = init_params(jax.random.key(0))
        self.params = jax.device_put(params, replicated)
        self.velocity = jax.device_put(jax.tree.map(jnp.zeros_like, params), replicated)

    def place(self, features: np.ndarray, labels: np.ndarray, real: np.ndarray) -> tuple:
        """The global batch sharded over the replicas, as `batch.distributed()` gives it."""
        placed = jax.device_put(((features, labels), real), self.sharding)
        return jax.block_until_ready(placed)

    def step(self, inputs, mask, num_valid: int) -> float:
        self.params, self.velocity, loss = train_step(
            self.params, self.velocity, inputs, mask, np.float32(num_valid)
        )
        return float(loss)

    def snapshot(self) -> Callable[[], None]:
        # JAX arrays are immutable: keeping the references keeps the values.
        params, velocity = self.params, self.velocity

        def restore() -> None:
            self.params, self.velocity = params, velocity

        return restore

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to pin: XLA sizes its CPU thread pool once, when its backend starts."""
        return contextlib.nullcontext()

    def feeder(self, dataset: SyntheticRecords, global_batch_size: int) -> Feeder:
        return Feeder(dataset, global_batch_size, devices=self._replicas)

    def progress_bar(self, steps: int) -> Callable[[int, float], None]:
        return progress_line(steps)
