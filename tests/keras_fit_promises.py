"""The promises of `model.fit(feeder)` on every Keras backend fed staged batches (JAX, PyTorch):
the same weights as `fit(arrays)` in the same order, a state that counts what the step trained
(through Ctrl-C, re-runs, restores and generators of unknown length), and errors that name the
user's own call. Each backend's Keras test module imports them; its conftest gives the `keras`
fixture and `keras_devices`, the one device Keras trains on there (this module imports no
framework)."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.keras_cases import BATCH, LENGTH, assert_same_weights, classifier, data, model


def position(feeder) -> tuple[int, int]:
    state = feeder.get_state()
    return state["epoch"], state["step"]


class StepsSeen:
    """A callback recording the feeder's state after every step, and the steps run."""

    def __new__(cls, keras, feeder):
        class Seen(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.states, self.steps = [], 0

            def on_train_batch_end(self, batch, logs=None):
                self.steps += 1
                self.states.append(json.loads(json.dumps(feeder.get_state())))

        return Seen()


@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_on_the_feeder_equals_fit_on_arrays_in_the_same_order(keras, keras_devices, shuffle):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=keras_devices, shuffle=shuffle, seed=5) as feeder:
        fed = model(keras)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert position(feeder) == (2, 0)
    plan = Sampler(LENGTH, BATCH, shuffle=shuffle, seed=5)
    plain = model(keras)
    for epoch in range(2):
        order = plan.order(epoch)
        plain.fit(x[order], y[order], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_the_state_in_a_callback_counts_the_steps_trained(keras, keras_devices):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        seen = StepsSeen(keras, feeder)
        model(keras).fit(feeder, epochs=2, callbacks=[feeder.fit_callback(), seen], verbose=0)
    steps = -(-LENGTH // BATCH)
    positions = [(s["epoch"], s["step"]) for s in seen.states]
    expected = [(0, k) for k in range(1, steps)] + [(1, 0)]
    assert positions == expected + [(1, k) for k in range(1, steps)] + [(2, 0)]


def test_the_state_counts_the_steps_trained_when_fit_stops_early(keras, keras_devices):
    x, y = data()

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        model(keras).fit(
            feeder, epochs=1, callbacks=[feeder.fit_callback(), StopAfterTwo()], verbose=0
        )
        assert position(feeder) == (0, 2)


def test_a_fit_interrupted_and_run_again_goes_on_from_what_was_trained(keras, keras_devices):
    x, y = data()

    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        fed = model(keras)
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), CtrlC()], verbose=0)
        assert position(feeder) == (0, 2)
        # The notebook pattern: the same cell again trains the rest of the epoch, once.
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        assert position(feeder) == (1, 0)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_ctrl_c_raises_at_once_outside_the_fit_and_the_fit_puts_its_handler_back(
    keras, keras_devices
):
    # The fit callback holds a Ctrl-C that arrives in a step until the step is recorded. A fit
    # a callback interrupts leaves its handler in place until the feeder is next read: no
    # Ctrl-C may wait on that fit, over, meanwhile.
    x, y = data()
    handler = signal.getsignal(signal.SIGINT)

    class CtrlC(keras.callbacks.Callback):
        def __init__(self, real: bool):
            super().__init__()
            self.real = real

        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and self.real:
                os.kill(os.getpid(), signal.SIGINT)  # Python handles it as the call returns
            elif batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        fed = model(keras)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        assert signal.getsignal(signal.SIGINT) is handler
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, callbacks=[feeder.fit_callback(), CtrlC(real=False)], verbose=0)
        with pytest.raises(KeyboardInterrupt):  # another fit, without the feeder's callback
            fed.fit(x, y, batch_size=BATCH, callbacks=[CtrlC(real=True)], verbose=0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
        assert position(feeder) == (2, 0)
        assert signal.getsignal(signal.SIGINT) is handler


def test_a_state_saved_mid_fit_resumes_in_a_new_feeder_to_the_same_weights(keras, keras_devices):
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

    def feeder():
        return fp.Feeder((x, y), BATCH, devices=keras_devices, shuffle=True, seed=2)

    with feeder() as first:
        model(keras).fit(
            first, epochs=1, callbacks=[first.fit_callback(), SaveAtStepTwo(first)], verbose=0
        )
    assert saved["state"]["step"] == 2
    with feeder() as restored:
        restored.set_state(saved["state"])
        resumed = model(keras)
        resumed.set_weights(saved["weights"])
        callbacks = [restored.fit_callback()]
        resumed.fit(restored, epochs=1, callbacks=callbacks, verbose=0)  # the rest
        resumed.fit(restored, epochs=2, initial_epoch=1, callbacks=callbacks, verbose=0)
    with feeder() as again:
        whole = model(keras)
        whole.fit(again, epochs=2, callbacks=[again.fit_callback()], verbose=0)
    assert_same_weights(resumed, whole)


def test_a_fit_of_several_epochs_after_a_restore_mid_epoch_finishes_it_then_trains_whole_ones(
    keras, keras_devices
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        feeder.set_state({**feeder.get_state(), "step": 2})
        fed = model(keras)
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert position(feeder) == (3, 0)
    plain = model(keras)
    plain.fit(x[64:], y[64:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)


def test_the_same_fit_run_again_after_ctrl_c_finishes_the_epoch_then_whole_epochs_once(
    keras, keras_devices
):
    x, y = data()

    class CtrlCInFirstEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 0 and batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=keras_devices, shuffle=True, seed=3) as feeder:
        fed = model(keras)
        callbacks = [feeder.fit_callback(), CtrlCInFirstEpoch()]
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=3, callbacks=callbacks, verbose=0)
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert position(feeder) == (3, 0)
    with fp.Feeder((x, y), BATCH, devices=keras_devices, shuffle=True, seed=3) as feeder:
        whole = model(keras)
        whole.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
    assert_same_weights(fed, whole)


def test_without_the_callback_the_state_says_why_it_is_unknown_naming_the_users_own_call(
    keras, keras_devices
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        model(keras).fit(feeder, epochs=1, verbose=0)
        with pytest.raises(RuntimeError) as raised:
            feeder.get_state()
    message = str(raised.value)
    assert "model.fit(feeder, callbacks=[feeder.fit_callback(), ...])" in message
    assert "as_dataset" not in message and "TensorFlow" not in message


def test_validation_data_reading_the_feeder_being_trained_is_refused(keras, keras_devices):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        with pytest.raises(ValueError, match=r"`validation_data` reads the feeder this fit"):
            model(keras).fit(
                feeder,
                validation_data=feeder,
                epochs=2,
                callbacks=[feeder.fit_callback()],
                verbose=0,
            )
        assert position(feeder) == (1, 0)


def test_a_sources_error_leaves_fit_as_itself(keras, keras_devices):
    class Broke(RuntimeError):
        pass

    class BreaksAt:
        def __len__(self):
            return LENGTH

        def __getitem__(self, index):
            if index == 40:
                raise Broke(f"sample {index} is broken")
            return np.float32([index] * 8), np.int32(index % 3)

    feeder = fp.Feeder(BreaksAt(), BATCH, devices=keras_devices)
    with feeder, pytest.raises(Broke, match=r"^sample 40 is broken\n") as info:
        model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
    assert any("sample index 40 of epoch 0" in note for note in info.value.__notes__)


def test_evaluate_on_the_feeder_counts_each_real_sample_once_in_every_metric(keras, keras_devices):
    x, y = data()
    net = classifier(keras)
    with fp.Feeder((x, y), BATCH, devices=keras_devices) as feeder:
        fed = net.evaluate(feeder, verbose=0, return_dict=True)
    plain = net.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert fed == pytest.approx(plain, rel=1e-5)


def counting(shard: int, num_shards: int):
    """A generator source of LENGTH samples, each one's features its index."""
    for index in range(shard, LENGTH, num_shards):
        yield np.full(8, index, np.float32), np.int32(index % 3)


def test_a_generator_state_saved_after_an_epochs_last_step_resumes_with_the_next_epoch(
    keras, keras_devices
):
    steps = -(-LENGTH // BATCH)
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=keras_devices) as feeder:
        seen = StepsSeen(keras, feeder)
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), seen], verbose=0)
    saved = seen.states[-1]  # after the epoch's last step
    for resume in ("fit", "loop"):
        with fp.Feeder(fp.from_generator(counting), BATCH, devices=keras_devices) as feeder:
            feeder.set_state(saved)
            if resume == "fit":  # docs/fit.md's "finish that epoch in a fit of its own"
                again = StepsSeen(keras, feeder)
                callbacks = [feeder.fit_callback(), again]
                model(keras).fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
                assert again.steps == steps, "the next epoch, whole"
            else:
                firsts = [int(np.asarray(b.replicas[0][0])[0, 0]) for b in feeder]
                assert firsts == list(range(0, LENGTH, BATCH))
            assert position(feeder) == (2, 0), resume


def test_a_generator_fit_of_several_epochs_from_mid_epoch_is_refused_with_the_fit_that_finishes_it(
    keras, keras_devices
):
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=keras_devices) as feeder:
        feeder.set_state({**feeder.get_state(), "step": 2})
        fed = model(keras)
        refused = pytest.raises(ValueError, match=r"at step 2 of epoch 0.*short ones.*epochs=1")
        with refused:
            fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        seen = StepsSeen(keras, feeder)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), seen], verbose=0)
        assert seen.steps == 2  # the rest of epoch 0
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert position(feeder) == (3, 0)
