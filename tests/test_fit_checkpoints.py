"""Checkpoints under `model.fit(feeder.as_dataset())` hold the batches the step trained on.

TensorFlow and Keras take batches ahead of the step, so during `fit` the feeder knows which it
handed out, not which were trained on; `feeder.fit_callback()` tells it. A state read in any
callback, saved at every step, restores in a new process to the run never interrupted; forgetting
the callback is an error that names it.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from tests import fit_resume_worker as worker
from tests.fakes import regression_data
from tests.processes import log_tail, run_at_once

# Each promise holds on both ways as_dataset() serves arrays.
pytestmark = pytest.mark.usefixtures("as_dataset_path")

DEADLINE_S = 240.0
"""Hard deadline of one worker process: ~5 s of TensorFlow import and a few of training, on a
machine shared with other test runs."""
STEPS = -(-worker.LENGTH // worker.GLOBAL_BATCH)
"""Steps per epoch, the last one padded."""


def mirrored(devices) -> tf.distribute.MirroredStrategy:
    """A strategy that reduces through one device (see tests/test_training.py)."""
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def compiled_model(strategy, steps_per_execution: int = 1, **compile_args) -> keras.Model:
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=steps_per_execution, **compile_args)
    return model


class StateAtEveryStep(keras.callbacks.Callback):
    """Reads the feeder's state after every step and every epoch, as checkpoint callbacks do."""

    def __init__(self, feeder):
        super().__init__()
        self.feeder, self.seen = feeder, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        state = self.feeder.get_state()
        self.seen.append(((self.epoch, batch), (state["epoch"], state["step"])))

    def on_epoch_end(self, epoch, logs=None):
        state = self.feeder.get_state()
        self.seen.append(((epoch, "end"), (state["epoch"], state["step"])))


def expected_states(epochs: int, steps_per_execution: int) -> list:
    """After Keras's steps `begin` to `begin + k - 1` of epoch `e`, the feeder is that many
    batches into `e` (the last call of an epoch may run fewer)."""
    expected = []
    for epoch in range(epochs):
        for begin in range(0, STEPS, steps_per_execution):
            taken = min(begin + steps_per_execution, STEPS)
            state = (epoch + 1, 0) if taken == STEPS else (epoch, taken)
            expected.append(((epoch, begin + steps_per_execution - 1), state))
        expected.append(((epoch, "end"), (epoch + 1, 0)))
    return expected


@pytest.mark.parametrize(
    ("replicas", "steps_per_execution"),
    # Keras 3.15 cannot run steps_per_execution > 1 under a MirroredStrategy of several
    # replicas (keras-team/keras#19246), so that case is left out.
    [(1, 1), (1, 3), (4, 1)],
    ids=["no-strategy", "no-strategy-3-steps-per-execution", "mirrored-4"],
)
def test_a_state_read_in_any_callback_is_the_batches_the_step_trained_on(
    devices, replicas, steps_per_execution
):
    strategy = mirrored(devices) if replicas > 1 else tf.distribute.get_strategy()
    model = compiled_model(strategy, steps_per_execution)
    x, y = regression_data(worker.LENGTH)
    with fp.Feeder(
        (x, y), worker.GLOBAL_BATCH, strategy=strategy if replicas > 1 else None, shuffle=True
    ) as feeder:
        reader = StateAtEveryStep(feeder)  # before the feeder's callback: order does not matter
        model.fit(
            feeder.as_dataset(), epochs=2, verbose=0, callbacks=[reader, feeder.fit_callback()]
        )
        assert reader.seen == expected_states(2, steps_per_execution)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (2, 0)


def test_reading_the_state_in_a_fit_without_the_fit_callback_is_an_error_naming_it(devices):
    model = compiled_model(tf.distribute.get_strategy())
    with fp.Feeder(regression_data(worker.LENGTH), worker.GLOBAL_BATCH) as feeder:
        with pytest.raises(RuntimeError, match=r"callbacks=\[feeder\.fit_callback\(\)"):
            model.fit(
                feeder.as_dataset(), epochs=1, verbose=0, callbacks=[StateAtEveryStep(feeder)]
            )
        with pytest.raises(RuntimeError, match=r"fit_callback"):
            feeder.get_state()  # after the fit, too: Keras read batches it never trained on
        next(iter(feeder))  # a loop of the feeder's own settles the position
        feeder.get_state()


def test_a_restore_mid_epoch_inside_fit_is_refused_with_the_two_fits_that_resume_it(devices):
    x, y = regression_data(worker.LENGTH)
    with fp.Feeder((x, y), worker.GLOBAL_BATCH) as feeder:
        for _ in range(2):
            next(iter(feeder))
        state = feeder.get_state()

    class Restore(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            feeder.set_state(state)

    model = compiled_model(tf.distribute.get_strategy())
    with (
        fp.Feeder((x, y), worker.GLOBAL_BATCH) as feeder,
        pytest.raises(
            ValueError,
            match=r"at step 2 of epoch 0.*initial_epoch=0, epochs=1\), then .*initial_epoch=1",
        ),
    ):
        model.fit(
            feeder.as_dataset(),
            epochs=2,
            verbose=0,
            callbacks=[Restore(), feeder.fit_callback()],
        )


def run_ok(runs: dict[str, list[str]], out: Path) -> None:
    """Runs the worker with each of `runs`' arguments at once; each must exit cleanly."""
    for name, code in run_at_once(worker.__file__, runs, out, DEADLINE_S).items():
        assert code == 0, log_tail(out, name)


def saved(path: Path) -> tuple[list[np.ndarray], int]:
    with np.load(path) as arrays:
        count = sum(name.startswith("weight_") for name in arrays.files)
        return [arrays[f"weight_{i}"] for i in range(count)], int(arrays["iterations"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "steps_per_execution"),
    [("none", 1), ("none", 2), ("mirrored", 1)],
)
def test_a_fit_resumed_in_a_new_process_from_a_checkpoint_ends_on_the_uninterrupted_weights(
    tmp_path, strategy, steps_per_execution
):
    config = [strategy, str(steps_per_execution)]
    runs = {"full": tmp_path / "full", "resume": tmp_path / "resume", "backup": tmp_path / "backup"}
    for folder in runs.values():
        folder.mkdir()
    run_ok({"full": ["full", *config, str(runs["full"])]}, tmp_path)
    mid_epoch = runs["full"] / "ckpt-1-2"  # written after step 1 of epoch 1 (2 of its 5 taken)
    epoch_end = runs["full"] / "ckpt-1-0"  # written when epoch 0 ended
    assert mid_epoch.with_suffix(".index").exists() and epoch_end.with_suffix(".index").exists()
    run_ok(
        {
            "resume": ["resume", *config, str(runs["resume"]), str(mid_epoch)],
            "backup": ["backup", *config, str(runs["backup"]), str(epoch_end)],
        },
        tmp_path,
    )
    full_weights, full_iterations = saved(runs["full"] / "full.npz")
    assert full_iterations == worker.EPOCHS * STEPS
    for mode in ("resume", "backup"):
        weights, iterations = saved(runs[mode] / f"{mode}.npz")
        assert iterations == full_iterations, mode  # every step trained exactly once
        for actual, expected in zip(weights, full_weights, strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-6, err_msg=mode)


class InterruptAfter(keras.callbacks.Callback):
    """Raises KeyboardInterrupt after step `after` of the first epoch, as Ctrl-C does."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.after:
            raise KeyboardInterrupt


def interrupted_fit(feeder, features: int = 6) -> keras.Model:
    """A fit of 2 epochs on `feeder.as_dataset()` that Ctrl-C ends after step 2 of the first."""
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            feeder.as_dataset(),
            epochs=2,
            verbose=0,
            callbacks=[feeder.fit_callback(), InterruptAfter(2)],
        )
    return model


def test_a_fit_interrupted_by_ctrl_c_leaves_the_batches_it_trained_on_and_a_rerun_goes_on():
    x, y = regression_data(64)
    with fp.Feeder((x, y), 8) as feeder:
        model = interrupted_fit(feeder)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 3)
        # Re-running the cell: the rest of the interrupted epoch, in a fit of its own.
        model.fit(feeder.as_dataset(), epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)


def test_a_loop_after_a_fit_interrupted_by_ctrl_c_takes_the_rest_of_its_epoch():
    ids = np.arange(64, dtype=np.float32)[:, None]  # each sample's feature is its index
    with fp.Feeder((ids, regression_data(64)[1]), 8) as feeder:
        interrupted_fit(feeder, features=1)
        rest = [int(i) for batch in feeder for i in batch.replicas[0][0].numpy()[:, 0]]
        assert rest == list(range(24, 64))
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
