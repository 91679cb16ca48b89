"""Targets for `feedpipe diagnose`: a small Keras model fed by a slow Python source.

    feedpipe diagnose examples/diagnose_target.py:slow_reads --report /tmp/feedpipe-report
    feedpipe diagnose examples/diagnose_target.py:arrays --json

A target is a function that returns `(input, step)`: the input (an fp.Feeder, tf.data.Dataset,
keras PyDataset or any iterable of batches) and the step (a compiled Keras model, trained as
`model.fit` trains it, or a callable taking one batch). `slow_reads` reads each sample after a
1 ms wait, as a slow disk or a remote store would: highly input-bound, with remedies. `arrays`
feeds the same model from memory: not input-bound on a quiet machine; where other load
changes the step's speed during the run, "cannot tell" with its bound. For `arrays`, diagnose
also times Keras's own array input (what `model.fit(x, y)` runs) in turn with the feeder, and
suggests it where it is clearly faster.
"""

import time

import keras
import numpy as np

import feedpipe as fp

BATCH = 64
images = np.random.default_rng(0).random((4096, 16, 16, 3), dtype=np.float32)
labels = np.arange(len(images)) % 10


class SlowReads:
    """The same images and labels, each sample read after a 1 ms wait."""

    def __len__(self):
        return len(images)

    def __getitem__(self, index):
        time.sleep(0.001)
        return images[index], labels[index]


def model() -> keras.Model:
    """A small CNN, compiled: its step is what diagnose times."""
    net = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    net.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return net


def slow_reads():
    return fp.Feeder(SlowReads(), BATCH, devices=["/cpu:0"]), model()


def arrays():
    return fp.Feeder((images, labels), BATCH, devices=["/cpu:0"]), model()
