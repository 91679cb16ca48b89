"""Consumers under tf.distribute: `strategy.run` over `Batch.distributed()`, and `model.fit` /
`model.evaluate` over `Feeder.as_dataset()` with a MirroredStrategy on four logical CPUs."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from tests.fakes import TransformBroke, index_arrays

NUM_FEATURES = 4


def regression_data(length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((length, NUM_FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, NUM_FEATURES + 1, dtype=np.float32) + 0.5)[:, None]
    return x, y


@pytest.mark.parametrize("shuffle", [False, True])
def test_strategy_run_sums_each_replicas_rows(strategy, shuffle):
    x, y = regression_data(21)
    per_replica = 2

    @tf.function
    def masked_sums(inputs, mask):
        def replica_sum(sample, real):
            features, _ = sample
            return tf.reduce_sum(tf.where(real[:, None], features, 0.0), axis=0)

        return strategy.run(replica_sum, args=(inputs, mask))

    with fp.Feeder((x, y), 8, strategy=strategy, shuffle=shuffle, seed=1) as feeder:
        sampler_order = feeder._assembly.sampler.order(0)
        steps = 0
        for batch in feeder:
            inputs, mask = batch.distributed()
            sums = strategy.experimental_local_results(masked_sums(inputs, mask))
            rows = sampler_order[batch.step * 8 : (batch.step + 1) * 8]
            assert len(sums) == 4
            for r, total in enumerate(sums):
                mine = rows[r * per_replica : (r + 1) * per_replica]  # empty for all-padding
                np.testing.assert_allclose(total.numpy(), x[mine].sum(axis=0), rtol=1e-6, atol=1e-6)
            steps += 1
        assert steps == 3


def test_distributed_values_sit_on_the_replica_devices(strategy):
    with fp.Feeder(index_arrays(8), 8, strategy=strategy) as feeder:
        inputs, mask = next(iter(feeder)).distributed()
        for r, (features, real) in enumerate(
            zip(
                strategy.experimental_local_results(inputs[0]),
                strategy.experimental_local_results(mask),
                strict=True,
            )
        ):
            assert features.device.endswith(f"CPU:{r}") and real.device.endswith(f"CPU:{r}")
            assert features.numpy()[:, 0].tolist() == [2 * r, 2 * r + 1]


def test_distributed_without_a_strategy_uses_the_active_scope(devices, strategy):
    with fp.Feeder(index_arrays(8), 8, devices=devices) as feeder:
        batch = next(iter(feeder))
        with pytest.raises(ValueError, match=r"needs a tf\.distribute strategy"):
            batch.distributed()
        with strategy.scope():
            _, mask = batch.distributed()
        assert len(strategy.experimental_local_results(mask)) == 4
        assert len(strategy.experimental_local_results(batch.distributed(strategy)[1])) == 4


def test_distributed_refuses_a_strategy_with_another_replica_count(devices, strategy):
    with fp.Feeder(index_arrays(8), 8, devices=devices[:2]) as feeder:
        batch = next(iter(feeder))
        with pytest.raises(ValueError, match=r"4 replicas but the batch was staged for 2"):
            batch.distributed(strategy)


class StepCounter(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.steps = getattr(self, "steps", [])
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


def linear_model(strategy) -> keras.Model:
    with strategy.scope():
        model = keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def test_model_fit_trains_under_mirrored_strategy(strategy):
    x, y = regression_data(52)  # 4 steps of 16, the last one padded
    model = linear_model(strategy)
    before = [w.copy() for w in model.get_weights()]
    counter = StepCounter()
    with fp.Feeder((x, y), 16, strategy=strategy, shuffle=True) as feeder:
        history = model.fit(
            feeder.as_dataset(),
            epochs=3,
            verbose=0,
            callbacks=[counter, feeder.fit_callback()],
            shuffle=False,
        )
        assert feeder.get_state()["epoch"] == 3
    losses = history.history["loss"]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    assert counter.steps == [4, 4, 4], "every epoch must run all its steps"
    assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_padded_rows_carry_zero_weight_in_keras(strategy):
    x, y = regression_data(13)  # batches of 8 real rows, then 5 real rows and 3 padded
    model = linear_model(strategy)
    model.set_weights([np.full((NUM_FEATURES, 1), 0.3, np.float32), np.zeros(1, np.float32)])
    errors = ((x @ model.get_weights()[0] + model.get_weights()[1] - y) ** 2)[:, 0]
    expected = (errors[:8].mean() + errors[8:].mean()) / 2  # Keras averages batch losses
    with fp.Feeder((x, y), 8, strategy=strategy) as feeder:
        loss = model.evaluate(feeder.as_dataset(pad_last=True), verbose=0)
    padded_expected = (errors[:8].mean() + np.concatenate([errors[8:], errors[8:11]]).mean()) / 2
    assert abs(expected - padded_expected) > 1e-3, "the data must tell padding from none"
    assert loss == pytest.approx(expected, rel=1e-5)


def test_fit_on_x_y_w_source_scales_given_weights(strategy):
    x, y = regression_data(13)
    weights = np.linspace(0.0, 2.0, 13).astype(np.float32)
    model = linear_model(strategy)
    model.set_weights([np.full((NUM_FEATURES, 1), 0.3, np.float32), np.zeros(1, np.float32)])
    errors = ((x @ model.get_weights()[0] + model.get_weights()[1] - y) ** 2)[:, 0] * weights
    expected = (errors[:8].sum() / 8 + errors[8:].sum() / 5) / 2
    with fp.Feeder((x, y, weights), 8, strategy=strategy) as feeder:
        loss = model.evaluate(feeder.as_dataset(pad_last=True), verbose=0)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_a_transform_error_under_fit_reaches_the_user_and_every_later_read(strategy):
    """TensorFlow carries an error raised while reading a dataset as an OpError holding its
    text; the feeder keeps the error itself and raises it on every later read."""

    def fragile(sample):
        if int(sample[1]) == 20:
            raise TransformBroke("cannot transform sample 20")
        return sample

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    with fp.Feeder(index_arrays(32), 8, strategy=strategy, transform=fragile) as feeder:
        with pytest.raises(Exception) as raised:
            model.fit(feeder.as_dataset(), verbose=0, callbacks=[feeder.fit_callback()])
        if not isinstance(raised.value, TransformBroke):  # the text, through TensorFlow
            assert isinstance(raised.value, tf.errors.OpError), raised.value
            text = str(raised.value)
            assert "TransformBroke: cannot transform sample 20" in text
            assert "feedpipe: raised in feedpipe-producer-0" in text and "index 20" in text
        for _ in range(2):
            with pytest.raises(TransformBroke, match=r"^cannot transform sample 20") as again:
                next(iter(feeder))
            assert any("index 20 of epoch 0" in note for note in again.value.__notes__)


@pytest.mark.parametrize("label_shape", [(8, 8, 1), (8, 8)], ids=["channel", "no-channel"])
def test_the_added_sample_weight_broadcasts_against_per_pixel_losses(strategy, label_shape):
    """A segmentation loss is one value per pixel: the weight of each row must reach them all
    (and padding rows none), so the loss is the mean over the real images' pixels."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(13, 8, 8, 1)).astype(np.float32)
    masks = rng.integers(0, 3, size=(13, *label_shape))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8, 8, 1)), keras.layers.Conv2D(3, 1, activation="softmax")]
        )
        model.compile("sgd", "sparse_categorical_crossentropy")
    with fp.Feeder((images, masks), 8, strategy=strategy) as feeder:
        loss = model.evaluate(feeder.as_dataset(pad_last=True), verbose=0)
    pixels = keras.losses.sparse_categorical_crossentropy(masks, model(images)).numpy()
    assert pixels.shape == (13, 8, 8)
    expected = (pixels[:8].mean() + pixels[8:].mean()) / 2  # Keras averages batch losses
    padded = (pixels[:8].mean() + np.concatenate([pixels[8:], pixels[8:11]]).mean()) / 2
    assert abs(expected - padded) > 1e-4, "the data must tell padding from none"
    assert loss == pytest.approx(float(expected), rel=1e-5)


def test_compiled_metrics_that_count_padding_rows_are_warned_about(strategy):
    x, y = regression_data(13)
    cases = (
        ({"metrics": ["mae"]}, True, True),
        ({"weighted_metrics": ["mae"]}, True, False),
        ({"metrics": ["mae"]}, False, False),  # the real rows alone: nothing to warn of
    )
    for metrics, pad_last, warned in cases:
        with strategy.scope():
            model = keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", **metrics)
        with (
            fp.Feeder((x, y), 8, strategy=strategy) as feeder,
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            dataset = feeder.as_dataset(pad_last=pad_last)
            model.fit(dataset, verbose=0, callbacks=[feeder.fit_callback()])
        said = [str(w.message) for w in caught if "weighted_metrics=" in str(w.message)]
        assert len(said) == int(warned), said
        if warned:
            assert "3 padding rows" in said[0]
