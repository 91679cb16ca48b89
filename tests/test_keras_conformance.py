"""Keras on TensorFlow: `model.fit(feeder)` conforms to Keras's own `fit(x, y)`
(`tests/keras_conformance.py`), on Keras's default device."""

from __future__ import annotations

import pytest

from tests.keras_conformance import *  # noqa: F403 (every conformance case runs here)


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
