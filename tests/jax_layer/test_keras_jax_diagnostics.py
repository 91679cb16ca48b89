"""`fp.StarvationMonitor` and `fp.diagnose` on Keras 3 on JAX: the same verdicts as on
TensorFlow, measured through JAX's own train function, and training left exactly as it was
(the headspace runs on a copy of the training state)."""

from __future__ import annotations

import importlib.util
import sys
import time

import jax
import numpy as np
import pytest

import feedpipe as fp
from tests.keras_cases import diagnose_command
from tests.starvation import SlowBatches, assert_reads_the_slower_input

STEP_S = 0.02
"""What the emulated accelerator's step sleeps."""
BATCH, STEPS = 16, 24


def sleeping_model(keras, step_s: float = STEP_S):
    """A Dense model whose jitted step also sleeps `step_s` on the host (an emulated
    accelerator)."""

    class Sleep(keras.layers.Layer):
        def call(self, x):
            def wait(rows):
                time.sleep(step_s)
                return rows

            return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), Sleep(), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def dense_model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def state_of(model) -> list[np.ndarray]:
    """Every value training changes: weights, the optimizer's slots and counters, metrics."""
    variables = [*model.variables, *model.optimizer.variables, *model.metrics_variables]
    return [np.array(v.value) for v in variables]


def arrays(length: int = STEPS * BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(length, 3)).astype("float32"), rng.normal(size=length).astype("float32")


def test_a_three_times_slower_source_is_highly_input_bound(keras, devices):
    producer_s = 3 * STEP_S
    with fp.Feeder(
        SlowBatches(producer_s, STEPS * BATCH, BATCH), BATCH, devices=devices[:1]
    ) as feeder:
        monitor = fp.StarvationMonitor(verbose=0, feeder=feeder)
        sleeping_model(keras).fit(
            feeder, epochs=1, verbose=0, callbacks=[monitor, feeder.fit_callback()]
        )
    (epoch,) = monitor.epochs
    assert_reads_the_slower_input(epoch, STEP_S, producer_s, STEPS - 2, rel=0.5)
    assert epoch.backend == "jax"
    assert 0.5 * BATCH / producer_s < epoch.producer_samples_per_s < 1.05 * BATCH / producer_s


def test_a_three_times_faster_source_is_not_read_as_highly_input_bound(keras, devices):
    with fp.Feeder(
        SlowBatches(STEP_S / 3, STEPS * BATCH, BATCH), BATCH, devices=devices[:1]
    ) as feeder:
        monitor = fp.StarvationMonitor(verbose=0)
        sleeping_model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[monitor])
    (epoch,) = monitor.epochs
    assert epoch.verdict != "highly input-bound"


def test_history_carries_each_epochs_figures(keras, devices, capsys):
    x, y = arrays()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        monitor = fp.StarvationMonitor(feeder=feeder)
        history = dense_model(keras).fit(feeder, epochs=2, verbose=0, callbacks=[monitor])
    assert len(monitor.epochs) == 2
    for name in ("input_wait_fraction", "steps_per_s", "feeder_wait_fraction"):
        assert len(history.history[name]) == 2
    assert capsys.readouterr().out.count("StarvationMonitor epoch") == 2


@pytest.mark.parametrize("parallel", [False, True], ids=["one device", "DataParallel"])
def test_training_is_unchanged_by_the_monitor(keras, devices, parallel):
    x, y = arrays()
    used = devices if parallel else devices[:1]
    trained = []
    for callbacks in ([], [fp.StarvationMonitor(verbose=0)]):
        if parallel:
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=used))
        with fp.Feeder((x, y), BATCH, devices=used) as feeder:
            model = dense_model(keras)
            model.fit(feeder, epochs=2, verbose=0, callbacks=callbacks)
            trained.append(state_of(model))
        keras.distribution.set_distribution(None)
    assert callbacks[0].epochs, "the monitor measured nothing"
    for alone, monitored in zip(*trained, strict=True):
        np.testing.assert_array_equal(alone, monitored)


def test_keras_train_function_is_back_after_fit(keras, devices):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        model.fit(feeder, epochs=1, verbose=0)
        original = model.train_function
        model.fit(feeder, epochs=1, verbose=0, callbacks=[fp.StarvationMonitor(verbose=0)])
    assert model.train_function is original


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is not None, reason="TensorFlow is installed here"
)
def test_tensorboard_scalars_without_tensorflow_are_refused_with_the_fix(keras, tmp_path):
    with pytest.raises(ImportError, match=r"`log_dir`=.*pip install tensorflow, or pass log_dir"):
        fp.StarvationMonitor(log_dir=tmp_path)


def test_diagnose_reads_a_slow_feeder_as_input_bound(keras, devices):
    with fp.Feeder(
        SlowBatches(3 * STEP_S, 10 * STEPS * BATCH, BATCH), BATCH, devices=devices[:1]
    ) as f:
        diagnosis = fp.diagnose(f, sleeping_model(keras), steps=8, warmup=2, progress=False)
    assert diagnosis.verdict == "highly input-bound"
    assert diagnosis.consumer_steps_per_s == pytest.approx(1 / STEP_S, rel=0.5)
    assert all("tf.data service" not in remedy.action for remedy in diagnosis.remedies)


@pytest.mark.parametrize("parallel", [False, True], ids=["one device", "DataParallel"])
def test_diagnose_leaves_the_model_as_it_was(keras, devices, parallel):
    x, y = arrays()
    used = devices if parallel else devices[:1]
    if parallel:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=used))
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=used) as feeder:
        model.fit(feeder, epochs=1, verbose=0)
        before = state_of(model)
        diagnosis = fp.diagnose(feeder, model, steps=4, warmup=1, progress=False)
    for was, now in zip(before, state_of(model), strict=True):
        np.testing.assert_array_equal(was, now)
    assert diagnosis.keras_arrays_step_s, "fit(x, y) on the same arrays was not measured"


def test_diagnosing_an_unbuilt_model_leaves_it_untrained(keras, devices):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        fp.diagnose(feeder, model, steps=3, warmup=1, progress=False)
    untrained = dense_model(keras)
    untrained(x[:1])
    assert int(model.optimizer.iterations.value) == 0
    for old, new in zip(untrained.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(old, new)


def test_a_diagnosis_leaves_the_feeder_where_it_was_for_the_fit_after_it(keras, devices):
    x, y = arrays()
    model = dense_model(keras)
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
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


def test_diagnosis_on_jax_imports_no_tensorflow(keras, devices):
    if importlib.util.find_spec("tensorflow") is not None and "tensorflow" in sys.modules:
        pytest.skip("TensorFlow was imported by other tests in this process")
    x, y = arrays()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        fp.diagnose(feeder, dense_model(keras), steps=2, warmup=1, progress=False)
        dense_model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[fp.StarvationMonitor()])
    assert "tensorflow" not in sys.modules


def test_the_diagnose_command_runs_a_keras_model_on_jax(keras, tmp_path, capsys):
    result = diagnose_command(
        tmp_path, capsys, imports="import jax", devices=", devices=jax.devices()[:1]"
    )
    assert len(result["together"]) == 3 and result["remedies"]
    assert "Keras model" in result["step_kind"] and result["waits_derived"]
