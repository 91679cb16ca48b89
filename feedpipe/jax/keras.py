"""What Keras's JAX trainer reads from a feeder: global batches already on the devices.

Keras's JAX trainer places a batch itself only when it is not there yet: under
`keras.distribution.DataParallel` it calls `jax.make_array_from_process_local_data` with the
distribution's layout, which on one process is a `device_put` that leaves an array already so
sharded where it is; without a distribution, on a GPU, it `device_put`s one batch ahead on the
default device. So under a distribution each batch goes over as the feeder's global
`jax.Array`s, sharded over its mesh, and padding rows are weighted zero on the devices.

Without a distribution, Keras hands its step uncommitted arrays (`jax.device_put` of host
arrays); the state the step returns is then uncommitted too, like the metrics' variables Keras
resets as each epoch begins. A committed batch would make the returned state committed, and
`jit` would compile the step again at the start of each later epoch, for the reset variables
alone. So a batch on the default device goes over uncommitted, sharing its buffers: the step
compiles exactly as often as on `fit(x, y)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from feedpipe._internals.jax import uncommitted_jax_array
from feedpipe.core.weights import added_weights, scaled_weights
from feedpipe.keras import batches


def _check_distribution(feeder: Any) -> None:
    """Refuses a feeder whose devices are not the ones Keras's step runs on."""
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        if len(feeder.devices) > 1:
            raise ValueError(
                f"The feeder stages on {len(feeder.devices)} devices, but Keras has no "
                "distribution and trains on one; shard the step over the same devices, "
                "keras.distribution.set_distribution(keras.distribution.DataParallel("
                "devices=jax.devices())), or build the feeder with devices=[jax.devices()[0]]."
            )
        return
    mesh = getattr(distribution, "device_mesh", None)
    theirs = None if mesh is None else list(mesh.backend_mesh.devices.flat)
    ours = list(feeder.layer.mesh.devices.flat)
    if theirs is not None and theirs != ours:
        raise ValueError(
            f"Keras's distribution runs on the devices {theirs}, but the feeder stages on "
            f"{ours}; build the feeder with devices=distribution.device_mesh.backend_mesh."
        )


class _JaxRows:
    """The rows of a feeder's global `jax.Array`s (see `feedpipe.keras.batches.DeviceRows`)."""

    def __init__(self, feeder: Any):
        self.feeder = feeder

    def uneven(self, count: int | None) -> str | None:
        feeder = self.feeder
        if feeder.share.num_hosts > 1:
            return (
                "under jax.distributed each process stages its share of every batch, padding "
                "rows included, and Keras's step takes each share whole"
            )
        if count is None:
            length, size = feeder._assembly.source.length, feeder.options.global_batch_size
            count = length % size if feeder.options.remainder == "pad" and length else 0
        devices = len(feeder.devices)
        if devices > 1 and count % devices:
            return (
                f"a batch holds {count} real samples, which the {devices} devices Keras's step "
                "shards every batch over cannot share evenly"
            )
        return None

    def real(self, batch: Any, mask: Any) -> Any:
        return np.flatnonzero(np.concatenate([np.asarray(m) for m in batch.masks]))

    def weights(self, mask: Any, scale: float) -> Any:
        return jnp.where(mask, jnp.float32(scale), jnp.float32(0))

    added = staticmethod(added_weights)
    scaled = staticmethod(scaled_weights)


def keras_batches(
    feeder: Any, *, reading: str | None, class_weight: dict | None = None
) -> Iterator[Any]:
    """The feeder's batches as Keras's JAX trainer takes them (`feedpipe.keras.batches`), once
    the feeder's devices are found to be the step's, placed as Keras places its own."""
    _check_distribution(feeder)
    taken = batches.keras_batches(
        feeder, _JaxRows(feeder), reading=reading, class_weight=class_weight
    )
    if not _keras_takes_uncommitted(feeder):
        yield from taken
        return
    for inputs in taken:
        yield jax.tree.map(_uncommitted, inputs)


def _keras_takes_uncommitted(feeder: Any) -> bool:
    """Whether Keras, on its own data, would hand its step uncommitted arrays on the feeder's
    device: it has no distribution, the feeder stages on one process and one device, and that
    device is the default one (elsewhere the batch stays committed there, so that the step runs
    where the batch is)."""
    import keras

    if keras.distribution.distribution() is not None:
        return False
    if feeder.share.num_hosts > 1 or len(feeder.devices) != 1:
        return False
    return feeder.devices[0] in jax.device_put(0).devices()


def _uncommitted(leaf: Any) -> Any:
    return uncommitted_jax_array(leaf) if isinstance(leaf, jax.Array) else leaf
