"""PyTorch tests: skipped where PyTorch is not installed (the TensorFlow and JAX runs); the CI's
torch step runs them with neither TensorFlow nor JAX installed. Keras's tests take the `keras`
fixture: Keras on PyTorch, or a skip that says why."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def keras():
    """Keras on PyTorch: where Keras is not loaded yet and no backend was asked for,
    `KERAS_BACKEND=torch` is set before it is imported; skipped where Keras is not installed
    or already runs on another backend."""
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip(f"needs Keras on PyTorch; here it runs on {keras.backend.backend()}")
    return keras


@pytest.fixture
def keras_devices():
    """The one device Keras on PyTorch trains on here (`tests/keras_fit_promises.py`)."""
    return [torch.device("cpu")]
