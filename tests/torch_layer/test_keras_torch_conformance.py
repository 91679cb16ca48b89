"""Keras on PyTorch: `model.fit(feeder)` conforms to Keras's own `fit(x, y)`
(`tests/keras_conformance.py`), on the device Keras trains on."""

from __future__ import annotations

from tests.keras_conformance import *  # noqa: F403 (every conformance case runs here)
