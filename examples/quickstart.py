"""Quick start: numpy arrays in, per-replica batches already on their devices out.

Four logical CPU devices stand in for four GPUs, so this runs anywhere:

    python examples/quickstart.py

Each global batch of 64 is built on the host, cut into four sub-batches of 16 there, and each
sub-batch is staged on its own device before the loop asks for it. The dataset (1,000 samples)
is not a multiple of 64, so the last batch of the epoch is padded and its mask marks the padding.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import feedpipe as fp

# Logical devices must be made before TensorFlow starts. On a GPU machine, skip this and pass
# devices=["/gpu:0", "/gpu:1", ...] (or nothing: the feeder then uses every GPU).
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
DEVICES = [f"/cpu:{i}" for i in range(4)]

rng = np.random.default_rng(0)
images = rng.random((1000, 28, 28), dtype=np.float32)
labels = (np.arange(1000) % 10).astype(np.int32)

with fp.Feeder((images, labels), 64, devices=DEVICES, shuffle=True, seed=0) as feeder:
    print(feeder)
    print(f"{len(feeder)} steps per epoch\n")
    for batch in feeder:
        if batch.step not in (0, len(feeder) - 1):
            continue  # a training step would run here on every batch
        print(f"step {batch.step}: {batch.num_valid} real samples")
        for (x, y), mask, device in zip(batch.replicas, batch.masks, DEVICES, strict=True):
            real = int(tf.reduce_sum(tf.cast(mask, tf.int32)))
            print(f"  {device}: x {x.shape} on {x.device}, y {y.shape}, {real} real rows")
