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
import numpy as np
import optree

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


def _check_real_rows_divide(feeder: Any, count: int | None) -> None:
    """Refuses to predict or evaluate a batch of `count` real rows (None: the epoch's last,
    where the length is known) that cannot be sharded evenly over the feeder's devices, as
    Keras's step shards every batch."""
    length, size = feeder._assembly.source.length, feeder.options.global_batch_size
    if count is None:
        count = length % size if feeder.options.remainder == "pad" and length else 0
    devices = len(feeder.devices)
    if feeder.share.num_hosts > 1 or (devices > 1 and count % devices):
        raise ValueError(
            f"model.predict(feeder) and model.evaluate(feeder) read each real sample once, but "
            f"the epoch's last batch holds {count} real samples, which the {devices} devices "
            "Keras's step shards every batch over cannot share evenly (and its padding rows "
            "would be predicted, and counted by every metric, as samples). Predict and "
            "evaluate on one device: keras.distribution.set_distribution(None) and a feeder "
            "built with devices=[jax.devices()[0]]."
        )


def keras_batches(feeder: Any, *, real_only: bool = False) -> Iterator[Any]:
    """The rest of the feeder's current epoch as Keras takes it: `x`, `(x, y)` or
    `(x, y, sample_weight)` of global arrays; the feeder's next epoch on the next call. With
    `real_only` (for `predict` and `evaluate`), each batch's real rows alone, as the source
    gives them.

    A batch's row weights depend only on its pattern of real rows, so they are made on the
    devices once per pattern (the stager's masks are made once per pattern too) and reused.
    """
    _check_distribution(feeder)
    if real_only:
        _check_real_rows_divide(feeder, None)
    o = feeder.options
    how = None if real_only else weighting(feeder.spec, o.remainder, o.errors)
    size = feeder.options.global_batch_size
    made: dict[int, tuple[Any, Any]] = {}
    """Per pattern, keyed by its masks (kept, so that the key stays theirs): rows or weights."""
    feeder._consumer.end_open_pass()
    for batch in feeder._consumer.iterate(fit=True, host=False):
        inputs, mask = batch.distributed()
        if real_only and batch.num_valid < size:
            _check_real_rows_divide(feeder, batch.num_valid)
            # Padding rows come last, but a row errors="skip" left out can be anywhere.
            real = np.flatnonzero(np.concatenate([np.asarray(m) for m in batch.masks]))
            inputs = optree.tree_map(lambda a, rows=real: a[rows], inputs)
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
