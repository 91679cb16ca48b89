"""`fp.StarvationMonitor` and `fp.diagnose` on Keras 3 on PyTorch: the same verdicts as on
TensorFlow and JAX, measured through Keras's own torch train function (timed from the read of
its batch, which `fit` makes before the call), and training left exactly as it was (every
variable, gradient and training mode put back after the headspace)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import feedpipe as fp
from feedpipe.diagnostics.remedies import rank_remedies
from feedpipe.diagnostics.verdict import Diagnosis, StepTiming
from tests.keras_cases import diagnose_command, wall_clock
from tests.starvation import SlowBatches, assert_reads_the_slower_input

STEP_S = 0.04
"""What the emulated accelerator's step sleeps: long beside the few milliseconds Keras's eager
torch step adds on a CPU, so that the step alone is the sleep within the tests' bounds."""
BATCH, STEPS = 16, 16
CPU = [torch.device("cpu")]


def sleeping_model(keras, step_s: float = STEP_S):
    """A Dense model whose step also sleeps `step_s` on the host (an emulated accelerator)."""

    class Sleep(keras.layers.Layer):
        def call(self, x):
            time.sleep(step_s)
            return x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), Sleep(), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def dense_model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def stateful_model(keras):
    """A model whose step also draws random numbers (an unseeded dropout draws from PyTorch's
    generator, unseeded noise from Keras's global seed generator) and changes moving
    statistics (batch normalization) and a weighted metric, beside the weights and the
    optimizer's slots."""

    class UnseededNoise(keras.layers.Layer):
        def call(self, x, training=False):
            return x + 0.1 * keras.random.normal(keras.ops.shape(x)) if training else x

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            UnseededNoise(),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )
    model.compile("adam", "mse", weighted_metrics=["mae"])
    return model


def state_of(model) -> list[np.ndarray]:
    """Every value training changes: weights, seeds, the optimizer's slots and counters,
    metrics."""
    variables = [*model.variables, *model.optimizer.variables, *model.metrics_variables]
    return [v.value.detach().cpu().numpy() for v in variables]


def arrays(length: int = STEPS * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(length, 3)).astype("float32"), rng.normal(size=length).astype("float32")


def test_a_three_times_slower_source_is_highly_input_bound(keras):
    producer_s = 3 * STEP_S
    clock = wall_clock(keras)
    with fp.Feeder(SlowBatches(producer_s, STEPS * BATCH, BATCH), BATCH, devices=CPU) as feeder:
        monitor = fp.StarvationMonitor(verbose=0, feeder=feeder)
        sleeping_model(keras).fit(
            feeder, epochs=1, verbose=0, callbacks=[monitor, feeder.fit_callback(), clock]
        )
    (epoch,) = monitor.epochs
    assert_reads_the_slower_input(epoch, STEP_S, producer_s, STEPS - 2, rel=0.5)
    # Timed from the read of each batch, which Keras makes before it calls the step.
    assert epoch.real_step_s == pytest.approx(clock.step_s(), rel=0.15)
    assert epoch.backend == "torch"
    assert 0.5 * BATCH / producer_s < epoch.producer_samples_per_s < 1.05 * BATCH / producer_s


def test_a_three_times_faster_source_is_not_read_as_highly_input_bound(keras):
    clock = wall_clock(keras)
    with fp.Feeder(SlowBatches(STEP_S / 3, STEPS * BATCH, BATCH), BATCH, devices=CPU) as feeder:
        monitor = fp.StarvationMonitor(verbose=0)
        sleeping_model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[monitor, clock])
    (epoch,) = monitor.epochs
    assert epoch.verdict != "highly input-bound"
    assert epoch.real_step_s == pytest.approx(clock.step_s(), rel=0.15)


def test_a_slow_input_keras_reads_itself_is_highly_input_bound(keras):
    """Not a feeder: a `PyDataset`, which Keras's own adapter reads in the training thread."""

    class SlowDataset(keras.utils.PyDataset):
        def __len__(self):
            return STEPS

        def __getitem__(self, index):
            time.sleep(3 * STEP_S)
            return np.ones((BATCH, 3), np.float32), np.ones(BATCH, np.float32)

    monitor, clock = fp.StarvationMonitor(verbose=0), wall_clock(keras)
    sleeping_model(keras).fit(SlowDataset(), epochs=1, verbose=0, callbacks=[monitor, clock])
    (epoch,) = monitor.epochs
    assert epoch.verdict == "highly input-bound"
    assert epoch.input_wait_range[0] > 0.5  # read then step, in turn: 3/4 of each is the read
    assert epoch.real_step_s == pytest.approx(clock.step_s(), rel=0.15)


def test_history_carries_each_epochs_figures(keras, capsys):
    x, y = arrays()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        monitor = fp.StarvationMonitor(feeder=feeder)
        history = dense_model(keras).fit(feeder, epochs=2, verbose=0, callbacks=[monitor])
    assert len(monitor.epochs) == 2
    for name in ("input_wait_fraction", "steps_per_s", "feeder_wait_fraction"):
        assert len(history.history[name]) == 2
    assert capsys.readouterr().out.count("StarvationMonitor epoch") == 2


def test_training_is_unchanged_by_the_monitor(keras):
    x, y = arrays()
    vx, vy = arrays(40)
    trained = []
    for callbacks in ([], [fp.StarvationMonitor(verbose=0)]):
        with (
            fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True) as feeder,
            fp.Feeder((vx, vy), BATCH, devices=CPU) as validation,
        ):
            model = stateful_model(keras)
            model.fit(feeder, validation_data=validation, epochs=2, verbose=0, callbacks=callbacks)
            trained.append((state_of(model), model.training))
    assert callbacks[0].epochs, "the monitor measured nothing"
    (alone, alone_mode), (monitored, monitored_mode) = trained
    assert monitored_mode == alone_mode
    for was, now in zip(alone, monitored, strict=True):
        np.testing.assert_array_equal(was, now)


def test_the_headspace_puts_back_the_gradients_and_the_training_mode(keras):
    x, y = arrays()
    model = stateful_model(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        model.fit(feeder, epochs=1, verbose=0)
        gradients = [v.value.grad for v in model.trainable_variables]
        assert all(g is not None for g in gradients)
        assert not model.training  # fit leaves it in eval mode
        fp.diagnose(feeder, model, steps=2, warmup=1, progress=False)
    assert not model.training
    for variable, gradient in zip(model.trainable_variables, gradients, strict=True):
        assert variable.value.grad is gradient


def test_keras_train_function_is_back_after_fit(keras):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        model.fit(feeder, epochs=1, verbose=0)
        original = model.train_function
        model.fit(feeder, epochs=1, verbose=0, callbacks=[fp.StarvationMonitor(verbose=0)])
    assert model.train_function is original


def test_the_monitor_outside_a_fit_says_how_to_use_it(keras):
    monitor = fp.StarvationMonitor(verbose=0)
    model = dense_model(keras)
    model.make_train_function()
    monitor.set_model(model)
    with pytest.raises(RuntimeError, match=r"no running Keras fit.*callback of model\.fit"):
        monitor.on_train_begin()


def test_diagnose_reads_a_slow_feeder_as_input_bound(keras):
    with fp.Feeder(SlowBatches(3 * STEP_S, 10 * STEPS * BATCH, BATCH), BATCH, devices=CPU) as f:
        diagnosis = fp.diagnose(f, sleeping_model(keras), steps=8, warmup=2, progress=False)
    assert diagnosis.verdict == "highly input-bound"
    assert diagnosis.consumer_steps_per_s == pytest.approx(1 / STEP_S, rel=0.5)
    assert all("tf.data service" not in remedy.action for remedy in diagnosis.remedies)


def test_diagnose_leaves_the_model_as_it_was(keras):
    x, y = arrays()
    model = stateful_model(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        model.fit(feeder, epochs=1, verbose=0)
        before = state_of(model)
        diagnosis = fp.diagnose(feeder, model, steps=4, warmup=1, progress=False)
    for was, now in zip(before, state_of(model), strict=True):
        np.testing.assert_array_equal(was, now)
    assert diagnosis.keras_arrays_step_s, "fit(x, y) on the same arrays was not measured"


def test_diagnosing_an_unbuilt_model_leaves_it_untrained(keras):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        fp.diagnose(feeder, model, steps=3, warmup=1, progress=False)
    untrained = dense_model(keras)
    untrained(x[:1])
    assert int(model.optimizer.iterations.value) == 0
    for old, new in zip(untrained.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)


def test_a_diagnosis_leaves_the_feeder_where_it_was_for_the_fit_after_it(keras):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        for step, _batch in enumerate(feeder):
            if step == 4:
                break
        start = feeder.get_state()
        assert (start["epoch"], start["step"]) == (0, 5)
        fp.diagnose(feeder, model, steps=3, warmup=1, progress=False)
        assert feeder.get_state() == start
        model.fit(feeder, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
        model.fit(feeder, epochs=2, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)


def test_a_slow_hand_off_is_never_told_to_use_tensorflows_fp_train(keras):
    # What the monitor derived: 10 batches/s reach a step that could take 100, while the
    # feeder's own producer (arrays in memory) makes far more.
    measured = Diagnosis(
        "a feeder",
        "Keras model",
        1024,
        (0.1,) * 10,
        (0.01,) * 10,
        (StepTiming(0.101, 0.01, None),) * 10,
        True,
    )
    x, y = arrays()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        for _ in feeder:
            pass
        assert feeder.stats().producer_samples_per_s > 20 * BATCH
        remedies = rank_remedies(measured, feeder, cores=2, memcpy_s=1e-4, memory_bytes=2**34)
    actions = [remedy.action for remedy in remedies]
    assert not any("fp.train" in action or "as_dataset" in action for action in actions)
    assert any("workers=2" in action for action in actions), actions


def test_the_diagnose_command_runs_a_keras_model_on_torch(keras, tmp_path, capsys):
    result = diagnose_command(tmp_path, capsys)
    assert len(result["together"]) == 3 and result["remedies"]
    assert "Keras model" in result["step_kind"] and result["waits_derived"]
    assert result["feeder"]["framework"] == "torch"
