"""The tower way: one model, a tape per device, `fp.TowerStep` on each staged batch.

    python examples/tower_step.py

Before `tf.distribute`, multi-GPU Keras meant wrappers (`make_parallel`, `multi_gpu_model`,
`DataParallelModel`) that ran a copy of the model, a "tower", on each device over a slice of
the batch and merged the results. `fp.TowerStep` keeps that shape, one set of variables and
`batch.replicas[i]` consumed on `devices[i]`, without what went wrong:

- The wrappers copied the whole batch to every device and sliced it there, and a batch that
  did not divide evenly lost rows or crashed. The feeder cuts each batch on the host and stages
  only its own rows on each device; a last partial batch is padded to full shape and masked.
- Averaging each tower's *mean* loss weighs a tower of 8 real rows like one of 32. Here each
  tower's loss is its share of the global mean over real samples: its real rows' losses summed
  and divided by `num_valid`, the real samples of the whole global batch. Padded rows weigh
  exactly zero.
- The towers' gradients are summed once and applied once, so each step is the step one device
  would take on the whole global batch (tests/test_training.py checks the weights match).

1,000 samples in batches of 128 leave a last batch of 104 real rows; the script prints how
they fall on the four towers.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import feedpipe as fp

cpu = tf.config.list_physical_devices("CPU")[0]  # four logical CPU devices stand in for GPUs
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
DEVICES = [f"/cpu:{i}" for i in range(4)]

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 32)).astype(np.float32)
y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(1000, 1))).astype(np.float32)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((32,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(1)]
)

with fp.Feeder((x, y), global_batch_size=128, devices=DEVICES, shuffle=True) as feeder:
    step = fp.TowerStep(model, "mse", keras.optimizers.Adam(1e-2), feeder.devices)
    for epoch in range(5):
        total, samples = 0.0, 0
        for batch in feeder:
            loss = step(batch)  # the mean over the batch's real samples
            total, samples = total + float(loss) * batch.num_valid, samples + batch.num_valid
        print(f"epoch {epoch}: mean squared error {total / samples:.4f} over {samples} samples")
    towers = [int(tf.math.count_nonzero(mask)) for mask in batch.masks]
    print(f"last batch: {batch.num_valid} real rows, per tower {towers}")
    print(feeder.stats())
