"""What Keras's torch trainer reads from a feeder: batches already on its device.

Keras on torch trains on one device (`keras.src.backend.torch.core.get_device()`, the GPU where
there is one) and moves each input there only when it is elsewhere, so the feeder's tensors,
staged on that device, go over as they are; padding rows are weighted zero there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import torch

from feedpipe._internals import keras_torch_device
from feedpipe.core.weights import broadcastable, weighting
from feedpipe.torch.layer import resolve_devices


def _check_device(feeder: Any) -> None:
    """Refuses a feeder whose devices are not the one Keras's step runs on."""
    keras_device = keras_torch_device()
    if keras_device.type == "cuda" and keras_device.index is None:
        keras_device = torch.device("cuda", torch.cuda.current_device())
    if list(feeder.devices) != [keras_device]:
        default = resolve_devices(None) == (keras_device,)
        raise ValueError(
            f"Keras's torch backend trains on {keras_device}, but the feeder stages on "
            f"{list(feeder.devices)}; build it with devices=[torch.device('{keras_device}')]"
            + (" (or none: this process's device)." if default else ".")
        )


def keras_batches(feeder: Any, *, real_only: bool = False) -> Iterator[Any]:
    """The rest of the feeder's current epoch as Keras takes it: `x`, `(x, y)` or
    `(x, y, sample_weight)`; the feeder's next epoch on the next call. With `real_only` (for
    `predict` and `evaluate`), each batch's real rows alone.

    A batch's row weights depend only on its pattern of real rows, so they are made once per
    pattern (the stager's masks are too) and reused; each label field gets its own copy.
    """
    _check_device(feeder)
    o = feeder.options
    how = None if real_only else weighting(feeder.spec, o.remainder, o.errors)
    size = o.global_batch_size
    made: dict[int, tuple[Any, Any]] = {}
    """Per pattern, keyed by its mask (kept, so that the key stays its own): the sample weights
    added to `(x, y)`, or the row weights that scale an `(x, y, w)` source's own."""
    feeder._consumer.end_open_pass()
    for batch in feeder._consumer.iterate(fit=True, host=False):
        inputs, mask = batch.distributed()
        if real_only and batch.num_valid < size:
            # Padding rows come last, but a row errors="skip" left out can be anywhere.
            real = torch.nonzero(mask).flatten()
            inputs = optree.tree_map(lambda t, rows=real: t[rows], inputs)
        if how is None:
            yield inputs
            continue
        key = id(mask)
        if key not in made:
            rows = torch.where(mask, size / batch.num_valid, 0.0).to(torch.float32)
            if how == "add":  # each label field its own copy, of its rank, made once
                rows = optree.tree_map(
                    lambda y, rows=rows: broadcastable(rows, y.ndim).clone(), inputs[1]
                )
            made[key] = (mask, rows)
        weights = made[key][1]
        if how == "add":
            yield (*inputs, weights)
        else:
            x, y, given = inputs
            scaled = given.to(torch.float32) * broadcastable(weights, given.ndim)
            yield x, y, scaled.to(given.dtype)
