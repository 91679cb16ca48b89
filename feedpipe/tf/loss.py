"""The loss each replica computes: its share of the global batch's mean loss over real samples.

A replica's share is its weighted per-sample losses summed over its real rows and divided by the
real samples of the *whole* global batch, so the replicas' shares add up to the global mean and
padding rows weigh exactly zero (`feedpipe.tf.training` explains why the sum of the replicas'
gradients is then one device's gradient on the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from feedpipe._internals.keras import keras_loss


def per_sample_loss(
    loss: Any, y_true: Any = None, y_pred: Any = None
) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """`loss` as a function returning one value per sample (its reduction turned off).

    Names resolve as in `model.compile`; "crossentropy" picks its kind from a batch's labels
    and predictions, so pass them for it.
    """
    if isinstance(loss, str):
        loss = keras_loss(loss, y_true, y_pred)
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        if config.get("reduction") is not None:
            config["reduction"] = None
            return type(loss).from_config(config)
        return loss
    if callable(loss):
        return loss
    raise TypeError(
        f"`loss` must be a Keras loss, its name, or a callable (y_true, y_pred) -> per-sample "
        f"losses; got {type(loss).__name__}."
    )


def unpack_sample(sample: Any) -> tuple[Any, Any, Any]:
    """`sample` as `(x, y, sample_weight)`, the weight None where it has none."""
    if isinstance(sample, tuple) and len(sample) in (2, 3):
        return (*sample, None) if len(sample) == 2 else sample
    raise ValueError(
        "The trainer needs samples of the form (x, y) or (x, y, sample_weight); the feeder's "
        f"samples are {type(sample).__name__}s. Build the feeder from (x, y) arrays or a source "
        "whose samples are (x, y) tuples."
    )


def replica_loss(
    model: keras.Model,
    loss_fn: Callable,
    sample: Any,
    mask: tf.Tensor,
    num_valid: tf.Tensor,
    num_replicas: int,
) -> tuple[tf.Tensor, Any, Any, tf.Tensor]:
    """One replica's share of the global batch's mean loss, its predictions, labels and weights.

    The share is the replica's weighted per-sample losses summed over its real rows and divided
    by `num_valid`, the real samples of the whole global batch; regularisation losses are split
    evenly, so the replicas' shares add up to exactly the global mean loss.
    """
    x, y, weights = unpack_sample(sample)
    predictions = model(x, training=True)
    rows, out_rows = y.shape[0], tf.nest.flatten(predictions)[0].shape[0]
    if rows is not None and out_rows is not None and rows != out_rows:
        raise ValueError(
            f"The model returned {out_rows} rows of predictions for {rows} rows of labels on "
            "one replica; it must return one prediction per sample (look for a Flatten or "
            "Reshape across the batch axis)."
        )
    losses = loss_fn(y, predictions)
    if losses.shape.rank == 0:
        raise ValueError(
            f"The loss returned a scalar ({losses}), already reduced over the batch; the trainer "
            "needs one loss per sample to weigh padding rows zero. Pass a Keras loss (its "
            "reduction is turned off for you) or a function returning per-sample values."
        )
    if losses.shape.rank > 1:  # per-timestep or per-pixel losses: each sample's mean
        losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
    row_weights = tf.cast(mask, losses.dtype)
    if weights is not None:
        row_weights *= tf.cast(weights, losses.dtype)
    share = tf.reduce_sum(losses * row_weights) / tf.cast(num_valid, losses.dtype)
    if model.losses:
        share += tf.add_n(model.losses) / num_replicas
    return share, predictions, y, row_weights
