"""The JAX + optax example: a jitted step on the sharded global batch, a mask-weighted mean
loss and the warm-up linear-scaling rule give the same parameters on 4 devices as on 1."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

from tests.processes import REPO_ROOT

pytest.importorskip("optax")


def example():
    path = REPO_ROOT / "examples" / "jax_custom_loop.py"
    spec = importlib.util.spec_from_file_location("jax_custom_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_four_devices_train_the_same_parameters_as_one(devices):
    loop = example()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 20)).astype(np.float32)  # 300 = 4 batches of 64 and a padded one
    y = x[:, :10].argmax(1).astype(np.int32)
    one = loop.train(x, y, devices[:1], epochs=2)
    four = loop.train(x, y, devices, epochs=2)
    for name in one:
        mine, theirs = np.asarray(one[name]), np.asarray(four[name])
        np.testing.assert_allclose(mine, theirs, rtol=2e-5, atol=2e-6)
    # Training moved the parameters: the comparison is of something learnt.
    start = loop.init(jax.random.key(0), 20, 10)
    assert not np.allclose(np.asarray(one["w2"]), np.asarray(start["w2"]))


def test_real_rows_are_the_sources_rows_and_refused_on_several_devices(devices):
    import feedpipe as fp

    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20, dtype=np.int32)
    with fp.Feeder((x, y), 8, devices=devices[:1]) as feeder:
        rows = [batch.real_rows() for batch in feeder]
    assert [len(bx) for bx, _ in rows] == [8, 8, 4]
    np.testing.assert_array_equal(np.concatenate([np.asarray(bx) for bx, _ in rows]), x)
    np.testing.assert_array_equal(np.concatenate([np.asarray(by) for _, by in rows]), y)
    with fp.Feeder((x, y), 8, devices=devices[:2]) as feeder:
        batch = next(iter(feeder))
        with pytest.raises(ValueError, match=r"spans 2 devices.*batch\.distributed\(\)"):
            batch.real_rows()
        with pytest.raises(TypeError, match=r"batch\.real_rows\(\).*batch\.distributed\(\)"):
            _bx, _by = batch
