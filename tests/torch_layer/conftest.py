"""PyTorch tests: skipped where PyTorch is not installed (the TensorFlow and JAX runs); the CI's
torch step runs them with neither TensorFlow nor JAX installed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
