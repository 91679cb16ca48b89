"""Weights: how padding rows are kept out of a Keras loss, for every framework.

Keras weighs each row of `(x, y)` or `(x, y, w)` by its sample weight. A padded batch gets a
weight of 0 on its padding rows and `global_batch_size / num_valid` on its real ones, so the
batch's mean loss is the mean over its real samples (an `(x, y, w)` source has its own weights
scaled the same way).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

from feedpipe.core.sources import SampleSpec


def weighting(spec: SampleSpec, remainder: str, errors: str = "raise") -> str | None:
    """How padding is weighted: "add" a sample weight to `(x, y)`, "scale" the `w` of
    `(x, y, w)`, or None (nothing to weigh, or no padding: `remainder` pads the last batch,
    and `errors="skip"` turns a failing sample's row into padding in any batch)."""
    pads = remainder == "pad" or errors == "skip"
    return {2: "add", 3: "scale"}.get(labelled(spec.treespec)) if pads else None


def labelled(treespec: Any) -> int | None:
    """How many fields a sample of `treespec` gives Keras, where it is `(x, y)` or
    `(x, y, sample_weight)` (a tuple, a list or a namedtuple, as Keras unpacks them)."""
    kinds = (optree.PyTreeKind.TUPLE, optree.PyTreeKind.LIST, optree.PyTreeKind.NAMEDTUPLE)
    if treespec.kind in kinds and treespec.num_children in (2, 3):
        return treespec.num_children
    return None


def row_weights(num_rows: int, real: Any, num_valid: int, global_batch_size: int) -> np.ndarray:
    """One float32 weight per row: `global_batch_size / num_valid` on the `real` rows (a slice,
    indices or a boolean mask), 0 on the others. Fresh memory every call: a framework may take
    an array over without a copy and later write into it."""
    rows = np.zeros(num_rows, np.float32)
    rows[real] = global_batch_size / num_valid
    return rows


def broadcastable(rows: np.ndarray, ndim: int) -> np.ndarray:
    """One weight per row, shaped `[batch, 1, ..., 1]` to the rank `ndim` of a label field, so
    it broadcasts against per-element losses (per pixel, per timestep) as well."""
    return rows.reshape(rows.shape + (1,) * (ndim - 1))


def added_weights(labels: Any, rows: Any) -> Any:
    """The sample weights for `labels` (one per label field, of its rank): each its own copy
    of `rows`, since a framework may take an array over and later write into its memory."""
    return optree.tree_map(lambda y: broadcastable(rows, y.ndim).copy(), labels)


def scaled_weights(given: Any, rows: Any) -> Any:
    """The weights `given` by an `(x, y, w)` source, scaled by `rows`, in their own dtype."""
    return (given.astype(np.float32) * broadcastable(rows, given.ndim)).astype(given.dtype)


def with_weights(sample: Any, rows: Any, how: str | None) -> Any:
    """`sample` with its padding weighted by `rows` (numpy or a framework's arrays, as long as
    they are the sample's), as `weighting` said."""
    if how is None:
        return sample
    if how == "add":
        return (*sample, added_weights(sample[1], rows))
    x, y, given = sample
    return x, y, scaled_weights(given, rows)
