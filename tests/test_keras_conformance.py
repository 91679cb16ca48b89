"""Keras on TensorFlow: `model.fit(feeder)` and `model.fit(feeder.as_dataset())` conform to
Keras's own `fit(x, y)` (`tests/keras_conformance.py`), on Keras's default device."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tensorflow as tf

import feedpipe as fp
from tests import keras_conformance
from tests.keras_conformance import *  # noqa: F403 (every conformance case runs here)
from tests.keras_conformance import (
    BATCH,
    FEATURES,
    ONE_ENTRY,
    DictInputs,
    MapStyle,
    Structure,
    assert_same_fit,
    fit_arrays,
    fit_feeder,
    fit_input,
)


@pytest.fixture
def keras():
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip(f"needs Keras on TensorFlow; here it runs on {keras.backend.backend()}")
    return keras


@pytest.fixture
def keras_devices():
    """None: the feeder's default, the device Keras trains on without a strategy."""
    return None


def pytest_generate_tests(metafunc):
    """Every case on both of TensorFlow's ways to fit on a feeder: the feeder itself, and the
    README's quick start, `feeder.as_dataset()`; a case that reads neither (`ONE_ENTRY`) once."""
    one = metafunc.definition.get_closest_marker("one_entry") is not None
    entries = ["feeder"] if one else ["feeder", "as_dataset"]
    metafunc.parametrize("entry", entries, indirect=True)


@pytest.fixture(autouse=True)
def entry(request, monkeypatch):
    """The entry this case fits through (see `pytest_generate_tests`)."""
    monkeypatch.setattr(keras_conformance, "ENTRY", request.param)
    return request.param


def _reads_entry(tree: ast.Module) -> set[str]:
    """The functions of `tree` that read `ENTRY`, or call one that does."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    reading: set[str] = set()
    while True:
        more = {
            name
            for name, node in functions.items()
            if name not in reading
            and any(
                isinstance(part, ast.Name) and part.id in reading | {"ENTRY"}
                for part in ast.walk(node)
            )
        }
        if not more:
            return reading
        reading |= more


@ONE_ENTRY
def test_a_case_marked_for_one_entry_never_reads_the_entry():
    # A mark that stopped being true would leave as_dataset() untested on that case.
    tree = ast.parse(Path(keras_conformance.__file__).read_text())
    marked = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("ONE_ENTRY" in ast.unparse(mark) for mark in node.decorator_list)
    }
    assert marked, "no case is marked: the check would pass on nothing"
    assert not marked & _reads_entry(tree)


def mirrored(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """A strategy over `devices` that reduces through one device: TensorFlow's collectives
    allow one group size per process, and the suite's 4-replica strategy has taken it."""
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


MIRRORED = [(4, 100), (2, 37)]


@pytest.mark.parametrize(
    "replicas, length", MIRRORED, ids=[f"{r}-replicas-N={n}" for r, n in MIRRORED]
)
@pytest.mark.parametrize("structure", [Structure, DictInputs], ids=lambda s: s.name)
def test_under_a_mirrored_strategy_fit_trains_what_fit_on_arrays_trains(
    keras, request, devices, structure, replicas, length
):
    # Four replicas: the last batch's 4 real rows go one to each, as Keras splits fit(x, y)'s;
    # two: its 5 real rows go 3 and 2.
    strategy = request.getfixturevalue("strategy") if replicas == 4 else mirrored(devices[:2])
    samples = structure(length)
    with strategy.scope():
        net = samples.model(keras, "adam")
    with fp.Feeder(MapStyle(samples), BATCH, strategy=strategy) as feeder:
        data = fit_input(feeder)
        history = net.fit(data, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    with strategy.scope():
        expected = fit_arrays(keras, samples, optimizer="adam")
    assert_same_fit((net, history), expected)


class GuideTrainStep(Structure):
    """A `train_step` written as Keras's guide writes it, "Customizing what happens in `fit()`"
    on TensorFlow: it unpacks `x, y = data`."""

    name = "guide-train-step"

    def model(self, keras, optimizer="sgd", **compile_options):
        class Guide(keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(gradients, self.trainable_variables)
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, y_pred)
                return {m.name: m.result() for m in self.metrics}

        keras.utils.set_random_seed(1)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.BatchNormalization()(keras.layers.Dense(16)(inputs))
        net = Guide(inputs, keras.layers.Dense(self.length)(hidden))
        return self.compiled(keras, net, optimizer, compile_options)


def test_a_train_step_as_keras_guide_writes_it_trains_what_fit_on_arrays_trains(keras):
    samples = GuideTrainStep()
    fed = fit_feeder(keras, None, samples, "arrays", optimizer="adam")[:2]
    assert_same_fit(fed, fit_arrays(keras, samples, optimizer="adam"))
