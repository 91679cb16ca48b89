"""Keras 3 on JAX fed by `model.fit(feeder)`: the same weights as `fit(arrays)` on the same
order, a padded batch handed over as its real rows alone (weighted zero where the devices
cannot share its rows), a state that counts what the step trained on."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import jax
import numpy as np
import pytest

import feedpipe as fp
from tests import keras_conformance as conformance
from tests.keras_cases import BATCH, LENGTH, assert_same_weights, classifier, data, model
from tests.keras_fit_promises import *  # noqa: F403 (every promise of fit(feeder) runs here)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The event JAX records once per XLA compilation, with the function's name."""


@contextlib.contextmanager
def compilations_of(name: str):
    """The names of the XLA compilations of functions called `name` made inside, as a list."""
    made = []

    def listen(event, duration_s, **details):
        if event == COMPILE_EVENT and f"({name})" in str(details.get("fun_name")):
            made.append(details["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield made
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_data_parallel_fit_takes_the_sharded_batches_and_equals_one_device(keras, devices):
    x, y = data()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    with fp.Feeder((x, y), BATCH, devices=devices) as feeder:
        assert feeder.sharding.mesh.devices.tolist() == list(devices)
        fed = model(keras)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        kernel = fed.layers[0].kernel.value
        assert kernel.sharding.device_set == set(devices)
    keras.distribution.set_distribution(None)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)


@pytest.mark.parametrize("on", ["one device", "data parallel"])
def test_fit_on_the_feeder_compiles_the_train_step_as_often_as_fit_on_arrays(keras, devices, on):
    # Keras resets the metrics' variables as each epoch begins: a batch placed otherwise than
    # Keras places its own made the state differ from the reset variables in its sharding, and
    # the step compiled again at the start of the second epoch. A second fit of the same model
    # compiles nothing.
    x, y = data()  # the last batch's 4 real rows: a second shape, compiled once on both
    if on == "data parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    fed, plain = classifier(keras), classifier(keras)
    with fp.Feeder((x, y), BATCH, devices=devices if on == "data parallel" else devices[:1]) as f:
        fits = []
        for _ in range(2):
            with compilations_of("train_step") as made:
                fed.fit(f, epochs=3, callbacks=[f.fit_callback()], verbose=0)
            fits.append(len(made))
    expected = []
    for _ in range(2):
        with compilations_of("train_step") as made:
            plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=3, verbose=0)
        expected.append(len(made))
    assert expected[0] > 0, "no compilation of the train step was seen: the count is blind"
    assert fits == expected, f"compilations per fit of 3 epochs: {fits}, on arrays {expected}"
    assert_same_weights(fed, plain)


def test_the_fit_callback_attaches_the_training_state_once_a_fit_not_once_a_step(keras, devices):
    # Keras on JAX keeps the state apart from the model during an epoch; every read of a
    # callback's `self.model` puts it back (a copy of every variable), so a callback that read
    # it each step would slow every step.
    x, y = data()

    def syncs(steps: int) -> int:
        net, count = model(keras), []
        sync = net.jax_state_sync

        def counting():
            count.append(1)
            return sync()

        net.jax_state_sync = counting
        rows = steps * BATCH
        with fp.Feeder((x[:rows], y[:rows]), BATCH, devices=devices[:1]) as feeder:
            net.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
            assert feeder.get_state()["epoch"] == 2
        return len(count)

    assert syncs(3) == syncs(1)


def test_a_padded_batch_goes_to_keras_as_its_real_rows_alone(keras, devices):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        batches = list(feeder.get_jax_iterator())
    assert [len(b) for b in batches] == [2] * len(batches), "no weight is added"
    *_, (bx, by) = batches
    assert np.asarray(by).tolist() == y[96:].tolist()
    np.testing.assert_array_equal(np.asarray(bx), x[96:])


def test_a_sources_own_weights_go_to_keras_as_they_are(keras, devices):
    x, y = data()
    given = np.linspace(0.5, 2.0, LENGTH).astype("float32")
    with fp.Feeder((x, y, given), BATCH, devices=devices[:1]) as feeder:
        batches = list(feeder.get_jax_iterator())
    np.testing.assert_array_equal(np.asarray(batches[0][2]), given[:BATCH])
    np.testing.assert_array_equal(np.asarray(batches[-1][2]), given[96:])


def test_a_feeder_on_more_devices_than_keras_trains_on_is_refused(keras, devices):
    x, y = data()
    refused = pytest.raises(ValueError, match="Keras has no distribution")
    with fp.Feeder((x, y), BATCH, devices=devices) as feeder, refused:
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)


@pytest.mark.parametrize("on", ["one device", "data parallel"])
def test_predict_on_the_feeder_returns_one_prediction_per_real_sample(keras, devices, on):
    x, y = data()  # the last batch's 4 real rows divide among 4 devices
    if on == "data parallel":
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    net = classifier(keras)
    with fp.Feeder((x, y), BATCH, devices=devices if on == "data parallel" else devices[:1]) as f:
        predicted = net.predict(f, verbose=0)
    assert predicted.shape == (LENGTH, 3)
    np.testing.assert_allclose(predicted, net.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_where_the_last_real_rows_cannot_be_sharded_says_to_use_one_device(keras, devices):
    x, y = (a[:37] for a in data())  # the last batch's 5 real rows cannot split among 4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    net = classifier(keras)
    refused = pytest.raises(
        ValueError, match=r"holds 5 real samples.*devices=\[jax\.devices\(\)\[0\]\]"
    )
    with fp.Feeder((x, y), 8, devices=devices) as feeder, refused:
        net.predict(feeder, verbose=0)


def test_data_parallel_fit_with_a_last_batch_the_devices_share_equals_fit_on_arrays(keras, devices):
    # The last batch's 4 real rows divide among 4 devices: it goes over as a smaller batch, as
    # fit(x, y)'s does, so BatchNormalization and the History see the same rows.
    samples = conformance.Structure()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    fed = conformance.fit_feeder(keras, devices, samples, optimizer="adam")[:2]
    expected = conformance.fit_arrays(keras, samples, optimizer="adam")
    conformance.assert_same_fit(fed, expected)


def test_data_parallel_fit_with_a_last_batch_the_devices_cannot_share_warns_what_differs(
    keras, devices
):
    x, y = (a[:37] for a in data())  # the last batch's 5 real rows cannot split among 4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    net = model(keras)
    with fp.Feeder((x, y), 8, devices=devices) as feeder:
        warned = pytest.warns(UserWarning, match=r"holds 5 real samples.*BatchNormalization")
        with warned:
            net.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        assert feeder.get_state()["epoch"] == 1
    keras.distribution.set_distribution(None)
    plain = model(keras)  # a mean loss over the padded batch is the mean over its real rows
    plain.fit(x, y, batch_size=8, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(net, plain)


def test_a_real_ctrl_c_in_any_step_leaves_a_whole_model_and_the_same_fit_goes_on(keras, devices):
    # Keras's JAX step donates the training state it is given and returns the next one, which
    # Keras keeps once the step has returned: a KeyboardInterrupt raised in between would leave
    # the model's variables deleted arrays, and the fit run again would crash on them.
    x, y = data()  # 4 steps, the last padded
    steps = -(-LENGTH // BATCH)

    class SignalInStep(keras.layers.Layer):
        """Has a thread send this process a real SIGINT (Ctrl-C) as the compiled step `at`
        begins (None: never): the rest of the step runs in XLA, and Python handles the signal
        as the step returns."""

        def __init__(self, at: int | None):
            super().__init__()
            self.at, self.count, self.reached = at, 0, threading.Event()
            self.sender = threading.Thread(target=self.send, name="ctrl-c", daemon=True)
            if at is not None:
                self.sender.start()

        def send(self) -> None:
            if self.reached.wait(timeout=60):
                os.kill(os.getpid(), signal.SIGINT)

        def tick(self) -> None:
            if self.count == self.at:
                self.reached.set()
            self.count += 1

        def call(self, inputs):
            jax.debug.callback(self.tick)
            return inputs

    def fit(at: int | None):
        keras.utils.set_random_seed(1)
        interrupting = SignalInStep(at)
        layers = [keras.layers.Dense(1024), keras.layers.Dense(1024), keras.layers.Dense(3)]
        net = keras.Sequential([keras.Input((8,)), interrupting, *layers])
        net.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
            callbacks = [feeder.fit_callback()]
            if at is None:
                net.fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
                return net
            with pytest.raises(KeyboardInterrupt):
                net.fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
            interrupting.sender.join()
            applied = int(net.optimizer.iterations.value)  # the model's own variable, whole
            state = feeder.get_state()
            assert (state["epoch"], state["step"]) in [(0, at + 1), (1, 0)], at
            assert applied == state["epoch"] * steps + state["step"]
            if state["epoch"] == 0:
                net.fit(feeder, epochs=1, callbacks=callbacks, verbose=0)  # the same fit again
        return net

    whole = fit(None)
    for at in range(steps):
        assert_same_weights(fit(at), whole)


def test_fit_on_a_feeder_gathering_arrays_in_threads_trains_as_fit_on_the_arrays(
    keras, monkeypatch
):
    from feedpipe.core import env, gather

    monkeypatch.setattr(gather, "MIN_RANGE_BYTES", 1)  # a batch this small shared by threads
    monkeypatch.setenv(env.GATHER_THREADS, "3")
    submitted = []
    submit = gather.GatherPool.submit
    monkeypatch.setattr(gather.GatherPool, "submit", lambda *a: submitted.append(1) or submit(*a))
    x, y = (a[:96] for a in data())
    with fp.Feeder((x, y), BATCH, devices=jax.devices()[:1]) as feeder:
        assert feeder.describe().gather_threads == 3
        fed = model(keras)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert len(submitted) >= 6, "the fit's batches were gathered in the threads"
    assert int(fed.optimizer.iterations) == int(plain.optimizer.iterations) == 6
    assert_same_weights(fed, plain)


def test_fit_past_the_skips_a_state_keeps_counts_them_as_a_loop_to_the_same_batch(
    keras, monkeypatch
):
    # A fit reads batches ahead of the steps it trains: the skips it folds are those before
    # what it trained, so its state equals that of a loop taken straight to the same batch.
    from feedpipe.core import skips
    from tests.worker_fakes import FailsOn, index_pairs

    monkeypatch.setattr(skips, "RECORDS_KEPT", 2)
    bad = range(0, 96, 3)
    options = {"devices": jax.devices()[:1], "errors": "skip", "max_skipped": 0.5}

    def build():
        return fp.Feeder(index_pairs(96), 8, transform=FailsOn(bad), **options)

    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    net.compile(optimizer="sgd", loss="mse")

    class StopAfterFive(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = batch == 4

    with build() as feeder:
        callbacks = [feeder.fit_callback(), StopAfterFive()]
        net.fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
        fitted = feeder.get_state()
    with build() as straight:
        loop = iter(straight)
        for _ in range(5):
            next(loop)
        loop.close()
        assert straight.get_state() == fitted
    assert fitted["step"] == 5 and fitted["skipped_count"] == 14 > len(fitted["skipped"]) == 2
