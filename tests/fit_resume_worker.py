"""`model.fit(feeder.as_dataset())` checkpointed at every step, and resumed in new processes.

    python tests/fit_resume_worker.py MODE STRATEGY STEPS_PER_EXECUTION OUT_DIR [CHECKPOINT]

STRATEGY is `none` or `mirrored` (4 logical CPUs); MODE is one of:

- `full`: trains `EPOCHS` epochs uninterrupted with `feeder.fit_callback()` last among the
  callbacks; before it, a callback writes `tf.train.Checkpoint(model=, optimizer=, feeder=)` after
  every step (`on_train_batch_end`, as `ModelCheckpoint(save_freq=1)` would) and every epoch
  (`on_epoch_end`, as `BackupAndRestore` does), each to `OUT_DIR/ckpt-<epoch>-<step>` named after
  the feeder's state it holds. Saves the final weights to `full.npz`.
- `resume`: a new process restores CHECKPOINT before training, then fits the rest: a checkpoint
  taken mid-epoch first finishes that epoch in a fit of its own (Keras runs every epoch of a fit
  for the same number of steps), then fits the remaining epochs. Saves `resume.npz`.
- `backup`: a new process whose callback restores CHECKPOINT (taken at the end of an epoch) in
  `on_train_begin` and sets the epoch to start from, as `BackupAndRestore` does, inside one fit.
  Saves `backup.npz`.

Each `.npz` holds the weights (`weight_0`, ...) and the optimizer's `iterations`. Driven by
`test_fit_checkpoints.py`.
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
MODES = ("full", "resume", "backup")


class SaveEveryStep(keras.callbacks.Callback):
    """Writes the checkpoint after every step and every epoch, named after the feeder's state."""

    def __init__(self, checkpoint: tf.train.Checkpoint, feeder: fp.Feeder, out: Path):
        super().__init__()
        self.checkpoint, self.feeder, self.out = checkpoint, feeder, out

    def save(self) -> None:
        state = self.feeder.get_state()
        self.checkpoint.write(str(self.out / f"ckpt-{state['epoch']}-{state['step']}"))

    def on_train_batch_end(self, batch, logs=None):
        self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.save()


class RestoreOnTrainBegin(keras.callbacks.Callback):
    """Restores the checkpoint when the fit begins and starts from its epoch (BackupAndRestore)."""

    def __init__(self, checkpoint: tf.train.Checkpoint, feeder: fp.Feeder, path: str):
        super().__init__()
        self.checkpoint, self.feeder, self.path = checkpoint, feeder, path

    def on_train_begin(self, logs=None):
        self.checkpoint.read(self.path).assert_consumed()
        self.model._initial_epoch = self.feeder.get_state()["epoch"]


def main(mode: str, strategy_name: str, steps_per_execution: int, out: Path, path: str) -> None:
    configure_logical_cpus(NUM_DEVICES)
    strategy = (
        tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(NUM_DEVICES)],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
        if strategy_name == "mirrored"
        else tf.distribute.get_strategy()
    )
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(keras.optimizers.Adam(0.05), "mse", steps_per_execution=steps_per_execution)
        model.optimizer.build(model.trainable_variables)
    feeder = fp.Feeder(
        regression_data(LENGTH),
        GLOBAL_BATCH,
        strategy=None if strategy_name == "none" else strategy,
        shuffle=True,
        seed=1,
    )
    with feeder:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, feeder=feeder)
        track = feeder.fit_callback()
        if mode == "full":
            callbacks = [SaveEveryStep(checkpoint, feeder, out), track]
            model.fit(feeder.as_dataset(), epochs=EPOCHS, verbose=0, callbacks=callbacks)
        elif mode == "backup":
            callbacks = [RestoreOnTrainBegin(checkpoint, feeder, path), track]
            model.fit(feeder.as_dataset(), epochs=EPOCHS, verbose=0, callbacks=callbacks)
        else:
            checkpoint.read(path).assert_consumed()
            epoch, step = feeder.get_state()["epoch"], feeder.get_state()["step"]
            if step:
                model.fit(
                    feeder.as_dataset(),
                    initial_epoch=epoch,
                    epochs=epoch + 1,
                    verbose=0,
                    callbacks=[track],
                )
                epoch += 1
            model.fit(
                feeder.as_dataset(),
                initial_epoch=epoch,
                epochs=EPOCHS,
                verbose=0,
                callbacks=[track],
            )
    np.savez(
        out / f"{mode}.npz",
        **{f"weight_{i}": w.numpy() for i, w in enumerate(model.weights)},
        iterations=model.optimizer.iterations.numpy(),
    )


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6) or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} none|mirrored K OUT_DIR [CKPT]")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), *sys.argv[5:6] or [""])
