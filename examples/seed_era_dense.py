"""The dense model of the old Keras multi-GPU issues, trained data-parallel with `fp.train`.

    python examples/seed_era_dense.py

Those issues timed a plain stack of Dense layers, 8000 inputs and 4000-2000-500-300-1 units,
under `multi_gpu_model` and found it no faster than one GPU. Here the same stack, scaled down
ten-fold (800 inputs, 400-200-50-30-1) so it trains on a two-core CPU in seconds, runs on four
logical CPU devices under MirroredStrategy. 6,000 synthetic samples in global batches of 256
leave a last batch of 112 real rows: it is padded, and the padding weighs nothing. The learning
rate follows `fp.WarmupLinearScaling`: 4x the rate tuned for 64 samples (one replica's batch),
reached linearly over the first epoch. Each epoch prints its mean loss over real samples and
the feeder's input-bound fraction (the share of the epoch the step spent waiting for a batch).
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

INPUTS, UNITS, SAMPLES, GLOBAL_BATCH, EPOCHS = 800, (400, 200, 50, 30), 6000, 256, 5
rng = np.random.default_rng(0)
x = rng.normal(size=(SAMPLES, INPUTS)).astype(np.float32)
y = (x @ rng.normal(size=(INPUTS, 1)) > 0).astype(np.float32)  # a separable binary label

with fp.Feeder((x, y), GLOBAL_BATCH, strategy=strategy, shuffle=True, seed=0) as feeder:
    schedule = fp.WarmupLinearScaling(
        0.01, GLOBAL_BATCH, base_batch_size=GLOBAL_BATCH // 4, warmup_steps=len(feeder)
    )
    print(schedule)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((INPUTS,))]
            + [keras.layers.Dense(units, "relu") for units in UNITS]
            + [keras.layers.Dense(1, "sigmoid")]
        )
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    report = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: print(
            f"epoch {epoch}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.3f}, "
            f"input-bound fraction {logs['input_bound_fraction']:.1%}, "
            f"{logs['steps_per_s']:.1f} steps/s"
        )
    )
    fp.train(
        model,
        feeder,
        loss="binary_crossentropy",
        optimizer=optimizer,
        metrics=["accuracy"],
        epochs=EPOCHS,
        verbose=0,
        callbacks=[report],
    )
    print(feeder.stats())
