"""Sources: what the samples are.

Every input a user already has is adapted to a `Source`, one of two kinds:

* an *indexed* source (`length`, `sample(i)`) reads any sample on demand, so the sampler
  chooses the order: numpy arrays (`arrays`), map-style objects (`map_style`), a
  `keras.utils.PyDataset` (`py_dataset`: its batches, split into rows);
* a *stream* source (`samples(epoch)`, `first_sample()`) yields rows in its own order:
  `from_generator(fn)` (`generator`) and `tf.data.Dataset` (`tf_dataset`);

and a source may make whole batches itself (`producer`: DALI's pipelines).

Each kind's module holds that kind alone, over the base they share (`base`: `Source`, and the
`SampleSpec` that records what a sample is), and says which inputs it reads (`Source.adapts`);
`as_source`, here, asks the kinds in order (`KINDS`). Nothing in the package imports
TensorFlow at module level: worker processes import it.
"""

from __future__ import annotations

from typing import Any

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


KINDS: tuple[type[Source], ...] = (TFDatasetSource, PyDatasetSource, ArraySource, MapSource)
"""The kinds `as_source` asks, in order: the first whose `adapts` accepts the input reads it (a
tuple of arrays is fields, not a sequence of samples)."""


def as_source(data: Any, *, text: bool = False, global_batch_size: int | None = None) -> Source:
    """Adapts what the user passed as `source` to the first kind of `KINDS` that reads it; with
    `text`, arrays may hold strings (file paths that a `transform` reads). `global_batch_size`,
    where given, tells a list of samples from fields passed as a list."""
    if isinstance(data, Source):
        return data  # fp.from_generator(fn), or a DaliSource (see feedpipe.dali)
    for kind in KINDS:
        if kind.adapts(data):
            return kind.adapt(data, text=text, global_batch_size=global_batch_size)
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
