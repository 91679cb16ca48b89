"""Map-style objects: samples read one at a time from anything with `__len__` and
`__getitem__(i)`."""

from __future__ import annotations

from typing import Any

import numpy as np

from feedpipe.core.sources.base import Source, refuse_empty


class MapSource(Source):
    """Samples come from an object with `__len__` and `__getitem__(i)` returning one sample."""

    indexed = True

    @classmethod
    def adapts(cls, data: Any) -> bool:
        return hasattr(data, "__len__") and hasattr(data, "__getitem__")

    @classmethod
    def adapt(cls, data: Any, *, text: bool, global_batch_size: int | None) -> MapSource:
        if isinstance(data, list):
            _check_list_of_samples(data, global_batch_size)
        return cls(data)

    def __init__(self, data: Any):
        self.data = data
        self.length = len(data)
        refuse_empty(self.length)

    def sample(self, index: int) -> Any:
        return self.data[index]

    def __repr__(self) -> str:
        return f"MapSource({type(self.data).__name__}, length={self.length})"


def _check_list_of_samples(data: list, global_batch_size: int | None) -> None:
    """A list is read as samples; arrays in one are fields, passed as a list where a tuple was
    meant (`fp.Feeder([x, y], ...)`), where their shapes differ (say so before sample 1 fails),
    or where they are fewer than `global_batch_size` and each counts more rows than the list
    has items (`[x, y_onehot]`, both (1000, 10): 2 samples, each batch nearly all padding)."""
    if len(data) < 2 or not all(isinstance(item, np.ndarray) for item in data):
        return
    shapes = [item.shape for item in data]
    if len(set(shapes)) > 1:
        listed = ", ".join(str(shape) for shape in shapes[:4]) + (", ..." if len(data) > 4 else "")
        raise ValueError(
            f"`source` is a list, which is read as samples (sample i is source[i]), but its "
            f"{len(data)} items are arrays of different shapes ({listed}): fields, it seems. "
            "Pass fields as a tuple of equal-length arrays, fp.Feeder((x, y), ...), whose "
            "sample i is (x[i], y[i]); a list of samples needs samples of one shape."
        )
    shape, count = shapes[0], len(data)
    if global_batch_size is None or count >= global_batch_size or not shape or shape[0] <= count:
        return
    raise ValueError(
        f"`source` is a list of {count} arrays of shape {shape}, which is read as {count} "
        f"samples, fewer than `global_batch_size`={global_batch_size}: every batch would be "
        f"mostly padding. They look like fields of {shape[0]} samples: pass fields as a tuple, "
        f"fp.Feeder((x, y), {global_batch_size}), whose sample i is (x[i], y[i]). If they are "
        f"{count} samples, stack them, fp.Feeder(np.stack(samples), ...), with a global batch "
        f"of at most {count}."
    )
