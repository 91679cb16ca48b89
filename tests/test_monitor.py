"""StarvationMonitor against ground truth: a step that sleeps a known time S inside the compiled
step, fed by producers that take a known time P per batch, through every kind of input `fit`
takes. Sleeps release the GIL, so the figures hold on a loaded machine."""

from __future__ import annotations

import contextlib
import itertools
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe import monitor as monitor_module
from feedpipe.stats import HIGH_FRACTION, MODERATE_FRACTION
from tests.fakes import CountingSource, index_arrays, sleeping_model

STEP_S = 0.04
"""The emulated step: long enough that Keras's own overhead per step is a small part of it."""
BATCH = 8
STEPS = 16
"""Steps per epoch: 14 timed in the first epoch (the first call traces, the second takes the
headspace batch)."""
INPUT_KINDS = ["tf.data", "PyDataset", "generator", "Feeder"]


def _slow(seconds: float):
    def wait(x):
        time.sleep(seconds)
        return x

    return wait


def slow_tf_data(batch_s: float, steps: int = STEPS) -> tf.data.Dataset:
    def slow(x, y):
        x = tf.numpy_function(_slow(batch_s), [x], tf.float32, stateful=True)
        x.set_shape((None, 3))
        return x, y

    return (
        tf.data.Dataset.from_tensor_slices(index_arrays(steps * BATCH))
        .batch(BATCH)
        .map(slow)
        .prefetch(tf.data.AUTOTUNE)
    )


class SlowPyDataset(keras.utils.PyDataset):
    def __init__(self, batch_s: float, steps: int = STEPS):
        super().__init__()
        self.batch_s = batch_s
        self.steps = steps
        self.x, self.y = index_arrays(steps * BATCH)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, number: int):
        time.sleep(self.batch_s)
        rows = slice(number * BATCH, (number + 1) * BATCH)
        return self.x[rows], self.y[rows]


def slow_generator(batch_s: float):
    x, y = index_arrays(STEPS * BATCH)
    for number in itertools.cycle(range(STEPS)):
        time.sleep(batch_s)
        yield x[number * BATCH : (number + 1) * BATCH], y[number * BATCH : (number + 1) * BATCH]


class SlowBatchSource(CountingSource):
    """A map-style source that sleeps `batch_s` on the first sample of each batch: one
    GIL-free wait per batch, as the other producers here make."""

    def __init__(self, length: int, batch_s: float):
        super().__init__(length)
        self.batch_s = batch_s

    def __getitem__(self, index: int):
        if index % BATCH == 0:
            time.sleep(self.batch_s)
        return super().__getitem__(index)


class WallClock(keras.callbacks.Callback):
    """Ground truth the monitor does not see: when each call of the step returned."""

    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def step_s(self) -> float:
        """Mean seconds per step from the end of the third call to the last one."""
        return (self.ends[-1] - self.ends[2]) / (len(self.ends) - 3)


def fit_monitored(kind: str, batch_s: float) -> tuple[fp.StarvationMonitor, WallClock]:
    """One epoch of `STEPS` steps fed by `kind`, each batch taking `batch_s` to make."""
    model = sleeping_model(STEP_S)
    clock = WallClock()
    if kind == "Feeder":
        source = SlowBatchSource(STEPS * BATCH, batch_s)
        with fp.Feeder(source, BATCH, devices=["/cpu:0"]) as feeder:
            monitor = fp.StarvationMonitor(verbose=0, feeder=feeder)
            model.fit(
                feeder.as_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[monitor, clock]
            )
        return monitor, clock
    monitor = fp.StarvationMonitor(verbose=0)
    data, steps = {
        "tf.data": (slow_tf_data(batch_s), None),
        "PyDataset": (SlowPyDataset(batch_s), None),
        "generator": (slow_generator(batch_s), STEPS),
    }[kind]
    model.fit(
        data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[monitor, clock]
    )
    return monitor, clock


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_three_times_slower_producer_is_highly_input_bound(kind):
    producer_s = 3 * STEP_S
    monitor, clock = fit_monitored(kind, producer_s)
    (epoch,) = monitor.epochs
    truth = 1 - STEP_S / producer_s  # the input overlaps the step: it waits P - S of every P
    assert epoch.verdict == "highly input-bound"
    assert epoch.input_wait_fraction == pytest.approx(truth, abs=0.1)
    assert epoch.steps == STEPS - 2
    assert epoch.real_step_s == pytest.approx(clock.step_s(), rel=0.15)
    assert epoch.step_alone_s == pytest.approx(STEP_S, rel=0.25)
    if kind == "Feeder":
        assert 0.6 * BATCH / producer_s < epoch.producer_samples_per_s < 1.05 * BATCH / producer_s


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_three_times_faster_producer_is_not_input_bound(kind):
    monitor, clock = fit_monitored(kind, STEP_S / 3)
    (epoch,) = monitor.epochs
    assert epoch.verdict == "not input-bound"
    assert epoch.input_wait_fraction < MODERATE_FRACTION
    assert epoch.real_step_s == pytest.approx(clock.step_s(), rel=0.15)
    assert epoch.real_step_s == pytest.approx(STEP_S, rel=0.25)


def test_history_and_the_printed_line_carry_each_epochs_figures(capsys):
    model = sleeping_model(STEP_S)
    monitor = fp.StarvationMonitor()
    history = model.fit(
        slow_tf_data(3 * STEP_S, steps=6), epochs=2, verbose=0, shuffle=False, callbacks=[monitor]
    )
    assert [e.epoch for e in monitor.epochs] == [0, 1]
    for name in ("input_wait_fraction", "steps_per_s", "step_alone_steps_per_s"):
        assert history.history[name] == [e.logs()[name] for e in monitor.epochs]
    assert all(e.input_wait_fraction >= HIGH_FRACTION for e in monitor.epochs)
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) == 2
    for number, (line, epoch) in enumerate(zip(lines, monitor.epochs, strict=True), start=1):
        assert line.startswith(
            f"StarvationMonitor epoch {number}: highly input-bound: the step waited for input "
            f"{epoch.input_wait_fraction:.1%} of the time ("
        )
        assert f"the step alone runs {epoch.step_alone_steps_per_s:,.1f} steps/s" in line


def plain_model(strategy=None, steps_per_execution: int = 1) -> keras.Model:
    """Adam, dropout and a metric: state the headspace changes and must put back."""
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4, activation="relu"),
                keras.layers.Dropout(0.5, seed=3),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            keras.optimizers.Adam(0.01),
            "mse",
            metrics=["mae"],
            jit_compile=False,
            steps_per_execution=steps_per_execution,
        )
    return model


def regression_data(batches: int) -> tf.data.Dataset:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batches * BATCH, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


@pytest.mark.parametrize("setup", ["one step per call", "3 steps per call", "mirrored"])
def test_training_is_unchanged_by_the_monitor(setup, strategy):
    """Same weights, optimizer state and losses: the headspace batch is trained on exactly
    once, and everything the headspace steps change is put back."""
    options = {
        "one step per call": {},
        "3 steps per call": {"steps_per_execution": 3},  # 13 batches: the last call runs 1
        "mirrored": {"strategy": strategy},
    }[setup]
    runs = []
    for callbacks in ([], [fp.StarvationMonitor(headspace_steps=5, verbose=0)]):
        model = plain_model(**options)
        history = model.fit(
            regression_data(13), epochs=2, verbose=0, shuffle=False, callbacks=callbacks
        )
        runs.append((model, history.history))
    (plain, plain_history), (monitored, monitored_history) = runs
    assert monitored_history["input_wait_fraction"], "the monitor must have measured"
    assert monitored_history["loss"] == plain_history["loss"]
    assert monitored_history["mae"] == plain_history["mae"]
    for a, b in zip(plain.get_weights(), monitored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(plain.optimizer.variables, monitored.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_every_step_is_counted_once_with_steps_per_execution():
    model = plain_model(steps_per_execution=3)
    monitor = fp.StarvationMonitor(verbose=0)
    model.fit(regression_data(13), epochs=2, verbose=0, shuffle=False, callbacks=[monitor])
    # Calls of 3, 3, 3, 3, 1 steps. Epoch 1 leaves out the first call (tracing) and the second
    # (it takes the headspace batch); epoch 2 leaves out its first call.
    assert [e.steps for e in monitor.epochs] == [3 + 3 + 1, 3 + 3 + 3 + 1]


def test_an_epoch_too_short_to_measure_adds_nothing():
    model = plain_model()
    monitor = fp.StarvationMonitor(verbose=0)
    history = model.fit(regression_data(2), epochs=2, verbose=0, shuffle=False, callbacks=[monitor])
    # Epoch 1: trace, then take the headspace batch. Epoch 2: fill, then one timed step.
    assert [(e.epoch, e.steps) for e in monitor.epochs] == [(1, 1)]
    assert len(history.history["input_wait_fraction"]) == 1


class FailAt(keras.callbacks.Callback):
    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("fit died")


class SeesTrainFunction(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.seen = self.model.train_function


def test_keras_train_function_is_back_after_fit_even_after_a_fit_that_died():
    model = plain_model()
    model.fit(regression_data(4), epochs=1, verbose=0, shuffle=False)
    keras_function = model.train_function
    monitor = fp.StarvationMonitor(verbose=0)
    with pytest.raises(RuntimeError, match="fit died"):
        model.fit(regression_data(4), verbose=0, shuffle=False, callbacks=[monitor, FailAt(2)])
    assert model.train_function is not keras_function, "a dead fit leaves its wrapper"
    seer = SeesTrainFunction()
    model.fit(
        regression_data(4),
        verbose=0,
        shuffle=False,
        callbacks=[fp.StarvationMonitor(verbose=0), seer],
    )
    wrapped = getattr(seer.seen, monitor_module._ORIGINAL)
    assert wrapped is keras_function, "the dead fit's wrapper must be taken off, not wrapped"
    assert model.train_function is keras_function


def test_log_dir_gets_the_figures_as_tensorboard_scalars(tmp_path):
    model = plain_model()
    monitor = fp.StarvationMonitor(verbose=0, log_dir=tmp_path)
    model.fit(regression_data(6), epochs=2, verbose=0, shuffle=False, callbacks=[monitor])
    points = {}
    for events in tmp_path.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                points[value.tag, event.step] = float(tf.make_ndarray(value.tensor))
    for epoch in monitor.epochs:
        for name, value in epoch.logs().items():
            assert points[name, epoch.epoch] == pytest.approx(value, rel=1e-6)
    assert {step for _, step in points} == {0, 1}


def test_other_backends_are_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    fix = r"needs the TensorFlow backend, but Keras runs on 'jax'; set KERAS_BACKEND=tensorflow"
    with pytest.raises(RuntimeError, match=fix):
        fp.StarvationMonitor()


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"`headspace_steps`=0 must be >= 1"):
        fp.StarvationMonitor(headspace_steps=0)
    with pytest.raises(TypeError, match=r"`headspace_steps`=2.5 must be an integer"):
        fp.StarvationMonitor(headspace_steps=2.5)
    with pytest.raises(ValueError, match=r"`verbose`=2 must be 0"):
        fp.StarvationMonitor(verbose=2)
    with pytest.raises(TypeError, match=r"`feeder` must be a feedpipe.Feeder .* got list"):
        fp.StarvationMonitor(feeder=[])


def test_repr_shows_the_settings():
    assert repr(fp.StarvationMonitor(headspace_steps=4, verbose=0, log_dir="logs")) == (
        "StarvationMonitor(headspace_steps=4, verbose=0, log_dir='logs', feeder=None)"
    )
