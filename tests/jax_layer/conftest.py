"""JAX tests: four host devices (set by tests/conftest.py before JAX starts), and Keras on JAX
where Keras's backend is JAX (the CI's JAX step sets KERAS_BACKEND=jax; in the TensorFlow run
Keras is already on TensorFlow, so those tests are skipped there with the reason)."""

from __future__ import annotations

import os
import sys

import pytest

jax = pytest.importorskip("jax")


def keras_on_jax() -> bool:
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend() == "jax"
    return os.environ.get("KERAS_BACKEND") == "jax"


@pytest.fixture
def keras():
    """Keras on JAX, with no distribution set before or after the test."""
    if not keras_on_jax():
        pytest.skip("needs Keras on JAX: run with KERAS_BACKEND=jax (the CI's JAX step does)")
    import keras

    keras.distribution.set_distribution(None)
    yield keras
    keras.distribution.set_distribution(None)


@pytest.fixture(scope="session")
def devices():
    """The four host devices JAX was started with."""
    found = jax.devices()
    assert len(found) == 4, "XLA_FLAGS must give JAX 4 host devices (tests/conftest.py)"
    return found
