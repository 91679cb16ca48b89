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

import jax.numpy as jnp

from feedpipe.core.weights import added_weights, scaled_weights, weighting


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
    `(x, y, sample_weight)` of global arrays; the feeder's next epoch on the next call.

    A batch's row weights depend only on its pattern of real rows, so they are made on the
    devices once per pattern (the stager's masks are made once per pattern too) and reused.
    """
    _check_distribution(feeder)
    how = weighting(feeder.spec, feeder.options.remainder)
    size = feeder.options.global_batch_size
    made: dict[int, tuple[Any, Any]] = {}
    """Per pattern, keyed by its masks (kept, so that the key stays theirs): rows or weights."""
    feeder._end_open_pass()
    steps = feeder._steps_left() if feeder.share.num_hosts == 1 else None
    for batch in feeder._iterate(fit=True, host=False, steps=steps):
        inputs, mask = batch.distributed()
        if how is None:
            yield inputs
            continue
        key = id(batch.masks)
        if key not in made:
            rows = jnp.where(mask, jnp.float32(size / batch.num_valid), jnp.float32(0))
            made[key] = (batch.masks, added_weights(inputs[1], rows) if how == "add" else rows)
        weights = made[key][1]
        if how == "add":
            yield (*inputs, weights)
        else:
            yield inputs[0], inputs[1], scaled_weights(inputs[2], weights)
