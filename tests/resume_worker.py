"""One data-parallel training run that can be killed mid-epoch and resumed in a new process.

    python tests/resume_worker.py MODE OUT_DIR

MODE is one of:

- `full`: trains `EPOCHS` epochs uninterrupted and saves the final weights to `full.npz`.
- `crash`: trains until `CRASH_AFTER` (a step of epoch 1), writes
  `tf.train.Checkpoint(model=, optimizer=, feeder=)` to `OUT_DIR/checkpoint` and dies with
  `os._exit(CRASH_EXIT_CODE)`: no cleanup, no `finally`, as a killed job.
- `resume`: rebuilds everything, restores that checkpoint, trains the rest of the run and saves
  the final weights to `resume.npz`.
- `resume-without-feeder`: the same, but restores only the model and the optimizer (the
  feeder starts from the beginning, as Keras's `BackupAndRestore` does); saves
  `resume-without-feeder.npz`.

Each `.npz` holds the weights (`weight_0`, ...), the optimizer's `iterations` and `started_at`,
the feeder's (epoch, step) when training began. Driven by `test_training_resume.py`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import feedpipe as fp
from tests.fakes import configure_logical_cpus, regression_data

NUM_DEVICES = 4
LENGTH = 37
"""Not a multiple of the global batch: every epoch ends on a padded batch of 5 real rows."""
GLOBAL_BATCH = 8
EPOCHS = 3
CRASH_AFTER = (1, 2)
"""(epoch, step): the crash follows step 2 of epoch 1, so the feeder has taken 3 of its 5."""
CRASH_EXIT_CODE = 17
MODES = ("full", "crash", "resume", "resume-without-feeder")


class CrashAfter(keras.callbacks.Callback):
    """Checkpoints after `CRASH_AFTER` and kills the process; the feeder counts that step taken."""

    def __init__(self, checkpoint: tf.train.Checkpoint, path: Path):
        super().__init__()
        self.checkpoint, self.path, self.epoch = checkpoint, path, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == CRASH_AFTER:
            self.checkpoint.write(str(self.path))
            os._exit(CRASH_EXIT_CODE)


def main(mode: str, out: Path) -> None:
    configure_logical_cpus(NUM_DEVICES)
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(NUM_DEVICES)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)]
        )
        optimizer = keras.optimizers.Adam(0.05)
        # With Adam's moments built before the restore, `assert_consumed` can check that every
        # saved value found its variable (otherwise the restore waits for their creation).
        optimizer.build(model.trainable_variables)
    with fp.Feeder(
        regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy, shuffle=True, seed=1
    ) as feeder:
        callbacks = []
        if mode == "crash":
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, feeder=feeder)
            callbacks.append(CrashAfter(checkpoint, out / "checkpoint"))
        elif mode == "resume":
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, feeder=feeder)
            checkpoint.read(str(out / "checkpoint")).assert_consumed()
        elif mode == "resume-without-feeder":
            checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
            checkpoint.read(str(out / "checkpoint")).expect_partial()
        started = feeder.get_state()
        # From the feeder's position: the first pass is the rest of the restored epoch.
        fp.Trainer(model, "mse", optimizer, strategy=strategy).fit(
            feeder, EPOCHS, initial_epoch=started["epoch"], verbose=0, callbacks=callbacks
        )
    np.savez(
        out / f"{mode}.npz",
        **{f"weight_{i}": w.numpy() for i, w in enumerate(model.weights)},
        iterations=optimizer.iterations.numpy(),
        started_at=np.array([started["epoch"], started["step"]]),
    )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} OUT_DIR")
    main(sys.argv[1], Path(sys.argv[2]))
