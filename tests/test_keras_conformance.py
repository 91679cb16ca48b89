"""Keras on TensorFlow: `model.fit(feeder)` conforms to Keras's own `fit(x, y)`
(`tests/keras_conformance.py`), on Keras's default device."""

from __future__ import annotations

import pytest

import feedpipe as fp
from tests.keras_conformance import *  # noqa: F403 (every conformance case runs here)
from tests.keras_conformance import (
    BATCH,
    DictInputs,
    MapStyle,
    Structure,
    assert_same_fit,
    fit_arrays,
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


@pytest.mark.parametrize("structure", [Structure, DictInputs], ids=lambda s: s.name)
def test_under_a_mirrored_strategy_fit_trains_what_fit_on_arrays_trains(keras, strategy, structure):
    # Four replicas: the last batch's 4 real rows go one to each, as Keras splits fit(x, y)'s.
    samples = structure()
    with strategy.scope():
        net = samples.model(keras, "adam")
    with fp.Feeder(MapStyle(samples), BATCH, strategy=strategy) as feeder:
        history = net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    with strategy.scope():
        expected = fit_arrays(keras, samples, optimizer="adam")
    assert_same_fit((net, history), expected)
