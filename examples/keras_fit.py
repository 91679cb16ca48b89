"""`model.fit` under MirroredStrategy on `feeder.as_dataset()`.

    python examples/keras_fit.py

`as_dataset()` turns the feeder into a `tf.data.Dataset` of global batches that Keras splits
among the replicas; each pass over it is the feeder's next epoch. 1,000 samples in batches of
64 leave a last batch of 40 rows, which goes to Keras as those 40 rows, as `model.fit(x, y)`
gives it: the loss, the metrics and the History see the samples alone.
`as_dataset(pad_last=True)` pads it to 64 instead (static shapes), with an added
`sample_weight` of 0 on the padding rows (see docs/fit.md for what that changes).
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
    print(dataset.element_spec)  # (x, y), global batches of up to 64 rows
    model.fit(dataset, epochs=3, verbose=2, callbacks=[feeder.fit_callback()])
    print(feeder.get_state())  # the batches the step trained on: epoch 3, step 0
    print(feeder.stats())
