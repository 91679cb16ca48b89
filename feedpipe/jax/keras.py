"""What Keras's JAX trainer reads from a feeder: global batches already on the devices.

Keras's JAX trainer places a batch itself only when it is not there yet: under
`keras.distribution.DataParallel` it calls `jax.make_array_from_process_local_data` with the
distribution's layout, which on one process is a `device_put` that leaves an array already so
sharded where it is; without a distribution, on a GPU, it `device_put`s one batch ahead on the
default device. So each batch goes over as the feeder's global `jax.Array`s, sharded over its
mesh, and padding rows are weighted zero on the devices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optree

from feedpipe.core.weights import weighting


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


def keras_batches(feeder: Any) -> Iterator[Any]:
    """The rest of the feeder's current epoch as Keras takes it: `x`, `(x, y)` or
    `(x, y, sample_weight)` of global arrays; the feeder's next epoch on the next call."""
    _check_distribution(feeder)
    how = weighting(feeder.spec, feeder.options.remainder)
    size = feeder.options.global_batch_size
    for batch in feeder._iterate(fit=True, host=False, steps=feeder.num_batches):
        inputs, mask = batch.distributed()
        yield _weighted(inputs, mask, batch.num_valid, size, how)


def _weighted(sample: Any, mask: jax.Array, num_valid: int, size: int, how: str | None) -> Any:
    """`sample` with padding weighted zero and real rows `size / num_valid` (see
    `feedpipe.core.weights`), computed on the devices where the rows are."""
    if how is None:
        return sample
    rows = jnp.where(mask, jnp.float32(size / num_valid), jnp.float32(0))

    def shaped(ndim: int) -> jax.Array:
        return rows.reshape(rows.shape + (1,) * (ndim - 1))

    if how == "add":
        return (*sample, optree.tree_map(lambda y: shaped(y.ndim), sample[1]))
    x, y, given = sample
    return x, y, (given.astype(jnp.float32) * shaped(given.ndim)).astype(given.dtype)
