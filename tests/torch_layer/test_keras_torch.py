"""Keras 3 on PyTorch fed by `model.fit(feeder)`: the same weights as `fit(arrays)` on the same
order, padding weighted zero, a state that counts what the step trained on, and `predict` and
`evaluate` on the real rows alone."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.keras_cases import BATCH, LENGTH, assert_same_weights, classifier, data, model
from tests.processes import REPO_ROOT

CPU = [torch.device("cpu")]
"""The device Keras on PyTorch trains on here."""


def position(feeder) -> tuple[int, int]:
    state = feeder.get_state()
    return state["epoch"], state["step"]


@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_on_the_feeder_equals_fit_on_arrays_in_the_same_order(keras, shuffle):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=shuffle, seed=5) as feeder:
        fed = model(keras)
        fed.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
        assert position(feeder) == (2, 0)
    plan = Sampler(LENGTH, BATCH, shuffle=shuffle, seed=5)
    plain = model(keras)
    for epoch in range(2):
        order = plan.order(epoch)
        plain.fit(x[order], y[order], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_a_feeder_built_without_devices_under_keras_on_torch_stages_for_it(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH) as feeder:
        assert feeder.layer.name == "torch"
        fed = model(keras)
        fed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    assert_same_weights(fed, plain)


def test_padding_rows_weigh_nothing(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        batches = list(feeder.get_torch_dataloader())
    *_, (_bx, by, weight) = batches
    assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
    assert weight[:4].tolist() == [BATCH / 4] * 4 and not weight[4:].any()
    assert by[:4].tolist() == y[96:].tolist()
    assert batches[0][2].tolist() == [1.0] * BATCH


def test_each_label_field_gets_weights_of_its_own_rank(keras):
    x, y = data()
    targets = {"class": y, "box": np.zeros((LENGTH, 4), np.float32)}
    with fp.Feeder((x, targets), BATCH, devices=CPU) as feeder:
        *_, (_, _, weights) = list(feeder.get_torch_dataloader())
    assert weights["class"].shape == (BATCH,) and weights["box"].shape == (BATCH, 1)
    assert weights["class"].data_ptr() != weights["box"].data_ptr()


def test_a_sources_own_weights_are_scaled_and_zero_on_padding(keras):
    x, y = data()
    given = np.linspace(0.5, 2.0, LENGTH).astype("float32")
    with fp.Feeder((x, y, given), BATCH, devices=CPU) as feeder:
        batches = list(feeder.get_torch_dataloader())
    assert len(batches[0]) == 3  # no weight added beside the source's
    np.testing.assert_allclose(batches[0][2].numpy(), given[:BATCH], rtol=1e-6)
    last = batches[-1][2].numpy()
    np.testing.assert_allclose(last[:4], given[96:] * BATCH / 4, rtol=1e-6)
    assert not last[4:].any()


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


def test_the_state_in_a_callback_counts_the_steps_trained(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        seen = StepsSeen(keras, feeder)
        model(keras).fit(feeder, epochs=2, callbacks=[feeder.fit_callback(), seen], verbose=0)
    steps = -(-LENGTH // BATCH)
    positions = [(s["epoch"], s["step"]) for s in seen.states]
    expected = [(0, k) for k in range(1, steps)] + [(1, 0)]
    assert positions == expected + [(1, k) for k in range(1, steps)] + [(2, 0)]


def test_the_state_counts_the_steps_trained_when_fit_stops_early(keras):
    x, y = data()

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        model(keras).fit(
            feeder, epochs=1, callbacks=[feeder.fit_callback(), StopAfterTwo()], verbose=0
        )
        assert position(feeder) == (0, 2)


def test_a_fit_interrupted_and_run_again_goes_on_from_what_was_trained(keras):
    x, y = data()

    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
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


def test_a_state_saved_mid_fit_resumes_in_a_new_feeder_to_the_same_weights(keras):
    x, y = data()
    saved = {}

    class SaveAtStepTwo(keras.callbacks.Callback):
        def __init__(self, feeder):
            super().__init__()
            self.feeder = feeder

        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                saved["state"] = json.loads(json.dumps(self.feeder.state_dict()))
                saved["weights"] = self.model.get_weights()
                self.model.stop_training = True

    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True, seed=2) as feeder:
        model(keras).fit(
            feeder, epochs=1, callbacks=[feeder.fit_callback(), SaveAtStepTwo(feeder)], verbose=0
        )
    assert saved["state"]["step"] == 2
    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True, seed=2) as feeder:
        feeder.load_state_dict(saved["state"])
        resumed = model(keras)
        resumed.set_weights(saved["weights"])
        resumed.fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)  # the rest
        resumed.fit(feeder, epochs=2, initial_epoch=1, callbacks=[feeder.fit_callback()], verbose=0)
    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True, seed=2) as feeder:
        whole = model(keras)
        whole.fit(feeder, epochs=2, callbacks=[feeder.fit_callback()], verbose=0)
    assert_same_weights(resumed, whole)


def test_a_fit_of_several_epochs_after_a_restore_mid_epoch_finishes_it_then_trains_whole_ones(
    keras,
):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        feeder.set_state({**feeder.get_state(), "step": 2})
        fed = model(keras)
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert position(feeder) == (3, 0)
    plain = model(keras)
    plain.fit(x[64:], y[64:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)


def test_the_same_fit_run_again_after_ctrl_c_finishes_the_epoch_then_whole_epochs_once(keras):
    x, y = data()

    class CtrlCInFirstEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 0 and batch == 1:
                raise KeyboardInterrupt

    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True, seed=3) as feeder:
        fed = model(keras)
        callbacks = [feeder.fit_callback(), CtrlCInFirstEpoch()]
        with pytest.raises(KeyboardInterrupt):
            fed.fit(feeder, epochs=3, callbacks=callbacks, verbose=0)
        history = fed.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
        assert len(history.history["loss"]) == 3
        assert position(feeder) == (3, 0)
    with fp.Feeder((x, y), BATCH, devices=CPU, shuffle=True, seed=3) as feeder:
        whole = model(keras)
        whole.fit(feeder, epochs=3, callbacks=[feeder.fit_callback()], verbose=0)
    assert_same_weights(fed, whole)


def test_without_the_callback_the_state_says_why_it_is_unknown_naming_the_users_own_call(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        model(keras).fit(feeder, epochs=1, verbose=0)
        with pytest.raises(RuntimeError) as raised:
            feeder.get_state()
    message = str(raised.value)
    assert "model.fit(feeder, callbacks=[feeder.fit_callback(), ...])" in message
    assert "as_dataset" not in message and "TensorFlow" not in message


def test_a_feeder_on_more_devices_than_keras_trains_on_is_refused(keras):
    x, y = data()
    refused = pytest.raises(
        ValueError, match=r"Keras's torch backend trains on cpu, but the feeder stages on"
    )
    with fp.Feeder((x, y), BATCH, devices=["cpu", "cpu"], framework="torch") as feeder, refused:
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback()], verbose=0)


def test_validation_data_from_a_second_feeder_is_evaluated_on_its_real_rows(keras):
    x, y = data()
    vx, vy = data(37)  # 37 = 4 batches of 8 and 5 real rows in a padded fifth
    with (
        fp.Feeder((x, y), BATCH, devices=CPU) as feeder,
        fp.Feeder((vx, vy), 8, devices=CPU) as validation,
    ):
        fed = model(keras)
        history = fed.fit(
            feeder,
            validation_data=validation,
            epochs=2,
            callbacks=[feeder.fit_callback()],
            verbose=0,
        )
        assert position(feeder) == (2, 0)
    assert len(history.history["val_loss"]) == 2
    plain = model(keras)
    plain.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
    assert_same_weights(fed, plain)
    last = plain.evaluate(vx, vy, batch_size=8, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(last, rel=1e-5)


def test_validation_data_reading_the_feeder_being_trained_is_refused(keras):
    x, y = data()
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        with pytest.raises(ValueError, match=r"`validation_data` reads the feeder this fit"):
            model(keras).fit(
                feeder,
                validation_data=feeder,
                epochs=2,
                callbacks=[feeder.fit_callback()],
                verbose=0,
            )
        assert position(feeder) == (1, 0)


def test_a_sources_error_leaves_fit_as_itself(keras):
    class Broke(RuntimeError):
        pass

    class BreaksAt:
        def __len__(self):
            return LENGTH

        def __getitem__(self, index):
            if index == 40:
                raise Broke(f"sample {index} is broken")
            return np.float32([index] * 8), np.int32(index % 3)

    feeder = fp.Feeder(BreaksAt(), BATCH, devices=CPU)
    with feeder, pytest.raises(Broke, match=r"^sample 40 is broken\n") as info:
        model(keras).fit(feeder, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
    assert any("sample index 40 of epoch 0" in note for note in info.value.__notes__)


def test_predict_on_the_feeder_returns_one_prediction_per_real_sample(keras):
    x, y = data(37)
    net = classifier(keras)
    with fp.Feeder((x, y), 8, devices=CPU) as feeder:
        predicted = net.predict(feeder, verbose=0)
    assert predicted.shape == (37, 3)
    np.testing.assert_allclose(predicted, net.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_leaves_out_a_skipped_samples_row_wherever_it_is(keras):
    x, y = data(37)

    class SkipsSample3:
        def __len__(self):
            return 37

        def __getitem__(self, index):
            if index == 3:
                raise ValueError("unreadable")
            return x[index], y[index]

    net = classifier(keras)
    with fp.Feeder(SkipsSample3(), 8, devices=CPU, errors="skip") as feeder:
        predicted = net.predict(feeder, verbose=0)
    kept = np.delete(x, 3, axis=0)
    assert predicted.shape == (36, 3)
    np.testing.assert_allclose(predicted, net.predict(kept, verbose=0), rtol=1e-5, atol=1e-6)


def test_evaluate_on_the_feeder_counts_each_real_sample_once_in_every_metric(keras):
    x, y = data()
    net = classifier(keras)
    with fp.Feeder((x, y), BATCH, devices=CPU) as feeder:
        fed = net.evaluate(feeder, verbose=0, return_dict=True)
    plain = net.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert fed == pytest.approx(plain, rel=1e-5)


def counting(shard: int, num_shards: int):
    """A generator source of LENGTH samples, each one's features its index."""
    for index in range(shard, LENGTH, num_shards):
        yield np.full(8, index, np.float32), np.int32(index % 3)


def test_a_generator_state_saved_after_an_epochs_last_step_resumes_with_the_next_epoch(keras):
    steps = -(-LENGTH // BATCH)
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=CPU) as feeder:
        seen = StepsSeen(keras, feeder)
        model(keras).fit(feeder, epochs=1, callbacks=[feeder.fit_callback(), seen], verbose=0)
    saved = seen.states[-1]  # after the epoch's last step
    for resume in ("fit", "loop"):
        with fp.Feeder(fp.from_generator(counting), BATCH, devices=CPU) as feeder:
            feeder.set_state(saved)
            if resume == "fit":
                again = StepsSeen(keras, feeder)
                callbacks = [feeder.fit_callback(), again]
                model(keras).fit(feeder, epochs=1, callbacks=callbacks, verbose=0)
                assert again.steps == steps, "the next epoch, whole"
            else:
                firsts = [int(b.replicas[0][0][0, 0]) for b in feeder]
                assert firsts == list(range(0, LENGTH, BATCH))
            assert position(feeder) == (2, 0), resume


def test_a_generator_fit_of_several_epochs_from_mid_epoch_is_refused_with_the_fit_that_finishes_it(
    keras,
):
    with fp.Feeder(fp.from_generator(counting), BATCH, devices=CPU) as feeder:
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


def test_the_example_fits_on_the_feeder_and_predicts_every_held_out_sample(keras, capsys):
    runpy.run_path(str(REPO_ROOT / "examples" / "keras_torch.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "200 predictions for 200 held-out samples" in printed
    assert "'epoch': 3, 'step': 0" in printed
    assert printed.count("StarvationMonitor epoch") == 3


FIT_PREDICT_MONITOR_DIAGNOSE = """
import json, sys
import keras
import numpy as np
import feedpipe as fp

rng = np.random.default_rng(0)
x, y = rng.normal(size=(40, 3)).astype("float32"), rng.normal(size=40).astype("float32")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
with fp.Feeder((x, y), 8) as feeder:
    monitor = fp.StarvationMonitor(verbose=0, headspace_steps=2)
    model.fit(feeder, epochs=2, verbose=0, callbacks=[feeder.fit_callback(), monitor])
    predicted = model.predict(feeder, verbose=0)
    fp.diagnose(feeder, model, steps=2, warmup=1, progress=False)
loaded = sorted({name.split(".")[0] for name in sys.modules} & {"tensorflow", "jax"})
print(json.dumps([keras.backend.backend(), len(predicted), len(monitor.epochs), loaded]))
"""


def test_keras_on_torch_loads_neither_tensorflow_nor_jax():
    """A fresh interpreter, as a user with KERAS_BACKEND=torch runs it: fit, predict, the
    monitor and a diagnosis, where any of them reaching for TensorFlow or JAX would show."""
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", FIT_PREDICT_MONITOR_DIAGNOSE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    backend, predictions, epochs, loaded = json.loads(done.stdout.splitlines()[-1])
    assert (backend, predictions, epochs, loaded) == ("torch", 40, 2, [])
