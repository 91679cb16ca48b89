"""Batches: what Keras's JAX and torch trainers read from a feeder, already on the devices.

Each batch as Keras takes it: `x`, `(x, y)` or `(x, y, sample_weight)`, its padding rows
weighted zero (`feedpipe.core.weights`), or, for `predict` and `evaluate`, its real rows alone.
A batch's weights depend only on its pattern of real rows, so they are made on the devices once
per pattern (as the stager's masks are) and reused. The rule is written here once; each
framework gives its array operations (`DeviceRows`). TensorFlow's trainer reads
`feeder.as_dataset()` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import optree

from feedpipe.core.weights import weighting


class DeviceRows(Protocol):
    """A framework's operations on the rows of a staged batch, on its devices."""

    def real(self, batch: Any, mask: Any) -> Any:
        """The indices of `batch`'s real rows (padding rows come last, but a row that
        `errors="skip"` left out can be anywhere); refuses a batch Keras cannot take so."""

    def weights(self, mask: Any, scale: float) -> Any:
        """One float32 weight per row: `scale` where `mask` marks a real row, else 0."""

    def added(self, labels: Any, rows: Any) -> Any:
        """The sample weights for `labels`, one per label field of its rank, each its own copy
        of `rows`."""

    def scaled(self, given: Any, rows: Any) -> Any:
        """The weights of an `(x, y, w)` source scaled by `rows`, in their own dtype."""


def keras_batches(feeder: Any, rows: DeviceRows, *, real_only: bool = False) -> Iterator[Any]:
    """The rest of the feeder's current epoch as Keras takes it; the feeder's next epoch on
    the next call. With `real_only` (for `predict` and `evaluate`), each batch's real rows
    alone, as the source gives them."""
    o = feeder.options
    how = None if real_only else weighting(feeder.spec, o.remainder, o.errors)
    size = o.global_batch_size
    made: dict[int, tuple[Any, Any]] = {}
    """Per pattern, keyed by its masks (kept, so that the key stays its own): the sample weights
    added to `(x, y)`, or the row weights that scale an `(x, y, w)` source's own."""
    feeder._consumer.end_open_pass()
    for batch in feeder._consumer.iterate(fit=True, host=False):
        inputs, mask = batch.distributed()
        if real_only and batch.num_valid < size:
            real = rows.real(batch, mask)
            inputs = optree.tree_map(lambda a, real=real: a[real], inputs)
        if how is None:
            yield inputs
            continue
        # A torch batch's masks are its own copies (a loop may write them); its pattern's
        # are shared, as JAX's masks themselves are.
        pattern = getattr(batch, "_pattern", mask)
        if id(pattern) not in made:
            weights = rows.weights(mask, size / batch.num_valid)
            made[id(pattern)] = (
                pattern,
                rows.added(inputs[1], weights) if how == "add" else weights,
            )
        weights = made[id(pattern)][1]
        if how == "add":
            yield (*inputs, weights)
        else:
            yield inputs[0], inputs[1], rows.scaled(inputs[2], weights)
