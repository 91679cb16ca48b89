"""Promises a determined user tested by breaking them: a step that raises trains nothing, a
fit run again after Ctrl-C goes on from what it trained, a loop of exactly `len(feeder)`
batches leaves the next loop a whole epoch, a state past an epoch's end is refused, a
dataset repeated and prefetched keeps the state exact, and so does a fit over a generator,
whose epochs' length is unknown."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from tests.test_fit_checkpoints import InterruptAfter
from tests.worker_fakes import FEATURE_SHAPE, FailingSource, SourceBroke

# Each promise holds on both ways as_dataset() serves arrays.
pytestmark = pytest.mark.usefixtures("as_dataset_path")

LENGTH, BATCH = 64, 8
STEPS = LENGTH // BATCH


def ids_data() -> tuple[np.ndarray, np.ndarray]:
    """Each sample's one feature is its index."""
    return np.arange(LENGTH, dtype=np.float32)[:, None], np.zeros((LENGTH, 1), np.float32)


class FailsOnSample(keras.layers.Layer):
    """Raises inside the compiled step on the batch holding sample `index` (a NaN check, an
    assert, an out-of-memory error would do the same)."""

    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def call(self, x):
        check = tf.debugging.assert_none_equal(x, tf.constant(self.index, x.dtype))
        with tf.control_dependencies([check]):
            return tf.identity(x)


def failing_model(index: int) -> keras.Model:
    model = keras.Sequential([keras.Input((1,)), FailsOnSample(index), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def rest_of_epoch(feeder) -> list[int]:
    return [int(i) for batch in feeder for i in batch.replicas[0][0].numpy()[:, 0]]


def test_a_step_that_raises_under_fit_is_not_counted_as_trained():
    with fp.Feeder(ids_data(), BATCH) as feeder:
        with pytest.raises(tf.errors.InvalidArgumentError):
            failing_model(3 * BATCH).fit(
                feeder.as_dataset(), epochs=1, verbose=0, callbacks=[feeder.fit_callback()]
            )
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))


def test_a_step_that_raises_under_fp_train_is_not_counted_as_trained():
    with fp.Feeder(ids_data(), BATCH) as feeder:
        with pytest.raises(tf.errors.InvalidArgumentError):
            fp.train(failing_model(3 * BATCH), feeder, loss="mse", optimizer="sgd", verbose=0)
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 3)
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))


def test_a_fit_run_again_on_the_same_dataset_after_ctrl_c_never_trains_a_batch_twice():
    with fp.Feeder(ids_data(), BATCH) as feeder:
        dataset = feeder.as_dataset()
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        with pytest.raises(KeyboardInterrupt):
            model.fit(
                dataset, epochs=2, verbose=0, callbacks=[feeder.fit_callback(), InterruptAfter(2)]
            )
        # The notebook pattern: the same cell run again. The dataset holds whole epochs, so it
        # is refused, naming the interrupted fit and the call that goes on; nothing is retrained.
        goes_on = r"interrupted fit.*at step 3 of epoch 0.*model\.fit\(feeder, epochs=2"
        with pytest.raises(ValueError, match=goes_on):
            model.fit(dataset, epochs=2, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 3)
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))


@pytest.mark.parametrize("take", ["islice", "zip"])
def test_a_loop_of_exactly_len_batches_leaves_the_next_loop_a_whole_epoch(take):
    with fp.Feeder(ids_data(), BATCH) as feeder:
        lengths = []
        for _ in range(4):
            if take == "islice":
                taken = list(itertools.islice(feeder, len(feeder)))
            else:
                taken = [batch for _, batch in zip(range(len(feeder)), feeder, strict=False)]
            lengths.append(len(taken))
            del taken
        assert lengths == [STEPS] * 4
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (4, 0)


@pytest.mark.parametrize("step", [STEPS, 999])
def test_a_state_at_or_past_an_epochs_end_is_refused(step):
    with fp.Feeder(ids_data(), BATCH) as feeder:
        state = {**feeder.get_state(), "step": step}
        with pytest.raises(ValueError, match=rf"step={step} must be below {STEPS}.*'epoch': 1"):
            feeder.set_state(state)


class StateAtEachStep(keras.callbacks.Callback):
    """The feeder's state after each step, as a checkpoint there would save it."""

    def __init__(self, feeder):
        super().__init__()
        self.feeder, self.states = feeder, []

    def on_train_batch_end(self, batch, logs=None):
        state = self.feeder.get_state()
        self.states.append((state["epoch"], state["step"]))


def test_a_repeated_prefetched_dataset_keeps_the_state_exact():
    with fp.Feeder(ids_data(), BATCH) as feeder:
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        recorder = StateAtEachStep(feeder)
        model.fit(
            feeder.as_dataset().repeat().prefetch(3),
            steps_per_epoch=len(feeder),
            epochs=3,
            verbose=0,
            callbacks=[feeder.fit_callback(), recorder],
        )
        trained = [divmod(step, STEPS) for step in range(1, 3 * STEPS + 1)]
        assert recorder.states == trained
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
        assert rest_of_epoch(feeder) == list(range(LENGTH))


class LetsTheNextPassBegin(keras.callbacks.Callback):
    """At the fit's end, lets the gated pass begin (`ended`) and waits, while Keras still holds
    the fit's iterator: `after` the feeder was told the fit ended (this callback comes after
    the feeder's in the list), until the pass has begun; else, before the feeder is told, until
    the pass is halfway through beginning (`halfway`)."""

    def __init__(self, feeder, after: bool):
        super().__init__()
        self.feeder, self.after = feeder, after
        self.ended, self.halfway, self.began = threading.Event(), threading.Event(), False

    def on_train_end(self, logs=None):
        passes = self.feeder._consumer.passes
        self.ended.set()
        deadline = time.monotonic() + 60
        if not self.after:
            self.began = self.halfway.wait(60)
            return
        while self.feeder._consumer.passes == passes and time.monotonic() < deadline:
            time.sleep(0.01)
        self.began = self.feeder._consumer.passes > passes


@pytest.mark.parametrize("when", ["after the fit ended", "as the fit ends"])
def test_a_pass_tensorflow_reads_ahead_as_the_fit_ends_trains_nothing(when, monkeypatch):
    # A repeated, prefetched dataset is read on by TensorFlow's threads until Keras drops the
    # fit's iterator, so under load its next pass can begin after the fit's end was told to
    # the feeder, or while it is told. The gate holds the fourth pass back until then.
    with fp.Feeder(ids_data(), BATCH) as feeder:
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        after = when == "after the fit ended"
        dataset, told = feeder.as_dataset(), LetsTheNextPassBegin(feeder, after)
        ledger = feeder._consumer.fits
        check = ledger.check_passes_from

        def check_slowly(*args, **kwargs):  # called as a pass begins
            if told.ended.is_set() and threading.current_thread() is not threading.main_thread():
                told.halfway.set()
                time.sleep(0.5)
            return check(*args, **kwargs)

        monkeypatch.setattr(ledger, "check_passes_from", check_slowly)

        def gate(index):
            if index == 3:
                told.ended.wait(60)
            return index

        passes = (
            tf.data.Dataset.range(4)
            .map(lambda i: tf.numpy_function(gate, [i], tf.int64))
            .flat_map(lambda _: dataset)
            .prefetch(3)
        )
        tracker = feeder.fit_callback()
        model.fit(
            passes,
            steps_per_epoch=STEPS,
            epochs=3,
            verbose=0,
            callbacks=[tracker, told] if after else [told, tracker],
        )
        assert told.began, "the fourth pass never began"
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
        assert rest_of_epoch(feeder) == list(range(LENGTH))


def test_a_new_dataset_read_without_the_callback_after_a_tracked_fit_has_no_state():
    with fp.Feeder(ids_data(), BATCH) as feeder:
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(feeder.as_dataset(), verbose=0, callbacks=[feeder.fit_callback()])
        assert feeder.get_state()["epoch"] == 1
        model.fit(feeder.as_dataset(), verbose=0)
        with pytest.raises(RuntimeError, match="cannot tell which batches"):
            feeder.get_state()


def dense_model() -> keras.Model:
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize("wrapped", [False, True], ids=["as it is", "prefetched"])
def test_validation_data_reading_the_feeder_being_trained_is_refused(wrapped):
    with fp.Feeder(ids_data(), BATCH) as feeder:
        dataset = feeder.as_dataset()
        validation = dataset.prefetch(2) if wrapped else dataset
        with pytest.raises(ValueError, match=r"`validation_data` reads the feeder this fit"):
            dense_model().fit(
                dataset,
                validation_data=validation,
                epochs=2,
                verbose=0,
                callbacks=[feeder.fit_callback()],
            )
        # Validation never read the feeder: the first epoch trained, the second never began.
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)


def test_validation_data_of_its_own_is_taken():
    with fp.Feeder(ids_data(), BATCH) as feeder, fp.Feeder(ids_data(), BATCH) as other:
        history = dense_model().fit(
            feeder.as_dataset(),
            validation_data=other.as_dataset(),
            epochs=2,
            verbose=0,
            callbacks=[feeder.fit_callback()],
        )
        assert len(history.history["val_loss"]) == 2
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (2, 0)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("at", [3, 5 * BATCH + 1], ids=["first batch", "sixth batch"])
def test_a_sources_error_leaves_fit_as_itself_without_a_strategy(workers, at):
    feeder = fp.Feeder(FailingSource(LENGTH, fail_at=at), BATCH, workers=workers)
    model = keras.Sequential([keras.Input(FEATURE_SHAPE), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with feeder, pytest.raises(SourceBroke, match=rf"^sample {at} is broken\n") as info:
        model.fit(feeder.as_dataset(), epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
    notes = getattr(info.value, "__notes__", [])
    assert any(f"sample index {at} of epoch 0" in note for note in notes), notes


def counting(shard: int, num_shards: int):
    for index in range(shard, LENGTH, num_shards):
        yield np.float32([index]), np.float32([0])


def test_a_generator_sources_epochs_end_without_keras_warning_the_input_ran_out():
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dense_model().fit(
                feeder.as_dataset(), epochs=3, verbose=0, callbacks=[feeder.fit_callback()]
            )
        assert not [w for w in seen if "ran out of data" in str(w.message)]
        assert feeder.get_state()["epoch"] == 3
    # Only that fit was quiet: Keras warns again where an input really runs short.
    short = tf.data.Dataset.from_tensor_slices((ids_data()[0], ids_data()[1])).batch(BATCH)
    with pytest.warns(UserWarning, match="ran out of data"):
        dense_model().fit(short, steps_per_epoch=STEPS + 2, epochs=1, verbose=0)


class StateAtEachEpochBegin(StateAtEachStep):
    """The feeder's state as each epoch begins, before its first batch is read."""

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_epoch_begin(self, epoch, logs=None):
        super().on_train_batch_end(0)


def test_a_generator_sources_fit_state_is_the_batches_trained_at_each_step_and_after():
    # The epoch's length is unknown: the state counts the steps of each pass of the dataset,
    # which a prefetch reads ahead of the step.
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        steps, epochs = StateAtEachStep(feeder), StateAtEachEpochBegin(feeder)
        dense_model().fit(
            feeder.as_dataset().prefetch(2),
            epochs=3,
            verbose=0,
            callbacks=[feeder.fit_callback(), steps, epochs],
        )
        # At an epoch's last step the pass may not have met its end yet: (e, STEPS) is (e + 1, 0).
        assert [epoch * STEPS + step for epoch, step in steps.states] == list(
            range(1, 3 * STEPS + 1)
        )
        assert epochs.states == [(0, 0), (1, 0), (2, 0)]
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)
        assert rest_of_epoch(feeder) == list(range(LENGTH))


def test_a_generator_sources_fit_after_ctrl_c_goes_on_from_what_it_trained():
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        with pytest.raises(KeyboardInterrupt):
            dense_model().fit(
                feeder.as_dataset(),
                epochs=2,
                verbose=0,
                callbacks=[feeder.fit_callback(), InterruptAfter(2)],
            )
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 3)
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))


@pytest.mark.parametrize("entry", ["as_dataset", "feeder"])
def test_the_state_read_right_after_a_step_raised_is_where_the_feeder_goes_on(entry):
    with fp.Feeder(ids_data(), BATCH) as feeder:
        data = feeder.as_dataset() if entry == "as_dataset" else feeder
        with pytest.raises(tf.errors.InvalidArgumentError):
            failing_model(3 * BATCH).fit(
                data, epochs=1, verbose=0, callbacks=[feeder.fit_callback()]
            )
        state = feeder.get_state()  # read first, as a handler saving a checkpoint does
        assert (state["epoch"], state["step"]) == (0, 3)
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))


class SigintAtSample(keras.layers.Layer):
    """Sends this process SIGINT, as Ctrl-C in a terminal does, from inside the step on the
    batch holding sample `index`: Python raises KeyboardInterrupt once the step's op returns."""

    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = index

    def call(self, x):
        def press(batch):
            if self.index in batch:
                os.kill(os.getpid(), signal.SIGINT)
            return batch

        pressed = tf.numpy_function(press, [x], x.dtype, stateful=True)
        return tf.reshape(pressed, tf.shape(x))


class SigintBeforeStep(keras.callbacks.Callback):
    """Sends this process SIGINT as step `step` is about to run."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.step:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # Python raises KeyboardInterrupt here, at the latest


@pytest.mark.parametrize("entry", ["as_dataset", "feeder"])
@pytest.mark.parametrize("where", ["in the step", "before the step"])
def test_a_checkpoint_saved_in_the_ctrl_c_handler_restores_to_where_the_feeder_goes_on(
    entry, where
):
    with fp.Feeder(ids_data(), BATCH) as feeder:
        data = feeder.as_dataset() if entry == "as_dataset" else feeder
        layers = [keras.Input((1,)), keras.layers.Dense(1)]
        callbacks = [feeder.fit_callback()]
        if where == "in the step":
            layers.insert(1, SigintAtSample(3 * BATCH))
        else:
            callbacks.append(SigintBeforeStep(3))
        model = keras.Sequential(layers)
        model.compile("sgd", "mse")
        try:
            model.fit(data, epochs=2, verbose=0, callbacks=callbacks)
        except KeyboardInterrupt:
            saved = json.loads(json.dumps(feeder.get_state()))  # the user's handler
        else:
            pytest.fail("Ctrl-C did not interrupt the fit")
        goes_on = rest_of_epoch(feeder)
    assert goes_on[0] == saved["step"] * BATCH, (saved, goes_on[:1])
    with fp.Feeder(ids_data(), BATCH) as restored:
        restored.set_state(saved)
        assert rest_of_epoch(restored) == goes_on


SAFETY_S = 120.0
"""How long a step that waits for a second Ctrl-C blocks at most: past it the step returns, and
the test fails (a second Ctrl-C lands within milliseconds)."""


class CtrlCTwiceInStep(keras.layers.Layer):
    """In the eager step on the batch holding sample `index`, once: a Ctrl-C that the feeder's
    guard holds, then a second one from another thread while the step blocks on an event that
    nothing sets, for `SAFETY_S` at most. `completed` records a step that came out of it."""

    def __init__(self, index: int, **kwargs):
        super().__init__(**kwargs)
        self.index = index
        self.pressed = False
        self.completed = False

    def call(self, x):
        if tf.executing_eagerly() and not self.pressed and self.index in x.numpy():
            self.pressed = True
            signal.raise_signal(signal.SIGINT)  # handled before this returns: held
            threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()
            threading.Event().wait(SAFETY_S)
            self.completed = True
        return x


@pytest.mark.parametrize("entry", ["as_dataset", "feeder"])
def test_a_second_ctrl_c_interrupts_a_step_at_once_and_leaves_the_handler_the_fit_found(entry):
    handler = signal.getsignal(signal.SIGINT)
    with fp.Feeder(ids_data(), BATCH) as feeder:
        data = feeder.as_dataset() if entry == "as_dataset" else feeder
        pressing = CtrlCTwiceInStep(3 * BATCH)
        model = keras.Sequential([keras.Input((1,)), pressing, keras.layers.Dense(1)])
        model.compile("sgd", "mse", run_eagerly=True)
        with pytest.raises(KeyboardInterrupt):
            model.fit(data, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
        assert pressing.pressed and not pressing.completed, "the step ran to its end"
        assert signal.getsignal(signal.SIGINT) is handler
        state = feeder.get_state()
        assert (state["epoch"], state["step"]) == (0, 3), "the step under way never returned"
        # The notebook's next cell trains the rest of the epoch, under the same handler.
        model.fit(feeder, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
        assert signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("entry", ["as_dataset", "feeder"])
def test_a_generator_fit_of_several_epochs_from_mid_epoch_is_refused_with_the_fit_that_finishes_it(
    entry,
):
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        for _, _ in zip(range(3), feeder, strict=False):
            pass
        state = feeder.get_state()
    assert (state["epoch"], state["step"]) == (0, 3)
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        feeder.set_state(state)
        data = feeder.as_dataset() if entry == "as_dataset" else feeder
        call = r"feeder\.as_dataset\(\)" if entry == "as_dataset" else "feeder"
        refused = rf"at step 3 of epoch 0.*short ones.*model\.fit\({call}, epochs=1"
        with pytest.raises(ValueError, match=refused):
            dense_model().fit(data, epochs=3, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (0, 3)
        # The fit it names finishes the epoch; whole epochs follow.
        dense_model().fit(data, epochs=1, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (1, 0)
        dense_model().fit(data, epochs=2, verbose=0, callbacks=[feeder.fit_callback()])
        assert (feeder.get_state()["epoch"], feeder.get_state()["step"]) == (3, 0)


def test_a_generator_fit_run_again_after_ctrl_c_names_the_interrupted_fit():
    with fp.Feeder(fp.from_generator(counting), BATCH) as feeder:
        model = dense_model()
        with pytest.raises(KeyboardInterrupt):
            model.fit(
                feeder, epochs=3, verbose=0, callbacks=[feeder.fit_callback(), InterruptAfter(2)]
            )
        with pytest.raises(ValueError, match=r"interrupted.*at step 3 of epoch 0.*epochs=1"):
            model.fit(feeder, epochs=3, verbose=0, callbacks=[feeder.fit_callback()])
        assert rest_of_epoch(feeder) == list(range(3 * BATCH, LENGTH))
