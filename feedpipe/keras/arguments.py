"""Arguments: what of `model.fit`'s, `evaluate`'s and `predict`'s arguments a feeder takes.

Keras hands a custom data adapter none of the call's `y`, `sample_weight` or `class_weight`
(`get_data_adapter` returns it before it looks at them): a fit given them would train as if
they were not. A feeder's samples carry their labels and weights, so `y` and `sample_weight`
are refused, naming the source that carries them; `class_weight` is applied as Keras applies
it to arrays, on the devices, with Keras's own ops. Nor has such a fit a `batch_size`, by which
Keras batches validation arrays where `validation_batch_size` is unset: they are batched by the
feeder's global batch, as `fit(x, y, batch_size=B)` batches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feedpipe._internals.keras import batch_keras_validation_arrays, keras_call
from feedpipe.core.weights import labelled


def keras_arguments(feeder: Any) -> tuple[str | None, dict | None]:
    """Which of Keras's `fit`, `evaluate` or `predict` reads `feeder` now (None: another
    reader), and the `class_weight` it trains with (None: none), once its arguments are found
    to be ones a feeder takes (and a fit's validation arrays batched by the feeder's batch)."""
    call = keras_call(feeder)
    if call is None:
        return None, None
    reading, given = call
    if given.get("y") is not None:
        raise ValueError(
            f"model.{reading}(feeder, y=...): a feeder's samples carry their labels, and Keras "
            "reads no `y` beside a data adapter; build the feeder over (x, y), "
            "fp.Feeder((x, y), ...), and leave `y` unset."
        )
    if given.get("sample_weight") is not None:
        raise ValueError(
            f"model.{reading}(feeder, sample_weight=...): Keras reads no `sample_weight` beside "
            "a data adapter, so the weights would be ignored; build the feeder over "
            "(x, y, sample_weight), fp.Feeder((x, y, w), ...): Keras weighs each sample by "
            "its third field."
        )
    class_weight = given.get("class_weight") or None
    if class_weight is not None:
        _check_class_weight(feeder.spec.treespec, class_weight)
    if reading == "fit":
        batch_keras_validation_arrays(feeder, feeder.options.global_batch_size)
    return reading, class_weight


def _check_class_weight(treespec: Any, class_weight: Any) -> None:
    """Refuses a `class_weight` Keras would refuse for these samples, or could not apply."""
    pair = labelled(treespec)
    if pair == 3:
        raise ValueError(
            "model.fit(feeder, class_weight=...): the feeder's samples are (x, y, "
            "sample_weight), and Keras cannot use `class_weight` and `sample_weight` at the "
            "same time; fold the class weights into the samples' third field, or build the "
            "feeder over (x, y)."
        )
    if pair != 2:
        raise ValueError(
            f"model.fit(feeder, class_weight=...) weighs each sample by its label, but the "
            f"feeder's samples are {treespec}, not (x, y); build it over (x, y)."
        )
    if treespec.children()[1].num_leaves != 1:
        raise ValueError(
            "model.fit(feeder, class_weight=...): `class_weight` is only supported for models "
            "with a single output (Keras's rule), and the feeder's labels have "
            f"{treespec.children()[1].num_leaves} fields; give per-sample weights as the "
            "samples' third field, fp.Feeder((x, y, w), ...)."
        )
    if not isinstance(class_weight, Mapping):
        raise ValueError(
            f"model.fit(feeder, class_weight=...) takes a dict from class index to weight, as "
            f"Keras does; got a {type(class_weight).__name__}, {class_weight!r}. Pass "
            "class_weight=dict(enumerate(weights)), or dict(zip(classes, weights))."
        )


def _class_index(key: Any) -> int | None:
    """The class `key` stands for where Keras looks a class up, `class_weight.get(c)` with `c`
    a Python int: any key equal to an int (a numpy integer from `np.unique(y)`, a float 2.0, a
    bool), else None (a key Keras never finds)."""
    try:
        index = int(key)
    except (TypeError, ValueError, OverflowError):
        return None
    return index if key == index else None


class ClassWeights:
    """Each row's weight by its class, as Keras weighs arrays
    (`data_adapter_utils.class_weight_to_sample_weights`): a one-hot row's class is its
    argmax, any other's its rounded value, its weight `class_weight.get(c, 1.0)`, so any key
    equal to the class counts and a class with none weighs 1. In Keras's ops, so the weights
    are made where the labels are, on any backend; the table of weights, from the lowest class
    a key names to the highest, is made once, not once a batch."""

    def __init__(self, class_weight: Mapping):
        from keras import backend, ops

        named = [c for c in map(_class_index, class_weight) if c is not None]
        self.lowest = min(named, default=0)
        classes = range(self.lowest, max(named, default=0) + 1)
        weights = [float(class_weight.get(c, 1.0)) for c in classes]
        self.table = ops.array(weights, backend.floatx())
        self.classes = len(weights)

    def of(self, labels: Any) -> Any:
        """The weight of each row of `labels`."""
        from keras import ops

        y = labels
        if len(y.shape) > 1:
            y = ops.argmax(y, axis=-1) if y.shape[-1] != 1 else ops.squeeze(y, axis=-1)
        classes = ops.cast(ops.round(ops.cast(y, "float32")), "int32") - self.lowest
        known = ops.logical_and(classes >= 0, classes < self.classes)
        looked_up = ops.take(self.table, ops.clip(classes, 0, self.classes - 1))
        return ops.where(known, looked_up, ops.ones_like(looked_up))

    def weigh(self, inputs: Any) -> tuple:
        """`(x, y)` with each row weighted by its class, or `(x, y, w)` (a padded batch's zero
        weights on padding) with `w` multiplied by it."""
        from keras import ops

        by_class = self.of(inputs[1])
        if len(inputs) == 3:
            w = inputs[2]
            by_class = ops.reshape(by_class, (-1,) + (1,) * (len(w.shape) - 1))
            return inputs[0], inputs[1], w * by_class
        return inputs[0], inputs[1], by_class
