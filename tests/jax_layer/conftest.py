"""JAX tests: four host devices (set by tests/conftest.py before JAX starts), and Keras on JAX
where Keras's backend is JAX (the CI's JAX step has no TensorFlow, so Keras runs on JAX without
KERAS_BACKEND; in the TensorFlow run Keras is already on TensorFlow, so those tests are skipped
there with the reason)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

jax = pytest.importorskip("jax")


def keras_on_jax() -> bool:
    """Whether Keras runs (or, imported through feedpipe, will run) on JAX: its backend where it
    is loaded; else `KERAS_BACKEND`; else JAX where TensorFlow is not installed."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend() == "jax"
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"] == "jax"
    return importlib.util.find_spec("tensorflow") is None


@pytest.fixture
def keras():
    """Keras on JAX, with no distribution set before or after the test."""
    if not keras_on_jax():
        pytest.skip("needs Keras on JAX: where TensorFlow is installed, KERAS_BACKEND=jax")
    from feedpipe._frameworks import import_keras

    keras = import_keras("the Keras-on-JAX tests")
    keras.distribution.set_distribution(None)
    yield keras
    keras.distribution.set_distribution(None)


@pytest.fixture(scope="session")
def devices():
    """The four host devices JAX was started with."""
    found = jax.devices()
    assert len(found) == 4, "XLA_FLAGS must give JAX 4 host devices (tests/conftest.py)"
    return found


@pytest.fixture
def keras_devices(devices):
    """The one device Keras on JAX trains on without a distribution
    (`tests/keras_fit_promises.py`)."""
    return devices[:1]
