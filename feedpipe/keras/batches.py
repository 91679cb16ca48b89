"""Batches: what Keras's JAX and torch trainers read from a feeder, already on the devices.

Each batch as Keras takes it from arrays: a batch with padding rows is handed over as its
real rows alone, a smaller batch, as `fit(x, y)` hands over its last one, so that the loss,
its reduction, the metrics, BatchNormalization's statistics and History see exactly the
samples they would see there. Where the devices may not take the smaller batch (Keras's step
shards every batch evenly over several devices), training gets padded batches with their
padding rows weighted zero instead (`feedpipe.core.weights`, made on the devices once per
pattern of real rows; every batch of such a pass carries weights, since Keras's step keeps
the structure of its first batch), with a warning that says what differs; `predict` and
`evaluate` refuse them. `class_weight` adds its weights as Keras adds them to arrays
(`feedpipe.keras.arguments`). `predict` and `evaluate` read a whole epoch aside: the feeder's
position, and so its state, stays where training left it. The rule is written here once;
each framework gives its array operations (`DeviceRows`). TensorFlow's trainer reads a
`tf.data.Dataset` of the same batches instead (`feedpipe.tf.keras`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import optree

from feedpipe.core.weights import weighting
from feedpipe.keras.arguments import ClassWeights


class DeviceRows(Protocol):
    """A framework's operations on the rows of a staged batch, on its devices."""

    def uneven(self, count: int | None) -> str | None:
        """Why a batch of `count` real rows (None: the epoch's last) cannot go to Keras as a
        smaller batch, or None where it can."""

    def real(self, batch: Any, mask: Any) -> Any:
        """The indices of `batch`'s real rows (padding rows come last, but a row that
        `errors="skip"` left out can be anywhere)."""

    def weights(self, mask: Any, scale: float) -> Any:
        """One float32 weight per row: `scale` where `mask` marks a real row, else 0."""

    def added(self, labels: Any, rows: Any) -> Any:
        """The sample weights for `labels`, one per label field of its rank, each its own copy
        of `rows`."""

    def scaled(self, given: Any, rows: Any) -> Any:
        """The weights of an `(x, y, w)` source scaled by `rows`, in their own dtype."""


def keras_batches(
    feeder: Any, rows: DeviceRows, *, reading: str | None, class_weight: dict | None = None
) -> Iterator[Any]:
    """The rest of the feeder's current epoch as Keras's `reading` ("fit", "evaluate",
    "predict") takes it; the feeder's next epoch on the next call. To `evaluate` and
    `predict`, a whole epoch read aside (see `Consumer.iterate`)."""
    aside = reading in ("evaluate", "predict")
    if aside:
        reason = rows.uneven(None)
        if reason is not None:
            raise ValueError(_refusal(reason))
    o = feeder.options
    how = weighting(feeder.spec, o.remainder, o.errors)
    size = o.global_batch_size
    # Keras's step keeps the structure of the first batch it takes, so where a batch may have to
    # keep its padding, every batch of the pass carries weights (1 on the real rows of a full one).
    padded = not aside and _may_keep_padding(rows, o.errors)
    weighted = padded and how is not None
    made: dict[int, tuple[Any, Any]] = {}
    """Per pattern, keyed by its mask (kept, so that the key stays its own): the sample weights
    added to `(x, y)`, or the row weights that scale an `(x, y, w)` source's own."""
    warned = False
    by_class = None if class_weight is None else ClassWeights(class_weight)
    feeder._consumer.end_open_pass()
    for batch in feeder._consumer.iterate("aside" if aside else "fit", host=False):
        inputs, mask = batch.distributed()
        if batch.num_valid < size:
            reason = rows.uneven(batch.num_valid)
            if reason is None and not padded:
                real = rows.real(batch, mask)
                inputs = optree.tree_map(lambda a, real=real: a[real], inputs)
            elif aside:
                raise ValueError(_refusal(reason))
            elif not warned:
                warned = True
                warnings.warn(_padded_warning(reason or _MAY_KEEP, how), stacklevel=2)
        if weighted:
            if id(mask) not in made:
                weights = rows.weights(mask, size / batch.num_valid)
                made[id(mask)] = (mask, rows.added(inputs[1], weights) if how == "add" else weights)
            weights = made[id(mask)][1]
            if how == "add":
                inputs = (*inputs, weights)
            else:
                inputs = (inputs[0], inputs[1], rows.scaled(inputs[2], weights))
        if by_class is not None:
            inputs = by_class.weigh(inputs)
        yield inputs


_MAY_KEEP = "a skipped sample can leave a batch whose real rows the devices cannot share evenly"


def _may_keep_padding(rows: DeviceRows, errors: str) -> bool:
    """Whether a batch of the pass may have to keep its padding: the epoch's last cannot go as
    its real rows alone, or, where `errors="skip"` leaves a batch any count of real rows, some
    count cannot (a single row cannot wherever several devices or hosts share each batch)."""
    return rows.uneven(None) is not None or (errors == "skip" and rows.uneven(1) is not None)


def _refusal(reason: str) -> str:
    return (
        f"model.predict(feeder) and model.evaluate(feeder) read each real sample once, but "
        f"{reason} (and its padding rows would be predicted, and counted by every metric, as "
        "samples). Predict and evaluate on one device: on JAX, "
        "keras.distribution.set_distribution(None) and a feeder built with "
        "devices=[jax.devices()[0]]."
    )


def _padded_warning(reason: str, how: str | None) -> str:
    weighted = (
        "its padding rows weighted zero and its real rows weighted global_batch_size / "
        "num_valid, so a mean loss is the mean over its real rows; but BatchNormalization's "
        "batch statistics count the padding rows, a loss with reduction='sum' and History's "
        "loss weigh that batch as a full one, weighted_metrics count its real rows "
        "global_batch_size / num_valid times each, and compiled metrics count its padding rows"
        if how is not None
        else "with nothing to weigh its padding rows by (the samples are not (x, y) or "
        "(x, y, sample_weight)), so they train as samples"
    )
    return (
        f"model.fit(feeder): {reason}, so that batch trains at full size, {weighted}. For a "
        "fit that equals fit(x, y), pick a global_batch_size whose last batch divides "
        "among the devices, or remainder='drop'."
    )
