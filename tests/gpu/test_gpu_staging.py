"""On a real GPU: each replica's rows land on its GPU bit for bit (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp

pytestmark = pytest.mark.gpu


def test_each_replica_gets_its_own_rows_on_its_gpu():
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 5)).astype(np.float32)
    y = np.arange(37)
    global_batch = 4 * len(gpus)
    with fp.Feeder((x, y), global_batch, devices=gpus) as feeder:
        assert feeder.devices == tuple(gpus)
        for batch in feeder:
            for r, ((features, labels), mask) in enumerate(
                zip(batch.replicas, batch.masks, strict=True)
            ):
                assert features.device.endswith(f"GPU:{r}") and mask.device.endswith(f"GPU:{r}")
                ids = labels.numpy()
                assert features.numpy().tobytes() == x[ids].tobytes()
