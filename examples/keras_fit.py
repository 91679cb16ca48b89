"""`model.fit` under MirroredStrategy on `feeder.as_dataset()`.

    python examples/keras_fit.py

`as_dataset()` turns the feeder into a `tf.data.Dataset` of global batches that Keras splits
among the replicas; each pass over it is the feeder's next epoch. 1,000 samples in batches of
64 leave a last batch of 40 real rows, padded to 64 so every replica runs the same steps. For
an `(x, y)` source the dataset yields `(x, y, sample_weight)`: the weight is 0 on padded rows
and `64 / num_valid` on real ones, so each batch's loss is the mean over its real samples.
Metrics must be `weighted_metrics` to skip the padding too (plain `metrics` would count it).
`feeder.fit_callback()` tells the feeder which batches the step trained on (TensorFlow and
Keras read ahead), so a checkpoint holding the feeder, written by any callback, resumes exactly.
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
centers = rng.normal(size=(10, 64)).astype(np.float32)
labels = (np.arange(1000) % 10).astype(np.int32)
features = centers[labels] + rng.normal(scale=2.0, size=(1000, 64)).astype(np.float32)

with strategy.scope():
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, "relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )

with fp.Feeder((features, labels), 64, strategy=strategy, shuffle=True, seed=0) as feeder:
    dataset = feeder.as_dataset()
    print(dataset.element_spec)  # (x, y, sample_weight), global batches of 64
    model.fit(dataset, epochs=3, verbose=2, callbacks=[feeder.fit_callback()])
    print(feeder.get_state())  # the batches the step trained on: epoch 3, step 0
    print(feeder.stats())
