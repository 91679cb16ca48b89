"""A custom training loop under MirroredStrategy, fed by `fp.Feeder`.

    python examples/custom_loop_mirrored.py

The feeder is built with `strategy=`, so it stages each replica's rows on that replica's device;
`batch.distributed()` hands them to `strategy.run` as per-replica values, with no
`experimental_distribute_dataset` in between. 1,000 samples in batches of 128 leave a last
batch of 104 real rows: the mask zeroes the padding's loss and dividing by `num_valid` (the real
samples of the whole global batch) makes every step the mean over its real samples.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import feedpipe as fp

cpu = tf.config.list_physical_devices("CPU")[0]  # four logical CPU devices stand in for GPUs
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 32)).astype(np.float32)
y = (x @ rng.normal(size=(32, 1)) + 0.1 * rng.normal(size=(1000, 1))).astype(np.float32)

with strategy.scope():
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)  # slots must exist before tracing the step


def replica_step(inputs, mask, num_valid):
    features, targets = inputs
    with tf.GradientTape() as tape:
        errors = tf.reduce_mean(tf.square(model(features, training=True) - targets), axis=-1)
        loss = tf.reduce_sum(tf.where(mask, errors, 0.0)) / num_valid  # padding weighs nothing
    gradients = tape.gradient(loss, model.trainable_variables)
    # Under the strategy the optimizer sums the replicas' gradients before applying them.
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
    return loss


@tf.function
def train_step(inputs, mask, num_valid):
    losses = strategy.run(replica_step, args=(inputs, mask, num_valid))
    return strategy.reduce("SUM", losses, axis=None)


with fp.Feeder((x, y), global_batch_size=128, strategy=strategy, shuffle=True) as feeder:
    for epoch in range(5):
        total, samples = 0.0, 0
        for batch in feeder:
            inputs, mask = batch.distributed()
            loss = train_step(inputs, mask, tf.constant(batch.num_valid, tf.float32))
            total, samples = total + float(loss) * batch.num_valid, samples + batch.num_valid
        print(f"epoch {epoch}: mean squared error {total / samples:.4f} over {samples} samples")
    print(feeder.stats())
