"""On a real GPU: each replica's rows land on its GPU bit for bit (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import feedpipe as fp

tf = pytest.importorskip("tensorflow", reason="the TensorFlow GPU tests need TensorFlow")

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


def test_a_kept_gpu_batch_keeps_its_values_while_its_host_slot_is_reused():
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    with fp.Feeder(x, 2 * len(gpus), devices=gpus, depth=1) as feeder:
        batches = iter(feeder)
        first = next(batches)
        expected = [replica.numpy() for replica in first.replicas]
        for _ in range(10):  # enough batches to cycle every host slot several times
            next(batches)
        assert [replica.numpy().tobytes() for replica in first.replicas] == [
            e.tobytes() for e in expected
        ]
