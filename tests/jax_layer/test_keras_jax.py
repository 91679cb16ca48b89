"""Keras 3 on JAX fed by `model.fit(feeder)`: the same weights as `fit(arrays)` on the same
order, padding weighted zero, a state that counts what the step trained on."""

from __future__ import annotations

import json

import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.keras_cases import BATCH, LENGTH, assert_same_weights, classifier, data, model


@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_on_the_feeder_equals_fit_on_arrays_in_the_same_order(keras, devices, shuffle):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=shuffle, seed=5) as feeder:
        fed = model(keras)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert feeder.get_state()["epoch"] == 2
    plan = Sampler(LENGTH, BATCH, shuffle=shuffle, seed=5)
    plain = model(keras)
    for epoch in range(2):
        order = plan.order(epoch)
        plain.fit(x[order], y[order], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


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


def test_padding_rows_weigh_nothing(keras, devices):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        batches = list(feeder.get_jax_iterator())
    *_, (_bx, by, weight) = batches
    weight = np.asarray(weight).ravel()
    assert weight[:4].tolist() == [BATCH / 4] * 4 and not weight[4:].any()
    assert np.asarray(by)[:4].tolist() == y[96:].tolist()


def test_a_sources_own_weights_are_scaled_and_zero_on_padding(keras, devices):
    x, y = data()
    given = np.linspace(0.5, 2.0, LENGTH).astype("float32")
    with fp.Feeder((x, y, given), BATCH, devices=devices[:1]) as feeder:
        batches = list(feeder.get_jax_iterator())
    assert len(batches[0]) == 3  # no weight added beside the source's
    np.testing.assert_allclose(np.asarray(batches[0][2]), given[:BATCH], rtol=1e-6)
    last = np.asarray(batches[-1][2])
    np.testing.assert_allclose(last[:4], given[96:] * BATCH / 4, rtol=1e-6)
    assert not last[4:].any()


def test_the_state_counts_the_steps_trained(keras, devices):
    x, y = data()

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        model(keras).fit(
            feeder, epochs=1, callbacks=[feeder.fit_callback(), StopAfterTwo()], verbose=0
        )
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 2)


def test_a_fit_interrupted_and_run_again_goes_on_from_what_was_trained(keras, devices):
    x, y = data()

    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        fed = model(keras)
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), CtrlC()], verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 2)
        # The notebook pattern: the same cell again trains the rest of the epoch, once.
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_a_state_saved_mid_fit_resumes_in_a_new_feeder_to_the_same_weights(keras, devices):
    x, y = data()
    saved = {}

    class SaveAtStepTwo(keras.callbacks.Callback):
        def __init__(self, feeder):
            super().__init__()
            self.feeder = feeder

        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                saved["state"] = json.loads(json.dumps(self.feeder.get_state()))
                saved["weights"] = self.model.get_weights()
                self.model.stop_training = True

    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=True, seed=2) as feeder:
        model(keras).fit(
            feeder, epochs=1, callbacks=[feeder.fit_callback(), SaveAtStepTwo(feeder)], verbose=0
        )
    assert saved["state"]["step"] == 2
    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=True, seed=2) as feeder:
        feeder.set_state(saved["state"])
        resumed = model(keras)
        resumed.set_weights(saved["weights"])
        resumed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)  # the rest
        resumed.fit(feeder, epochs=2, initial_epoch=1, callbacks=[feeder.fit_callback()], verbose=0)
    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=True, seed=2) as feeder:
        whole = model(keras)
        whole.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    assert_same_weights(resumed, whole)


def test_a_fit_of_several_epochs_after_a_restore_mid_epoch_finishes_it_then_trains_whole_ones(
    keras, devices
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        feeder.set_state({**feeder.get_state(), "step": 2})
        fed = model(keras)
        fed.set_weights(model(keras).get_weights())
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
    plain = model(keras)
    plain.fit(x[64:], y[64:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)


class CtrlCAfter:
    """A callback raising KeyboardInterrupt after step `step` of the first epoch (Ctrl-C)."""

    def __new__(cls, keras, step: int):
        class Interrupt(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if self.epoch == 0 and batch == step:
                    raise KeyboardInterrupt

        return Interrupt()


def test_the_same_fit_run_again_after_ctrl_c_finishes_the_epoch_then_whole_epochs_once(
    keras, devices
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=True, seed=3) as feeder:
        fed = model(keras)
        with pytest.raises(KeyboardInterrupt):
            fed.fit(
                feeder, epochs=3, callbacks=[feeder.fit_callback(), CtrlCAfter(keras, 1)], verbose=0
            )
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
    with fp.Feeder((x, y), BATCH, devices=devices[:1], shuffle=True, seed=3) as feeder:
        whole = model(keras)
        whole.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
    assert_same_weights(fed, whole)


def test_without_the_callback_the_state_says_why_it_is_unknown_naming_the_users_own_call(
    keras, devices
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        model(keras).fit(feeder, epochs=1, verbose=0)
        with pytest.raises(RuntimeError) as raised:
            feeder.get_state()
    message = str(raised.value)
    assert "model.fit(feeder, callbacks=[feeder.fit_callback(), ...])" in message
    assert "as_dataset" not in message and "TensorFlow" not in message


def test_a_feeder_on_more_devices_than_keras_trains_on_is_refused(keras, devices):
    x, y = data()
    refused = pytest.raises(ValueError, match="Keras has no distribution")
    with fp.Feeder((x, y), BATCH, devices=devices) as feeder, refused:
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)


def test_validation_data_reading_the_feeder_being_trained_is_refused(keras, devices):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        with pytest.raises(ValueError, match=r"`validation_data` reads the feeder this fit"):
            model(keras).fit(
                feeder, validation_data=feeder, epochs=2, callbacks=[feeder.fit_callback()]
            )
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)


def test_a_sources_error_leaves_fit_as_itself(keras, devices):
    class Broke(RuntimeError):
        pass

    class BreaksAt:
        def __len__(self):
            return LENGTH

        def __getitem__(self, index):
            if index == 40:
                raise Broke(f"sample {index} is broken")
            return np.float32([index] * 8), np.int32(index % 3)

    feeder = fp.Feeder(BreaksAt(), BATCH, devices=devices[:1])
    with feeder, pytest.raises(Broke, match=r"^sample 40 is broken\n") as info:
        model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
    assert any("sample index 40 of epoch 0" in note for note in info.value.__notes__)


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


def test_evaluate_on_the_feeder_counts_each_real_sample_once_in_every_metric(keras, devices):
    x, y = data()
    net = classifier(keras)
    with fp.Feeder((x, y), BATCH, devices=devices[:1]) as feeder:
        fed = net.evaluate(feeder, verbose=0, return_dict=True)
    plain = net.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert fed == pytest.approx(plain, rel=1e-5)


def test_predict_where_the_last_real_rows_cannot_be_sharded_says_to_use_one_device(keras, devices):
    x, y = (a[:37] for a in data())  # the last batch's 5 real rows cannot split among 4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    net = classifier(keras)
    refused = pytest.raises(
        ValueError, match=r"holds 5 real samples.*devices=\[jax\.devices\(\)\[0\]\]"
    )
    with fp.Feeder((x, y), 8, devices=devices) as feeder, refused:
        net.predict(feeder, verbose=0)


def counting(shard: int, num_shards: int):
    """A generator source of LENGTH samples, each one's features its index."""
    for index in range(shard, LENGTH, num_shards):
        yield np.full(8, index, np.float32), np.int32(index % 3)


class StepsSeen:
    """A callback recording the feeder's state after every step, and the steps run."""

    def __new__(cls, keras, feeder):
        class Seen(keras.callbacks.Callback):
            states, steps = [], 0

            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1
                self.states.append(json.loads(json.dumps(feeder.get_state())))

        return Seen()


def test_a_generator_state_saved_after_an_epochs_last_step_resumes_with_the_next_epoch(
    keras, devices
):
    steps = -(-LENGTH // BATCH)
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=devices[:1]) as feeder:
        seen = StepsSeen(keras, feeder)
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), seen], verbose=0)
    saved = seen.states[-1]  # after the epoch's last step
    for resume in ("fit", "loop"):
        with fp.Feeder(fp.from_generator(counting), BATCH, devices=devices[:1]) as feeder:
            feeder.set_state(saved)
            if resume == "fit":  # docs/fit.md's "finish that epoch in a fit of its own"
                again = StepsSeen(keras, feeder)
                callbacks = [feeder.fit_callback(), again]
                model(keras).fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
                assert again.steps == steps, "the next epoch, whole"
            else:
                firsts = [int(np.asarray(b.replicas[0][0])[0, 0]) for b in feeder]
                assert firsts == list(range(0, LENGTH, BATCH))
            assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (2, 0), resume


def test_a_generator_fit_of_several_epochs_from_mid_epoch_is_refused_with_the_fit_that_finishes_it(
    keras, devices
):
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=devices[:1]) as feeder:
        feeder.set_state({**feeder.get_state(), "step": 2})
        fed = model(keras)
        refused = pytest.raises(ValueError, match=r"at step 2 of epoch 0.*short ones.*epochs=1")
        with refused:
            fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        seen = StepsSeen(keras, feeder)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), seen], verbose=0)
        assert seen.steps == 2  # the rest of epoch 0
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
