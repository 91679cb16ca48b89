"""What Keras's TensorFlow trainer reads from a feeder: a `tf.data.Dataset` of its batches.

Keras's TensorFlow trainer reads a dataset, so it gets `as_dataset()`'s (`feedpipe.tf.feeder`),
read as Keras reads arrays: on one host a padded batch goes over as its real rows alone, with no
added weight; `predict` and `evaluate` read a whole epoch aside; `class_weight` weighs each row
by its class, as Keras weighs arrays (`feedpipe.keras.arguments`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from feedpipe.keras.arguments import ClassWeights


def keras_batches(
    feeder: Any, *, reading: str | None, class_weight: dict | None = None
) -> tf.data.Dataset | tf.distribute.DistributedDataset:
    """The feeder's batches as Keras's TensorFlow trainer takes them, for `reading` ("fit",
    "evaluate", "predict"; see `feedpipe.keras.arguments`)."""
    return feeder._dataset(
        real_only=feeder.share.num_hosts == 1,
        whole=True,
        aside=reading in ("evaluate", "predict"),
        class_weight=class_weight,
    )


def class_weighted(dataset: tf.data.Dataset, class_weight: dict | None) -> tf.data.Dataset:
    """`dataset`, each `(x, y)` element weighted by its rows' classes where `class_weight` is
    given (see `feedpipe.keras.batches`)."""
    if class_weight is None:
        return dataset
    by_class = ClassWeights(class_weight)
    # `map` hands a tuple's fields over one by one, and a namedtuple whole.
    return dataset.map(lambda *fields: by_class.weigh(fields[0] if len(fields) == 1 else fields))
