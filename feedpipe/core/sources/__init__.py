"""Sources: what the samples are (`base`)."""

from feedpipe.core.sources.base import (
    ArraySource,
    GeneratorSource,
    LeafSpec,
    MapSource,
    PyDatasetSource,
    SampleSpec,
    Source,
    TFDatasetSource,
    as_array,
    as_source,
    field_name,
    from_generator,
    is_tensor_dtype,
)

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
