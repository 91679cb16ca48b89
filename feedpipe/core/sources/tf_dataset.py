"""`tf.data.Dataset`: a stream of samples in the dataset's own order, read in blocks that
tf.data batches. TensorFlow is imported inside, where a dataset is given."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import optree

from feedpipe.core.sources.base import Source, field_name, is_instance_of_loaded


class TFDatasetSource(Source):
    """Samples are the elements of a `tf.data.Dataset`, read in blocks batched by TensorFlow."""

    @classmethod
    def adapts(cls, data: Any) -> bool:
        return is_instance_of_loaded(data, "tensorflow", "data.Dataset")

    def __init__(self, dataset: Any):
        import tensorflow as tf

        cardinality = int(dataset.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "`source` is an infinite tf.data.Dataset; an epoch must end: use "
                "dataset.take(n) for n samples per epoch."
            )
        if cardinality == 0:
            raise ValueError("The dataset is empty: the tf.data.Dataset has 0 elements.")
        self.length = cardinality if cardinality > 0 else None
        self.dataset = dataset
        paths, specs, _ = optree.tree_flatten_with_path(dataset.element_spec)
        for path, spec in zip(paths, specs, strict=True):
            if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
                raise ValueError(
                    f"Field {field_name(path)} of the tf.data.Dataset's elements is {spec}; the "
                    "feeder needs tensors of one fixed shape (pad or resize them in dataset.map)."
                )

    def samples(self, epoch: int) -> Iterator[Any]:
        del epoch  # tf.data decides its own order (shuffle inside the dataset)
        return self.dataset.as_numpy_iterator()

    def check_resumable(self, skipped: int) -> None:
        """Refuses to resume mid-epoch where a new iteration would reorder the samples."""
        from feedpipe._internals.tf import unseeded_or_reshuffling

        why = unseeded_or_reshuffling(self.dataset)
        if why is not None:
            raise ValueError(
                f"Cannot restore mid-epoch: the tf.data.Dataset source shuffles {why}, so a new "
                "iteration does not repeat the order being resumed, and skipping the "
                f"{skipped} samples already taken would deliver some twice and others never. "
                "Shuffle with a seed and reshuffle_each_iteration=False, or give the feeder an "
                "indexed source (arrays, a map-style object) with shuffle=True, or restore a "
                "state taken at an epoch's end."
            )

    def blocks(self, rows: int) -> Iterator[list[np.ndarray]]:
        """Blocks of up to `rows` samples, batched by tf.data itself."""
        for block in self.dataset.batch(rows).prefetch(2):
            yield [np.asarray(leaf) for leaf in optree.tree_leaves(block)]

    def first_sample(self) -> Any:
        for sample in self.samples(0):
            return sample
        raise ValueError("The dataset is empty: the tf.data.Dataset yielded no element.")

    def __repr__(self) -> str:
        return f"TFDatasetSource(length={self.length})"
