"""Keras on JAX: `model.fit(feeder)` conforms to Keras's own `fit(x, y)`
(`tests/keras_conformance.py`), on the one device Keras trains on without a distribution."""

from __future__ import annotations

from tests.keras_conformance import *  # noqa: F403 (every conformance case runs here)
