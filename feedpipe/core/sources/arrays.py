"""Arrays: samples that are the rows of numpy arrays in memory, read with no copy but the one
into a slot (`take`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optree

from feedpipe.core.sources.base import (
    Source,
    field_name,
    is_instance_of_loaded,
    is_tensor_dtype,
    refuse_empty,
)


class ArraySource(Source):
    """Samples are rows of numpy arrays (one array, or a tuple/dict of equal-length arrays).
    With `text`, arrays of strings too, for a `transform` to read (file paths); what it returns
    is what reaches a slot."""

    indexed = True

    @classmethod
    def adapts(cls, data: Any) -> bool:
        return isinstance(data, np.ndarray | tuple | dict) or is_instance_of_loaded(
            data, "tensorflow", "Tensor"
        )

    @classmethod
    def adapt(cls, data: Any, *, text: bool, global_batch_size: int | None) -> ArraySource:
        return cls(data, text=text)

    def __init__(self, data: Any, *, text: bool = False):
        paths, nodes, _ = optree.tree_flatten_with_path(data, is_leaf=_is_list)
        for path, leaf in zip(paths, nodes, strict=True):
            if isinstance(leaf, list):
                raise TypeError(
                    f"Field {field_name(path)} of `source` is a list of {len(leaf)} items; a "
                    "field is one array whose first dimension counts the samples: stack them "
                    "(np.stack(images)), or pass a list of samples (list(zip(images, labels)))."
                )
        paths, leaves, self.treespec = optree.tree_flatten_with_path(data)
        self.arrays = [np.asarray(leaf) for leaf in leaves]
        for path, array in zip(paths, self.arrays, strict=True):
            strings = text and array.dtype.kind in "SU"
            if array.ndim == 0:
                raise ValueError(
                    f"Field {field_name(path)} of `source` is a scalar ({array!r}); every array "
                    "needs a first dimension that counts samples."
                )
            if not is_tensor_dtype(array.dtype) and not strings:
                # Rows are gathered with no per-sample check, so an object array would be cast
                # silently (1.7 becomes 1 when the first row is an int): refuse it up front.
                raise TypeError(
                    f"Field {field_name(path)} of `source` has dtype {array.dtype}, which cannot "
                    "be staged as a numeric tensor; convert it first (for example "
                    "np.asarray(x, dtype=np.float32), or strings to integer ids) or drop it."
                )
        lengths = {field_name(p): len(a) for p, a in zip(paths, self.arrays, strict=True)}
        if len(set(lengths.values())) > 1:
            listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
            raise ValueError(
                f"The arrays of `source` have unequal lengths ({listed}); give every array the "
                "same number of samples along its first dimension."
            )
        self.length = len(self.arrays[0])
        refuse_empty(self.length)

    def sample(self, index: int) -> Any:
        return optree.tree_unflatten(self.treespec, [array[index] for array in self.arrays])

    def take(self, indices: np.ndarray, outs: Sequence[np.ndarray]) -> None:
        """Gathers the rows `indices` of every array into `outs` with one copy each."""
        for array, out in zip(self.arrays, outs, strict=True):
            # mode="clip" lets numpy write straight into `out`; the sampler's indices are valid.
            np.take(array, indices, axis=0, out=out, mode="clip")

    def __repr__(self) -> str:
        return f"ArraySource(length={self.length}, fields={len(self.arrays)})"


def _is_list(node: Any) -> bool:
    return isinstance(node, list)
