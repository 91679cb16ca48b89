"""Sources: what the samples are.

Every input a user already has is adapted to a `Source`, one of two kinds:

* an *indexed* source (`length`, `sample(i)`) reads any sample on demand, so the sampler
  chooses the order: numpy arrays (`arrays`), map-style objects (`map_style`), a
  `keras.utils.PyDataset` (`py_dataset`: its batches, split into rows);
* a *stream* source (`samples(epoch)`, `first_sample()`) yields rows in its own order:
  `from_generator(fn)` (`generator`) and `tf.data.Dataset` (`tf_dataset`);

and a source may make whole batches itself (`producer`: DALI's pipelines).

Each kind's module holds that kind alone, over the base they share (`base`: `Source`, and the
`SampleSpec` that records what a sample is); `as_source`, here, is the one place that tells the
kinds apart. Nothing in the package imports TensorFlow at module level: worker processes
import it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from feedpipe.core.sources.arrays import ArraySource
from feedpipe.core.sources.base import (
    LeafSpec,
    SampleSpec,
    Source,
    as_array,
    field_name,
    is_tensor_dtype,
)
from feedpipe.core.sources.generator import GeneratorSource, from_generator
from feedpipe.core.sources.map_style import MapSource
from feedpipe.core.sources.py_dataset import PyDatasetSource
from feedpipe.core.sources.tf_dataset import TFDatasetSource

__all__ = [
    "ArraySource",
    "GeneratorSource",
    "LeafSpec",
    "MapSource",
    "PyDatasetSource",
    "SampleSpec",
    "Source",
    "TFDatasetSource",
    "as_array",
    "as_source",
    "field_name",
    "from_generator",
    "is_tensor_dtype",
]


def _is_instance_of_loaded(obj: Any, module: str, path: str) -> bool:
    """isinstance against a class of `module`, without importing it when it is not loaded yet."""
    root = sys.modules.get(module)
    if root is None:
        return False
    cls: Any = root
    for part in path.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            return False
    return isinstance(obj, cls)


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


def as_source(data: Any, *, text: bool = False, global_batch_size: int | None = None) -> Source:
    """Adapts what the user passed as `source` to the matching source class; with `text`,
    arrays may hold strings (file paths that a `transform` reads). `global_batch_size`, where
    given, tells a list of samples from fields passed as a list."""
    if isinstance(data, Source):
        return data  # fp.from_generator(fn), or a DaliSource (see feedpipe.dali)
    if _is_instance_of_loaded(data, "tensorflow", "data.Dataset"):
        return TFDatasetSource(data)
    if _is_instance_of_loaded(data, "keras", "utils.PyDataset"):
        return PyDatasetSource(data)
    if isinstance(data, np.ndarray | tuple | dict) or _is_instance_of_loaded(
        data, "tensorflow", "Tensor"
    ):
        return ArraySource(data, text=text)
    if isinstance(data, list):
        _check_list_of_samples(data, global_batch_size)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return MapSource(data)
    if callable(data) or hasattr(data, "__next__"):
        raise TypeError(
            f"`source` is a {type(data).__name__}; wrap a generator function as "
            "fp.from_generator(fn), where fn(shard, num_shards) yields samples."
        )
    raise TypeError(
        f"`source` of type {type(data).__name__} is not supported; pass numpy arrays (an "
        "array, tuple or dict of equal-length arrays), an object with __len__ and "
        "__getitem__, a keras.utils.PyDataset, fp.from_generator(fn) or a tf.data.Dataset."
    )
