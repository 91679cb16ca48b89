"""`model.fit(feeder)` on the TensorFlow backend: the feeder is Keras's data adapter, and fit
reads exactly what `fit(feeder.as_dataset())` reads."""

from __future__ import annotations

import collections
import os
import signal
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(100, 8)).astype("float32")
    return x, (np.arange(100) % 3).astype("int32")


def model() -> keras.Model:
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    net.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return net


def test_fit_on_the_feeder_equals_fit_on_its_dataset():
    with fp.Feeder(data(), 32, shuffle=True) as feeder:
        direct = model()
        direct.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert feeder.get_state()["epoch"] == 2
    with fp.Feeder(data(), 32, shuffle=True) as feeder:
        through = model()
        through.fit(feeder.as_dataset(), epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    for mine, theirs in zip(direct.get_weights(), through.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_the_adapter_reports_whole_epochs_of_batches_and_no_partial_batch():
    with fp.Feeder(data(), 32) as feeder:
        assert feeder.num_batches == 4 and feeder.batch_size == 32
        assert not feeder.has_partial_batch and feeder.partial_batch_size is None
        loop = iter(feeder)
        next(loop)
        loop.close()
        # Keras's epochs are whole ones; its first, from mid-epoch, ends with the feeder's.
        assert feeder.num_batches == 4


def test_a_tensorflow_feeder_asked_for_jax_batches_says_how_to_build_one():
    with fp.Feeder(data(), 32) as feeder:
        assert feeder.layer.name == "tensorflow"
        with pytest.raises(TypeError, match="Keras's backend is JAX"):
            feeder.get_jax_iterator()


def test_a_fit_interrupted_and_run_again_goes_on_from_what_was_trained():
    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder(data(), 32) as feeder:
        fed = model()
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), CtrlC()], verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 2)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)  # the same cell
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
    with fp.Feeder(data(), 32) as feeder:
        whole = model()
        whole.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
    for mine, theirs in zip(fed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def classifier(strategy=None, **compile_args) -> keras.Model:
    """A model whose unweighted `accuracy` would count padding rows if it were given them."""
    with (strategy or tf.distribute.get_strategy()).scope():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        net.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_args,
        )
    return net


UNEVEN = 37  # with a global batch of 8, the last batch holds 5 real rows and 3 padding rows


@pytest.mark.usefixtures("as_dataset_path")
@pytest.mark.parametrize("mirrored", [False, True], ids=["no strategy", "mirrored-4"])
def test_predict_on_the_feeder_returns_one_prediction_per_real_sample(devices, mirrored):
    x, y = (a[:UNEVEN] for a in data())
    strategy = tf.distribute.MirroredStrategy(devices) if mirrored else None
    net = classifier(strategy)
    with fp.Feeder((x, y), 8, strategy=strategy) as feeder:
        predicted = net.predict(feeder, verbose=0)
    assert predicted.shape == (UNEVEN, 3)
    np.testing.assert_allclose(predicted, net.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("as_dataset_path")
def test_evaluate_on_the_feeder_counts_each_real_sample_once_in_every_metric():
    x, y = (a[:UNEVEN] for a in data())
    net = classifier()
    with fp.Feeder((x, y), 8) as feeder:
        fed = net.evaluate(feeder, verbose=0, return_dict=True)
    plain = net.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert fed == pytest.approx(plain, rel=1e-6)


@pytest.mark.usefixtures("as_dataset_path")
def test_validation_on_a_feeder_counts_each_real_sample_once_in_every_metric():
    x, y = (a[:UNEVEN] for a in data())
    net = classifier()
    with fp.Feeder(data(), 32) as train, fp.Feeder((x, y), 8) as validation:
        history = net.fit(
            train, validation_data=validation, callbacks=[train.fit_callback()], verbose=0
        )
    plain = net.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert history.history["val_accuracy"][-1] == pytest.approx(plain["accuracy"], rel=1e-6)
    assert history.history["val_loss"][-1] == pytest.approx(plain["loss"], rel=1e-5)


class CtrlCAfter(keras.callbacks.Callback):
    """Raises KeyboardInterrupt after step `step` of the first epoch, as Ctrl-C does."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.epoch = step, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == self.step:
            raise KeyboardInterrupt


@pytest.mark.usefixtures("as_dataset_path")
def test_the_same_fit_run_again_after_ctrl_c_finishes_the_epoch_then_whole_epochs_once():
    with fp.Feeder(data(), 32, shuffle=True) as feeder:
        fed = model()
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback(), CtrlCAfter(1)], verbose=0)
        # The notebook cell run again: the rest of epoch 0, then epochs 1 and 2.
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
    with fp.Feeder(data(), 32, shuffle=True) as feeder:
        whole = model()
        whole.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
    for mine, theirs in zip(fed.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_dataset_fit_run_again_after_ctrl_c_names_the_interrupted_fit_and_the_call_that_goes_on():
    with fp.Feeder(data(), 32) as feeder:
        fed = model()
        with pytest.raises(KeyboardInterrupt):
            fed.fit(
                feeder.as_dataset(),
                epochs=3,
                callbacks=[feeder.fit_callback(), CtrlCAfter(1)],
                verbose=0,
            )
        refused = pytest.raises(
            ValueError, match=r"interrupted fit.*step 2 of epoch 0.*model\.fit\(feeder, epochs=3"
        )
        with refused:
            fed.fit(feeder.as_dataset(), epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert "restore" not in str(refused.excinfo.value)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 2)


@pytest.mark.parametrize("entry", ["feeder", "feeder.as_dataset()"])
def test_a_fit_of_shorter_epochs_than_a_fresh_feeders_names_steps_per_epoch(entry):
    """A fresh feeder is at an epoch's start: the refusal speaks of Keras's steps_per_epoch,
    not of a dataset made mid-epoch, and names the calls that work."""
    with fp.Feeder(data(), 32) as feeder:
        given = feeder if entry == "feeder" else feeder.as_dataset()
        with pytest.raises(ValueError) as refused:
            model().fit(given, steps_per_epoch=2, callbacks=[feeder.fit_callback()], verbose=0)
        message = str(refused.value)
        assert "steps_per_epoch" in message and "the feeder's epochs have 4 batches" in message
        assert "Leave steps_per_epoch unset" in message
        assert f"model.fit({entry}, epochs=...)" in message
        assert "2 batches of 32 are an fp.Feeder over 64 samples" in message
        assert "made mid-epoch and serves" not in message and "step 0 of epoch 0" not in message
        assert feeder.get_state()["step"] == 0


@pytest.mark.parametrize("kind", ["list", "namedtuple"])
def test_as_dataset_of_list_or_namedtuple_samples_weighs_padding_as_tuples_do(kind):
    x, y = data()
    pair = collections.namedtuple("Pair", "x y")

    class Samples:
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return [x[i], y[i]] if kind == "list" else pair(x[i], y[i])

    with fp.Feeder(Samples(), 32) as feeder:
        *_, last = list(feeder.as_dataset(pad_last=True))
        assert np.asarray(last[2]).tolist() == [8.0] * 4 + [0.0] * 28
        fed = model()
        padded = feeder.as_dataset(pad_last=True)
        fed.fit(padded, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    plain = model()
    plain.fit(*data(), batch_size=32, shuffle=False, epochs=2, verbose=0)
    for mine, theirs in zip(fed.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def adam_model(steps_per_execution: int = 1) -> keras.Model:
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    net.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return net


@pytest.mark.usefixtures("as_dataset_path")
@pytest.mark.parametrize("steps_per_execution", [1, 5])
@pytest.mark.parametrize("mid_epoch", ["restored", "interrupted"])
def test_a_fit_from_mid_epoch_applies_one_optimizer_step_per_batch(steps_per_execution, mid_epoch):
    # Adam's steps depend on the optimizer's count of steps (`iterations`), so a step counted
    # that trained nothing shows in the weights. 96 rows in batches of 8: no padding row, so
    # fit(x, y) on the same rows in the same batches is the exact oracle. From step 5, calls
    # of 5 steps end the rest of the epoch with a call of 2.
    x, y = (a[:96] for a in data())
    with fp.Feeder((x, y), 8) as feeder:
        fed = adam_model(steps_per_execution)
        if mid_epoch == "restored":
            feeder.set_state({**feeder.get_state(), "step": 5})
        else:
            callbacks = [feeder.fit_callback(), CtrlCAfter(4)]
            with pytest.raises(KeyboardInterrupt):
                fed.fit(feeder, epochs=2, callbacks=callbacks, verbose=0)
            assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 5)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (2, 0)
    plain = adam_model(steps_per_execution)
    if mid_epoch == "interrupted":
        plain.fit(x[:40], y[:40], batch_size=8, shuffle=False, verbose=0)
    plain.fit(x[40:], y[40:], batch_size=8, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert int(fed.optimizer.iterations) == int(plain.optimizer.iterations)
    for mine, theirs in zip(fed.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


class SignalInStep(keras.layers.Layer):
    """Sends this process a real SIGINT (Ctrl-C) from inside the compiled step `at` (counted
    from 0), which goes on running for a while: Python handles the signal as the step returns."""

    def __init__(self, at: int | None):
        super().__init__()
        self.at, self.count = at, 0

    def tick(self) -> int:
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.02)
        self.count += 1
        return 0

    def call(self, inputs):
        with tf.control_dependencies([tf.py_function(self.tick, [], [tf.int32])]):
            return tf.identity(inputs)


def test_a_real_ctrl_c_in_any_step_leaves_the_state_of_the_steps_applied_and_the_fit_goes_on():
    x, y = (a[:48] for a in data())  # 6 steps an epoch, none padded

    def fit(at: int | None) -> tuple[keras.Model, tuple[int, int], int]:
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((8,)), SignalInStep(at), keras.layers.Dense(3)])
        net.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        with fp.Feeder((x, y), 8) as feeder:
            if at is None:
                net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
                return net, (2, 0), int(net.optimizer.iterations)
            with pytest.raises(KeyboardInterrupt):
                net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
            state = feeder.get_state()
            applied = int(net.optimizer.iterations)
            net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)  # again
            return net, (state["epoch"], state["step"]), applied

    whole, _, iterations = fit(None)
    for at in range(5):  # each step of the first epoch but its last, which ends the epoch
        net, state, applied = fit(at)
        assert state == (0, at + 1), at  # the step the signal arrived in was applied
        assert applied == at + 1, at
        assert int(net.optimizer.iterations) == iterations, at
        for mine, theirs in zip(net.get_weights(), whole.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, theirs, err_msg=f"Ctrl-C in step {at}")


@pytest.mark.parametrize("entry", ["feeder", "as_dataset"])
def test_a_fit_on_a_generator_applies_one_optimizer_step_per_batch(entry):
    # Keras learns a generator's epoch from its end, which its TensorFlow step finds after
    # running the ops that need no batch: the optimizer's count of steps among them.
    x, y = (a[:96] for a in data())

    def rows(shard: int, num_shards: int):
        for index in range(shard, len(x), num_shards):
            yield x[index], y[index]

    with fp.Feeder(fp.from_generator(rows), 8) as feeder:
        fed = adam_model()
        given = feeder if entry == "feeder" else feeder.as_dataset()
        fed.fit(given, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
    plain = adam_model()
    plain.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert int(fed.optimizer.iterations) == int(plain.optimizer.iterations) == 36
    for mine, theirs in zip(fed.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
