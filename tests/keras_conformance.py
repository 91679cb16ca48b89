"""Conformance: `model.fit(feeder, **kw)` against Keras's own `model.fit(x, y, **kw)` on the same
rows in the same order, on every Keras backend; Keras's result is the expected one. On
TensorFlow every case runs on `model.fit(feeder.as_dataset(), **kw)` too (see `ENTRY`).

Each case builds the same model twice and fits it once on a feeder and once on the arrays the
feeder reads, then compares what Keras gives: the weights (bit for bit), the optimizer's
step count, the History, how often each sample was trained on (a weighted metric over the
samples' ids, which are their labels) and `predict` and `evaluate` after the fit. The rule:
every case is equal, or refused before anything trains with a message that names the way that
works. docs/promises.md carries the matrix.

Each backend's module imports the tests; its conftest (or module) gives the `keras` fixture and
`keras_devices`, the one device Keras trains on there (None on TensorFlow: its default). This
module imports no framework.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import threading
import time

import numpy as np
import optree
import pytest

import feedpipe as fp
from feedpipe.core.sampler import Sampler

LENGTH, BATCH, FEATURES = 100, 32, 8  # the last batch holds 4 real rows
Pair = collections.namedtuple("Pair", "x y")

ENTRY = "feeder"
"""What every fit on a feeder here reads: "feeder", the feeder itself, or on TensorFlow
"as_dataset", `feeder.as_dataset()` (its backend's module runs the cases on both)."""


ONE_ENTRY = pytest.mark.one_entry
"""Marks a case that never reads `ENTRY` (it fits on the feeder itself, or fits nothing): a
backend that runs the cases on two entries runs it once, as the same fit twice would add
nothing (`test_a_case_marked_for_one_entry_never_reads_the_entry` keeps the marks true)."""


def fit_input(feeder):
    """What `model.fit` is given for `feeder` (see `ENTRY`)."""
    return feeder.as_dataset() if ENTRY == "as_dataset" else feeder


def features(length: int = LENGTH, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(length, FEATURES)).astype("float32")


def ids(length: int = LENGTH) -> np.ndarray:
    """Each sample's label is its id, so that a metric over labels counts each sample."""
    return np.arange(length, dtype="int32")


def rows_trained(keras, length: int = LENGTH):
    """A weighted metric: how many times, times its weight, each sample (by its label, its
    id) entered the loss this epoch; its result, their sum."""

    class RowsTrained(keras.metrics.Metric):
        def __init__(self, name="rows_trained", **kwargs):
            super().__init__(name=name, **kwargs)
            self.counts = self.add_variable((length,), "zeros", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            ops = keras.ops
            labels = ops.reshape(ops.cast(y_true, "int32"), (-1,))
            hits = ops.one_hot(labels, length)
            if sample_weight is not None:
                hits = hits * ops.reshape(ops.cast(sample_weight, hits.dtype), (-1, 1))
            self.counts.assign(self.counts + ops.sum(hits, axis=0))

        def result(self):
            return keras.ops.sum(self.counts)

    return RowsTrained()


# ---- the samples: each structure as a source, and the same as Keras's x, y, sample_weight ----


class Structure:
    """One sample structure: the feeder's source of it and the arrays `fit(x, y)` takes."""

    name = "tuple"

    def __init__(self, length: int = LENGTH):
        self.x, self.y = features(length), ids(length)
        self.length = length

    def sample(self, i: int):
        return self.x[i], self.y[i]

    def arrays(self, order=None):
        """`(x, y, sample_weight)` as Keras's `fit` takes them, rows in `order`."""
        order = np.arange(self.length) if order is None else order
        return self.x[order], self.y[order], None

    def model(self, keras, optimizer: str = "sgd", **compile_options):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
        net = keras.Model(inputs, keras.layers.Dense(self.length)(hidden))
        return self.compiled(keras, net, optimizer, compile_options)

    def compiled(self, keras, net, optimizer: str, compile_options: dict):
        """`net`, one output of the samples' ids, compiled to count the rows it trains on."""
        net.compile(
            _optimizer(keras, optimizer),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[rows_trained(keras, self.length)],
            **compile_options,
        )
        return net


class ListSamples(Structure):
    name = "list"

    def sample(self, i):
        return [self.x[i], self.y[i]]


class NamedTupleSamples(Structure):
    name = "namedtuple"

    def sample(self, i):
        return Pair(self.x[i], self.y[i])


class WeightedSamples(Structure):
    """`(x, y, w)`, integer weights: a padded batch's weights were once scaled and truncated."""

    name = "weighted"

    def __init__(self, length: int = LENGTH):
        super().__init__(length)
        self.w = (np.arange(length) % 3 + 1).astype("int32")

    def sample(self, i):
        return self.x[i], self.y[i], self.w[i]

    def arrays(self, order=None):
        order = np.arange(self.length) if order is None else order
        return self.x[order], self.y[order], self.w[order]


class DictInputs(Structure):
    """Two named inputs in a dict, one output."""

    name = "dict"

    def __init__(self, length: int = LENGTH):
        super().__init__(length)
        self.z = features(length, seed=1)[:, :3]

    def sample(self, i):
        return {"a": self.x[i], "b": self.z[i]}, self.y[i]

    def arrays(self, order=None):
        order = np.arange(self.length) if order is None else order
        return {"a": self.x[order], "b": self.z[order]}, self.y[order], None

    def model(self, keras, optimizer="sgd", **compile_options):
        keras.utils.set_random_seed(1)
        a, b = keras.Input((FEATURES,), name="a"), keras.Input((3,), name="b")
        joined = keras.layers.Concatenate()([keras.layers.Dense(16)(a), b])
        net = keras.Model({"a": a, "b": b}, keras.layers.Dense(self.length)(joined))
        return self.compiled(keras, net, optimizer, compile_options)


class NestedSamples(DictInputs):
    """Two inputs and two outputs, nested: `((x1, x2), (ids, targets))`."""

    name = "nested"

    def __init__(self, length: int = LENGTH):
        super().__init__(length)
        self.t = self.z.sum(axis=1, keepdims=True).astype("float32")

    def sample(self, i):
        return (self.x[i], self.z[i]), (self.y[i], self.t[i])

    def arrays(self, order=None):
        order = np.arange(self.length) if order is None else order
        return (self.x[order], self.z[order]), (self.y[order], self.t[order]), None

    def model(self, keras, optimizer="sgd", **compile_options):
        keras.utils.set_random_seed(1)
        a, b = keras.Input((FEATURES,)), keras.Input((3,))
        hidden = keras.layers.Concatenate()([keras.layers.Dense(16)(a), b])
        outputs = [
            keras.layers.Dense(self.length, name="ids")(hidden),
            keras.layers.Dense(1, name="targets")(hidden),
        ]
        net = keras.Model([a, b], outputs)
        net.compile(
            _optimizer(keras, optimizer),
            [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
            weighted_metrics=[[rows_trained(keras, self.length)], []],
            **compile_options,
        )
        return net


class DictLabels(NestedSamples):
    """Dict labels compiled with a list of losses, in the model's output order."""

    name = "dict-labels"

    def sample(self, i):
        return (self.x[i], self.z[i]), {"ids": self.y[i], "targets": self.t[i]}

    def arrays(self, order=None):
        order = np.arange(self.length) if order is None else order
        y = {"ids": self.y[order], "targets": self.t[order]}
        return (self.x[order], self.z[order]), y, None

    def model(self, keras, optimizer="sgd", **compile_options):
        keras.utils.set_random_seed(1)
        a, b = keras.Input((FEATURES,)), keras.Input((3,))
        hidden = keras.layers.Concatenate()([keras.layers.Dense(16)(a), b])
        outputs = {
            "ids": keras.layers.Dense(self.length, name="ids")(hidden),
            "targets": keras.layers.Dense(1, name="targets")(hidden),
        }
        net = keras.Model([a, b], outputs)
        net.compile(
            _optimizer(keras, optimizer),
            [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
            **compile_options,
        )
        return net


STRUCTURES = [
    Structure,
    ListSamples,
    NamedTupleSamples,
    WeightedSamples,
    DictInputs,
    NestedSamples,
    DictLabels,
]


def _optimizer(keras, name: str):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


# ---- the sources of a structure ---------------------------------------------------------------


class MapStyle:
    def __init__(self, structure: Structure):
        self.structure = structure

    def __len__(self):
        return self.structure.length

    def __getitem__(self, i):
        return self.structure.sample(i)


def source(keras, structure: Structure, kind: str):
    """The feeder's source of `structure`'s samples: "arrays", "map", "generator" or
    "pydataset"."""
    if kind == "map":
        return MapStyle(structure)
    if kind == "generator":

        def samples(shard, num_shards):
            for i in range(shard, structure.length, num_shards):
                yield structure.sample(i)

        return fp.from_generator(samples)
    x, y, w = structure.arrays()
    if kind == "arrays":
        return (x, y) if w is None else (x, y, w)
    assert kind == "pydataset"

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-structure.length // 10)

        def __getitem__(self, number):
            rows = slice(10 * number, 10 * (number + 1))
            return (x[rows], y[rows]) if w is None else (x[rows], y[rows], w[rows])

    return Batches()


# ---- the comparison ------------------------------------------------------------------------


def fit_arrays(
    keras, structure, *, epochs=2, order=None, optimizer="sgd", compile=None, batch=BATCH, **kw
):
    """Keras's own fit on the arrays: the expected result."""
    net = structure.model(keras, optimizer, **(compile or {}))
    x, y, w = structure.arrays(order)
    history = net.fit(
        x, y, sample_weight=w, batch_size=batch, shuffle=False, epochs=epochs, verbose=0, **kw
    )
    return net, history


def fit_feeder(
    keras,
    devices,
    structure,
    kind="map",
    *,
    epochs=2,
    optimizer="sgd",
    compile=None,
    feeder_options=None,
    batch=BATCH,
    **kw,
):
    """The same fit on a feeder of the same rows; the feeder's state after it."""
    net = structure.model(keras, optimizer, **(compile or {}))
    options = {"devices": devices, **(feeder_options or {})}
    with fp.Feeder(source(keras, structure, kind), batch, **options) as feeder:
        callbacks = [feeder.fit_callback(), *kw.pop("callbacks", [])]
        history = net.fit(fit_input(feeder), epochs=epochs, callbacks=callbacks, verbose=0, **kw)
        state = json.loads(json.dumps(feeder.get_state()))
    return net, history, state


def resumed_fit(net, feeder, **kw):
    """`model.fit` going on after an interrupted fit. Where a dataset of `as_dataset()` cannot
    take up an epoch mid-way and go on with whole ones (Keras runs every epoch of a fit for the
    same number of steps), that fit is refused before it trains, naming the feeder itself or
    a fit of its own for the rest of the epoch; the feeder itself goes on."""
    if ENTRY != "as_dataset":
        return net.fit(feeder, **kw)
    mid_epoch = feeder.get_state()["step"] != 0
    try:
        return net.fit(feeder.as_dataset(), **kw)
    except ValueError as refused:
        ways = r"model\.fit\(feeder, |model\.fit\(feeder\.as_dataset\(\), initial_epoch="
        if not (mid_epoch and re.search(ways, str(refused))):
            raise
    return net.fit(feeder, **kw)


def steps_applied(net) -> int:
    """The optimizer's `iterations` (a mirrored variable under a strategy, too)."""
    return int(np.asarray(net.optimizer.iterations))


def assert_same_fit(fed, expected) -> None:
    """Weights bit for bit, the same optimizer steps, History and rows trained."""
    (net, history), (theirs, their_history) = fed, expected
    for mine, other in zip(net.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, other)
    assert steps_applied(net) == steps_applied(theirs)
    assert history.history.keys() == their_history.history.keys()
    for key, values in history.history.items():
        np.testing.assert_allclose(values, their_history.history[key], rtol=1e-6, err_msg=key)
    for mine, other in zip(net.metrics, theirs.metrics, strict=True):
        if hasattr(mine, "counts"):
            np.testing.assert_array_equal(np.asarray(mine.counts), np.asarray(other.counts))


# ---- the cases ---------------------------------------------------------------------------------


CASES = [(structure, "adam") for structure in STRUCTURES] + [(Structure, "sgd")]


@pytest.mark.parametrize("structure, optimizer", CASES, ids=[f"{s.name}-{o}" for s, o in CASES])
def test_every_structure_trains_what_fit_on_arrays_trains(
    keras, keras_devices, structure, optimizer
):
    samples = structure()
    fed, _, state = fit_feeder(keras, keras_devices, samples, optimizer=optimizer)
    assert (state["epoch"], state["step"]) == (2, 0)
    assert_same_fit((fed, _), fit_arrays(keras, samples, optimizer=optimizer))


@pytest.mark.parametrize("kind", ["arrays", "map", "generator", "pydataset"])
def test_every_source_trains_what_fit_on_arrays_trains(keras, keras_devices, kind):
    samples = Structure()
    net, history, state = fit_feeder(keras, keras_devices, samples, kind, optimizer="adam")
    assert (state["epoch"], state["step"]) == (2, 0)
    assert_same_fit((net, history), fit_arrays(keras, samples, optimizer="adam"))


@pytest.mark.parametrize("kind", ["arrays", "map"])
def test_class_weight_weighs_each_row_as_on_arrays(keras, keras_devices, kind):
    samples = Structure()
    class_weight = {i: float(1 + i % 4) for i in range(0, LENGTH, 2)}  # odd ids weigh 1
    if ENTRY == "as_dataset":  # Keras's class_weight on a dataset needs every class named
        class_weight.update(dict.fromkeys(range(1, LENGTH, 2), 1.0))
    fed = fit_feeder(keras, keras_devices, samples, kind, class_weight=class_weight)[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, class_weight=class_weight))


@pytest.mark.parametrize("keys", ["numpy integers", "numpy floats", "negative"])
def test_class_weight_keyed_as_numpy_gives_them_weighs_each_row_as_on_arrays(
    keras, keras_devices, keys
):
    # scikit-learn's recipe, dict(zip(np.unique(y), weights)): Keras finds each class's weight
    # with class_weight.get(int(label)), so any key equal to the class counts.
    samples = Structure()
    classes = np.unique(samples.y)
    if keys == "numpy floats":
        classes = classes.astype("float32")
    elif keys == "negative":  # a key no label has, below the table's usual start
        classes = classes - 3
    class_weight = dict(zip(classes, 1.0 + classes % 4, strict=True))
    if ENTRY == "as_dataset" and keys != "numpy integers":
        # On a dataset Keras weighs rows itself, through a table indexed from 0 to the largest
        # key: a dataset of the same rows from tf.data is the expected result.
        import tensorflow as tf

        rows = tf.data.Dataset.from_tensor_slices((samples.x, samples.y)).batch(BATCH)
        with pytest.raises(Exception) as on_a_dataset:  # Keras's own error, whichever
            samples.model(keras).fit(rows, class_weight=class_weight, verbose=0)
        with pytest.raises(type(on_a_dataset.value)):
            fit_feeder(keras, keras_devices, samples, class_weight=class_weight)
        return
    fed = fit_feeder(keras, keras_devices, samples, class_weight=class_weight)[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, class_weight=class_weight))


@pytest.mark.parametrize(
    "compile",
    [
        {"steps_per_execution": 2},
        {"steps_per_execution": 3},
        {"jit_compile": False},
        {"jit_compile": True},
        {"run_eagerly": True},
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_compile_options_train_what_fit_on_arrays_trains(keras, keras_devices, compile):
    samples = Structure()
    try:
        expected = fit_arrays(keras, samples, compile=compile, optimizer="adam")
    except ValueError as refused:  # steps_per_execution > 1 on torch: Keras refuses it
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            fit_feeder(keras, keras_devices, samples, compile=compile, optimizer="adam")
        return
    fed = fit_feeder(keras, keras_devices, samples, compile=compile, optimizer="adam")[:2]
    assert_same_fit(fed, expected)


def test_steps_per_epoch_of_a_whole_epoch_trains_what_fit_on_arrays_trains(keras, keras_devices):
    samples, steps = Structure(), -(-LENGTH // BATCH)
    fed = fit_feeder(keras, keras_devices, samples, steps_per_epoch=steps)[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, steps_per_epoch=steps))


def test_initial_epoch_on_a_fresh_feeder_goes_on_from_that_epoch(keras, keras_devices):
    samples = Structure()
    options = {"shuffle": True, "seed": 3}
    net, _, state = fit_feeder(
        keras, keras_devices, samples, "map", epochs=3, initial_epoch=1, feeder_options=options
    )
    assert (state["epoch"], state["step"]) == (3, 0)
    plan = Sampler(LENGTH, BATCH, shuffle=True, seed=3)
    theirs = samples.model(keras)
    for epoch in (1, 2):  # the feeder's order of those epochs, written out
        x, y, _ = samples.arrays(plan.order(epoch))
        theirs.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for mine, other in zip(net.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, other)
    assert int(net.optimizer.iterations) == int(theirs.optimizer.iterations)


ONE_EPOCH_A_FIT = [
    ("map", "the same feeder"),
    ("generator", "the same feeder"),
    ("generator", "the same feeder restored"),
    ("generator", "a new feeder restored"),
]


@ONE_ENTRY
@pytest.mark.parametrize(
    "kind, resume", ONE_EPOCH_A_FIT, ids=[f"{k}-{r}" for k, r in ONE_EPOCH_A_FIT]
)
def test_fits_of_one_epoch_each_from_the_states_epoch_train_what_fits_on_arrays_train(
    keras, keras_devices, kind, resume
):
    # As a notebook fits: one epoch a cell, initial_epoch the epoch the feeder's state names.
    samples = Structure()
    net = samples.model(keras, "adam")
    feeder = fp.Feeder(source(keras, samples, kind), BATCH, devices=keras_devices)
    try:
        for _ in range(3):
            state = json.loads(json.dumps(feeder.get_state()))
            if resume == "a new feeder restored":
                feeder.close()
                feeder = fp.Feeder(source(keras, samples, kind), BATCH, devices=keras_devices)
            if resume != "the same feeder":
                feeder.set_state(state)
            epoch = state["epoch"]
            callbacks = [feeder.fit_callback()]
            net.fit(feeder, initial_epoch=epoch, epochs=epoch + 1, callbacks=callbacks, verbose=0)
        state = feeder.get_state()
    finally:
        feeder.close()
    assert (state["epoch"], state["step"]) == (3, 0)
    theirs = samples.model(keras, "adam")
    x, y, _ = samples.arrays()
    for epoch in range(3):
        theirs.fit(
            x, y, batch_size=BATCH, shuffle=False, initial_epoch=epoch, epochs=epoch + 1, verbose=0
        )
    for mine, other in zip(net.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, other)
    assert steps_applied(net) == steps_applied(theirs)


def test_a_shuffled_feeder_trains_its_order_written_out_as_arrays(keras, keras_devices):
    samples = Structure()
    options = {"shuffle": True, "seed": 5}
    net, _, _ = fit_feeder(
        keras, keras_devices, samples, "arrays", optimizer="adam", feeder_options=options
    )
    plan = Sampler(LENGTH, BATCH, shuffle=True, seed=5)
    theirs = samples.model(keras, "adam")
    for epoch in (0, 1):
        x, y, _ = samples.arrays(plan.order(epoch))
        theirs.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for mine, other in zip(net.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, other)


@pytest.mark.parametrize("validation", ["arrays", "feeder"])
def test_validation_data_gives_the_history_of_fit_on_arrays(keras, keras_devices, validation):
    samples, held_out = Structure(), Structure()
    held_out.x = features(seed=7)
    x_val, y_val, _ = held_out.arrays()
    expected = fit_arrays(keras, samples, validation_data=(x_val, y_val))
    if validation == "arrays":
        fed = fit_feeder(keras, keras_devices, samples, validation_data=(x_val, y_val))[:2]
    else:
        with fp.Feeder(MapStyle(held_out), BATCH, devices=keras_devices) as val:
            fed = fit_feeder(keras, keras_devices, samples, validation_data=val)[:2]
            assert val.get_state() == {**val.get_state(), "epoch": 0, "step": 0}
    assert "val_loss" in fed[1].history
    assert_same_fit(fed, expected)


def held_out_arrays() -> tuple[np.ndarray, np.ndarray]:
    held_out = Structure()
    held_out.x = features(seed=7)
    return held_out.x, held_out.y


@ONE_ENTRY
@pytest.mark.parametrize("validation_steps", [1, None])
def test_validation_arrays_are_batched_by_the_feeders_batch_as_fit_on_arrays_batches_them(
    keras, keras_devices, validation_steps
):
    # fit(x, y, batch_size=B) batches validation arrays by B; a fit on a feeder has no
    # batch_size, and Keras would take 32.
    samples, batch = Structure(), SHORT_BATCH
    options = {"validation_data": held_out_arrays(), "validation_steps": validation_steps}
    expected = samples.model(keras)
    x, y, _ = samples.arrays()
    their_history = expected.fit(
        x, y, batch_size=batch, shuffle=False, epochs=2, verbose=0, **options
    )
    net = samples.model(keras)
    with fp.Feeder(MapStyle(samples), batch, devices=keras_devices) as feeder:
        history = net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0, **options)
    assert "val_loss" in history.history
    assert_same_fit((net, history), (expected, their_history))


class UnseededDropout(Structure):
    """Dropout with no seed: on PyTorch it draws its masks from torch's global generator,
    which each iterator of the DataLoader that `fit(x, y)` reads draws from too."""

    name = "unseeded-dropout"

    def model(self, keras, optimizer="sgd", **compile_options):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(16)(inputs))
        net = keras.Model(inputs, keras.layers.Dense(self.length)(hidden))
        return self.compiled(keras, net, optimizer, compile_options)


@ONE_ENTRY
@pytest.mark.parametrize("kind", ["arrays", "generator"])
def test_an_unseeded_dropout_draws_the_masks_it_draws_on_arrays(keras, keras_devices, kind):
    # Every random draw of Keras's own path is made again, at the same points: each epoch's,
    # validation's, evaluate's and predict's; a second fit checks the draws of the calls before.
    samples = UnseededDropout()
    options = {"epochs": 2, "validation_data": held_out_arrays(), "verbose": 0}
    x, y, _ = samples.arrays()
    theirs = samples.model(keras)
    keras.utils.set_random_seed(5)  # torch.manual_seed(5) on PyTorch
    expected = theirs.fit(x, y, batch_size=BATCH, shuffle=False, **options)
    their_scores = theirs.evaluate(x, y, batch_size=BATCH, verbose=0)
    theirs.predict(x, batch_size=BATCH, verbose=0)
    expected_again = theirs.fit(x, y, batch_size=BATCH, shuffle=False, **options)
    net = samples.model(keras)
    with fp.Feeder(source(keras, samples, kind), BATCH, devices=keras_devices) as feeder:
        keras.utils.set_random_seed(5)
        callbacks = [feeder.fit_callback()]
        history = net.fit(feeder, callbacks=callbacks, **options)
        scores = net.evaluate(feeder, verbose=0)
        net.predict(feeder, verbose=0)
        again = net.fit(feeder, callbacks=callbacks, **options)
    np.testing.assert_allclose(scores, their_scores, rtol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(history.history["val_loss"], expected.history["val_loss"], rtol=1e-6)
    assert_same_fit((net, again), (theirs, expected_again))


def test_early_stopping_stops_where_it_stops_on_arrays(keras, keras_devices):
    samples = Structure()

    def stopping():
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=1)

    net, history, state = fit_feeder(
        keras, keras_devices, samples, epochs=5, callbacks=[stopping()]
    )
    expected = fit_arrays(keras, samples, epochs=5, callbacks=[stopping()])
    assert len(history.history["loss"]) == 2
    assert (state["epoch"], state["step"]) == (2, 0)
    assert_same_fit((net, history), expected)


def test_model_checkpoint_saves_the_weights_it_saves_on_arrays(keras, keras_devices, tmp_path):
    samples = Structure()

    def checkpoint(folder):
        path = str(tmp_path / folder / "e{epoch}.weights.h5")
        (tmp_path / folder).mkdir()
        return keras.callbacks.ModelCheckpoint(path, save_weights_only=True)

    fed = fit_feeder(keras, keras_devices, samples, callbacks=[checkpoint("fed")])[:2]
    expected = fit_arrays(keras, samples, callbacks=[checkpoint("arrays")])
    assert_same_fit(fed, expected)
    for epoch in (1, 2):
        mine, theirs = samples.model(keras), samples.model(keras)
        mine.load_weights(str(tmp_path / "fed" / f"e{epoch}.weights.h5"))
        theirs.load_weights(str(tmp_path / "arrays" / f"e{epoch}.weights.h5"))
        for a, b in zip(mine.get_weights(), theirs.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("crash", ["as epoch 2 begins", "in epoch 2's third step"])
@pytest.mark.parametrize("feeder_kind", ["the same feeder", "a new feeder"])
def test_backup_and_restore_resumes_as_fit_on_arrays_resumes(
    keras, keras_devices, tmp_path, crash, feeder_kind
):
    # BackupAndRestore restores the weights of the last epoch's end and Keras begins that
    # epoch again from its first step, even after a crash mid-epoch: so does the feeder.
    samples = Structure()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            if epoch == 2 and crash.startswith("as"):
                raise RuntimeError("crash")

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 2 and batch == 2:
                raise RuntimeError("crash")

    def resumed(fit):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / fit.__name__))
        net = samples.model(keras, "adam")
        with pytest.raises(RuntimeError, match="crash"):
            fit(net, callbacks=[backup, Crash()])
        fit(net, callbacks=[backup])
        return net

    def on_arrays(net, callbacks):
        x, y, _ = samples.arrays()
        net.fit(x, y, batch_size=BATCH, shuffle=False, epochs=4, callbacks=callbacks, verbose=0)

    feeders = [fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices)]

    def on_a_feeder(net, callbacks):
        if feeder_kind == "a new feeder":  # as a new process would build it
            feeders.append(fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices))
        feeder = feeders[-1]
        callbacks = [feeder.fit_callback(), *callbacks]
        resumed_fit(net, feeder, epochs=4, verbose=0, callbacks=callbacks)

    try:
        mine, theirs = resumed(on_a_feeder), resumed(on_arrays)
        state = feeders[-1].get_state()
    finally:
        for feeder in feeders:
            feeder.close()
    assert (state["epoch"], state["step"]) == (4, 0)
    for a, b in zip(mine.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(mine.optimizer.iterations) == int(theirs.optimizer.iterations)


@pytest.mark.parametrize("structure", [Structure, NestedSamples], ids=lambda s: s.name)
def test_predict_and_evaluate_give_what_they_give_on_arrays_and_leave_the_state(
    keras, keras_devices, structure
):
    samples = structure()
    net = samples.model(keras)
    x, y, _ = samples.arrays()
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        net.fit(fit_input(feeder), epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        loop = iter(feeder)  # mid-epoch: predict reads the next epoch whole, aside
        next(loop)
        loop.close()
        state, trained = feeder.get_state(), feeder.stats()
        predicted = net.predict(feeder, verbose=0)
        evaluated = net.evaluate(feeder, verbose=0, return_dict=True)
        assert feeder.get_state() == state
        read = feeder.stats()  # read aside: the training's figures stay as they were
        assert (read.steps, read.samples) == (trained.steps, trained.samples)
        steps = [b.step for b in feeder]
        assert steps[0] == state["step"], "the loop goes on where it was"
    expected = net.predict(x, batch_size=BATCH, verbose=0)
    for mine, theirs in zip(
        optree.tree_leaves(predicted), optree.tree_leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(mine, theirs)
    theirs = net.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert evaluated.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_allclose(evaluated[key], theirs[key], rtol=1e-6, err_msg=key)


@ONE_ENTRY
def test_a_feeder_only_predicted_on_still_says_its_state(keras, keras_devices):
    samples = Structure()
    net = samples.model(keras)
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        net.predict(feeder, verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 0)
        assert [b.step for b in feeder] == list(range(-(-LENGTH // BATCH)))


# ---- refused before anything trains -----------------------------------------------------------


REFUSED = [
    ("y", {"y": ids()}, r"leave `y` unset|`y` should not be passed"),
    (
        "sample_weight",
        {"sample_weight": np.ones(LENGTH)},
        r"fp.Feeder\(\(x, y, w\)|`sample_weights` should not be passed",
    ),
    ("validation_split", {"validation_split": 0.2}, r"validation_split"),
    ("steps_per_epoch", {"steps_per_epoch": 2}, r"steps_per_epoch"),
    ("initial_epoch", {"initial_epoch": 3, "epochs": 4}, r"initial_epoch=1"),
]


@pytest.mark.parametrize("argument, given, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_an_argument_a_feeder_cannot_honour_is_refused_before_training(
    keras, keras_devices, argument, given, message
):
    samples = Structure()
    net = samples.model(keras)
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        if argument == "initial_epoch":  # the feeder is at epoch 1: Keras would count anew
            net.fit(fit_input(feeder), epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        before, steps = net.get_weights(), int(net.optimizer.iterations)
        state = feeder.get_state()
        with pytest.raises(ValueError, match=message):
            net.fit(fit_input(feeder), callbacks=[feeder.fit_callback()], verbose=0, **given)
        assert int(net.optimizer.iterations) == steps
        for a, b in zip(net.get_weights(), before, strict=True):
            np.testing.assert_array_equal(a, b)
        assert feeder.get_state() == state


@pytest.mark.parametrize("structure", [WeightedSamples, NestedSamples], ids=lambda s: s.name)
def test_class_weight_keras_would_refuse_is_refused_naming_the_way(keras, keras_devices, structure):
    samples = structure()
    net = samples.model(keras)
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        refused = r"class_weight.*(third field|single output)|`class_weight` and `sample_weight`"
        with pytest.raises(ValueError, match=refused):
            net.fit(
                fit_input(feeder),
                class_weight={0: 2.0},
                callbacks=[feeder.fit_callback()],
                verbose=0,
            )
        assert int(net.optimizer.iterations) == 0


@ONE_ENTRY
def test_class_weight_that_is_not_a_dict_is_refused_naming_the_dict_that_works(
    keras, keras_devices
):
    samples = Structure()
    net = samples.model(keras)
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        with pytest.raises(ValueError, match=r"class_weight.*got a list.*dict\(enumerate"):
            net.fit(feeder, class_weight=[1.0, 2.0], callbacks=[feeder.fit_callback()], verbose=0)
        assert int(net.optimizer.iterations) == 0


def test_the_fit_callback_in_a_fit_on_other_data_is_refused(keras, keras_devices):
    samples = Structure()
    net = samples.model(keras)
    x, y, _ = samples.arrays()
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        callbacks = [feeder.fit_callback()]
        with pytest.raises(ValueError, match=r"fit on other data.*only to fits on its feeder"):
            net.fit(x, y, batch_size=BATCH, callbacks=callbacks, verbose=0)
        assert int(net.optimizer.iterations) == 0
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 0)
        net.fit(fit_input(feeder), callbacks=callbacks, verbose=0)  # the same list, on its feeder
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)


# ---- interruptions -----------------------------------------------------------------------------


class Faulty(MapStyle):
    """A map-style source whose next read raises, once, after `arm()`."""

    def __init__(self, structure: Structure):
        super().__init__(structure)
        self.armed = False

    def arm(self):
        self.armed = True

    def __getitem__(self, i):
        if self.armed:
            self.armed = False
            raise OSError(f"sample {i} could not be read")
        return super().__getitem__(i)


def interrupter(keras, how: str, at: int, source: Faulty):
    """A callback that interrupts the fit as its step `at` (counted over the fit) begins: it
    raises; or the source's next read raises (a batch or two ahead, as the producer reads);
    or a thread sends a real SIGINT, which lands while the step runs."""

    class Interrupt(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            if self.steps == at:
                if how == "callback":
                    raise RuntimeError("a callback failed")
                if how == "source":
                    source.arm()
                else:
                    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()
            self.steps += 1

    return Interrupt()


SHORT, SHORT_BATCH = 30, 16  # two steps an epoch, the last of 14 real rows


INTERRUPTIONS = [
    (how, resume)
    for resume in ("same fit again", "restored state")
    for how in ("callback", "source", "sigint")
    if (how, resume) != ("source", "same fit again")  # a source's error closes the feeder
]


@pytest.mark.parametrize("how, resume", INTERRUPTIONS, ids=[f"{r}-{h}" for h, r in INTERRUPTIONS])
def test_a_fit_interrupted_at_any_step_and_resumed_equals_one_never_interrupted(
    keras, keras_devices, how, resume
):
    samples = Structure(SHORT)
    steps = 2 * -(-SHORT // SHORT_BATCH)
    never = samples.model(keras, "adam")
    with fp.Feeder(MapStyle(samples), SHORT_BATCH, devices=keras_devices) as feeder:
        never.fit(fit_input(feeder), epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    for at in range(steps):
        net, source = samples.model(keras, "adam"), Faulty(samples)
        feeder = fp.Feeder(source, SHORT_BATCH, devices=keras_devices)
        try:
            callbacks = [feeder.fit_callback(), interrupter(keras, how, at, source)]
            try:
                net.fit(fit_input(feeder), epochs=2, callbacks=callbacks, verbose=0)
                time.sleep(0.5)  # a SIGINT sent as the last step began may land after fit
            except (KeyboardInterrupt, RuntimeError, OSError):
                pass
            state = json.loads(json.dumps(feeder.get_state()))
            if resume == "restored state":
                feeder.close()
                feeder = fp.Feeder(MapStyle(samples), SHORT_BATCH, devices=keras_devices)
                feeder.set_state(state)
            resumed_fit(
                net,
                feeder,
                epochs=2,
                initial_epoch=state["epoch"],
                verbose=0,
                callbacks=[feeder.fit_callback()],
            )
            assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (2, 0), at
        finally:
            feeder.close()
        assert int(net.optimizer.iterations) == steps, (how, at, state)
        for mine, other in zip(net.get_weights(), never.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, other, err_msg=f"{how} at step {at}")


# ---- Keras's own trainer tests (keras/src/trainers/trainer_test.py) where data is an argument,
# ---- on a feeder, with Keras on arrays as the expected result -----------------------------------


def step_count(keras):
    """Keras's `StepCount`: each epoch's calls of the step, from the batch indices Keras
    gives the callbacks."""

    class StepCount(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.calls = []

        def on_epoch_begin(self, epoch, logs=None):
            self.calls.append([])

        def on_train_batch_begin(self, batch, logs=None):
            self.calls[-1].append(batch)

    return StepCount()


@pytest.mark.parametrize("steps_per_execution", [3, 101])
def test_steps_per_execution_counts_the_calls_fit_on_arrays_counts(
    keras, keras_devices, steps_per_execution
):
    samples = Structure()
    compile = {"steps_per_execution": steps_per_execution}
    mine, theirs = step_count(keras), step_count(keras)
    try:
        expected = fit_arrays(keras, samples, compile=compile, callbacks=[theirs])
    except ValueError as refused:  # Keras on torch takes steps_per_execution=1 alone
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            fit_feeder(keras, keras_devices, samples, compile=compile)
        return
    fed = fit_feeder(keras, keras_devices, samples, compile=compile, callbacks=[mine])[:2]
    assert mine.calls == theirs.calls
    assert_same_fit(fed, expected)


@ONE_ENTRY
def test_predict_keeps_the_order_of_the_samples(keras, keras_devices):
    inputs = keras.Input((1,))
    net = keras.Model(inputs, keras.layers.Identity()(inputs))
    net.compile(loss="mse", optimizer="sgd")
    values = np.arange(LENGTH, dtype="float32")[:, None]
    with fp.Feeder(values, 7, devices=keras_devices) as feeder:  # a last batch of 2
        predicted = net.predict(feeder, verbose=0)
    np.testing.assert_array_equal(predicted, values)


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_any_batch_size_gives_the_same_loss(keras, keras_devices, method):
    samples = Structure()
    losses = []
    for size in (80, 100):  # a last batch of 20, or none
        net = samples.model(keras)
        net.trainable = False
        net.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with fp.Feeder(MapStyle(samples), size, devices=keras_devices) as feeder:
            if method == "fit":
                losses.append(net.fit(fit_input(feeder), verbose=0).history["loss"][0])
            else:
                losses.append(net.evaluate(feeder, verbose=0))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


class SumLoss(Structure):
    """A loss summed over the batch: a padded batch weighted as a mean was once 12 to 46 % off."""

    name = "sum-loss"

    def model(self, keras, optimizer="sgd", **compile_options):
        net = super().model(keras, optimizer, **compile_options)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
        net.compile(_optimizer(keras, optimizer), loss, **compile_options)
        return net


def test_a_loss_summed_over_the_batch_trains_what_fit_on_arrays_trains(keras, keras_devices):
    samples = SumLoss()
    fed = fit_feeder(keras, keras_devices, samples, optimizer="adam")[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, optimizer="adam"))


class Regularized(Structure):
    """Kernel and activity regularizers and an `add_loss`: Keras adds them to the loss
    unweighted, computed over every row the step is given."""

    name = "regularized"

    def model(self, keras, optimizer="sgd", **compile_options):
        class AddsLoss(keras.layers.Layer):
            def call(self, inputs):
                self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
                return inputs

        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        dense = keras.layers.Dense(
            16,
            kernel_regularizer=keras.regularizers.L2(0.01),
            activity_regularizer=keras.regularizers.L1(0.01),
        )
        net = keras.Model(inputs, keras.layers.Dense(self.length)(AddsLoss()(dense(inputs))))
        return self.compiled(keras, net, optimizer, compile_options)


class BinaryLabels(Structure):
    """A binary classifier whose compiled `metrics` (accuracy, AUC, MSE) take no sample weight:
    they count every row the step is given."""

    name = "binary"

    def __init__(self, length: int = LENGTH):
        super().__init__(length)
        self.y = (self.x.sum(axis=1, keepdims=True) > 0).astype("float32")

    def model(self, keras, optimizer="sgd", **compile_options):
        keras.utils.set_random_seed(1)
        net = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        metrics = ["accuracy", keras.metrics.AUC(name="auc"), "mse"]
        net.compile(
            _optimizer(keras, optimizer), "binary_crossentropy", metrics=metrics, **compile_options
        )
        return net


@pytest.mark.parametrize("structure", [Regularized, BinaryLabels], ids=lambda s: s.name)
def test_losses_and_metrics_keras_computes_unweighted_see_the_rows_fit_on_arrays_gives(
    keras, keras_devices, structure
):
    samples = structure()
    fed = fit_feeder(keras, keras_devices, samples, optimizer="adam")[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, optimizer="adam"))


SIZES = [(7, 32), (37, 8), (1000, 64)]


@pytest.mark.parametrize("length, batch", SIZES, ids=[f"N={n}-B={b}" for n, b in SIZES])
def test_every_length_and_batch_trains_what_fit_on_arrays_trains(
    keras, keras_devices, length, batch
):
    # One short batch of 7 (BatchNormalization's statistics of 7 rows), a last batch of 5,
    # and 15 full batches and one of 40.
    samples = Structure(length)
    fed = fit_feeder(keras, keras_devices, samples, batch=batch)[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, batch=batch))


def test_loss_weights_train_what_fit_on_arrays_trains(keras, keras_devices):
    samples, compile = NestedSamples(), {"loss_weights": [0.3, 2.0]}
    fed = fit_feeder(keras, keras_devices, samples, compile=compile)[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, compile=compile))


def test_mixed_precision_trains_what_fit_on_arrays_trains(keras, keras_devices):
    samples, policy = Structure(), keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        fed = fit_feeder(keras, keras_devices, samples, optimizer="adam")[:2]
        expected = fit_arrays(keras, samples, optimizer="adam")
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert_same_fit(fed, expected)


def test_early_stopping_that_restores_the_best_weights_restores_those_of_fit_on_arrays(
    keras, keras_devices
):
    samples = Structure()

    def stopping():  # the first epoch is the best; the fit stops after the third
        return keras.callbacks.EarlyStopping(
            monitor="loss", min_delta=1e9, patience=2, restore_best_weights=True
        )

    net, history, state = fit_feeder(
        keras, keras_devices, samples, epochs=5, callbacks=[stopping()]
    )
    expected = fit_arrays(keras, samples, epochs=5, callbacks=[stopping()])
    assert len(history.history["loss"]) == 3 and (state["epoch"], state["step"]) == (3, 0)
    assert_same_fit((net, history), expected)


def test_two_fits_in_a_row_train_what_two_fits_on_arrays_train(keras, keras_devices):
    samples = Structure()
    x, y, _ = samples.arrays()
    net, theirs = samples.model(keras, "adam"), samples.model(keras, "adam")
    with fp.Feeder(MapStyle(samples), BATCH, devices=keras_devices) as feeder:
        for _ in range(2):
            history = net.fit(fit_input(feeder), callbacks=[feeder.fit_callback()], verbose=0)
            their_history = theirs.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            assert_same_fit((net, history), (theirs, their_history))


@ONE_ENTRY
@pytest.mark.slow
@pytest.mark.parametrize("at", [1, 2], ids=["the epoch's last step", "mid-epoch"])
def test_a_ctrl_c_saved_in_its_handler_resumes_in_a_new_process_as_never_interrupted(
    keras, keras_devices, tmp_path, at
):
    from tests.processes import REPO_ROOT, log_tail, run_at_once

    script = str(REPO_ROOT / "tests" / "keras_resume_worker.py")
    env = {"KERAS_BACKEND": keras.backend.backend()}
    runs = {"full": ["full", str(tmp_path)], "interrupt": ["interrupt", str(tmp_path), str(at)]}
    codes = run_at_once(script, runs, tmp_path, 300, envs=dict.fromkeys(runs, env))
    for name, code in codes.items():
        assert code == 0, log_tail(tmp_path, name)
    state = json.loads((tmp_path / "state.json").read_text())
    assert 0 < state["epoch"] * 2 + state["step"] < 4, state
    codes = run_at_once(
        script, {"resume": ["resume", str(tmp_path)]}, tmp_path, 300, envs={"resume": env}
    )
    assert codes["resume"] == 0, log_tail(tmp_path, "resume")
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resume.npz")
    assert set(full.files) == set(resumed.files)
    for name in full.files:
        np.testing.assert_array_equal(resumed[name], full[name], err_msg=name)
