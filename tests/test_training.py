"""Training on staged batches equals single-device training on the same global batches.

The reference is the plainest possible loop: one device, one `GradientTape` over the mean loss
of each global batch's real rows (the last batch of an epoch shorter, never padded). The
trainer on 1, 2 and 4 replicas, `model.fit` on `feeder.as_dataset()` and the tower step must
all land on its weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe.tf import training
from tests.fakes import regression_data

LENGTH = 37
"""Not a multiple of the global batch: every epoch ends on a padded batch of 5 real rows."""
GLOBAL_BATCH = 8
EPOCHS = 2
RTOL = 1e-5


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)]
    )
    return model


def make_optimizer(kind: str) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1) if kind == "sgd" else keras.optimizers.Adam(0.05)


def reference_weights(kind: str) -> list[np.ndarray]:
    """One device, plain tape, the mean loss of each global batch's real rows."""
    x, y = regression_data(LENGTH)
    model, optimizer = make_model(), make_optimizer(kind)
    for _ in range(EPOCHS):
        for first in range(0, LENGTH, GLOBAL_BATCH):
            rows = slice(first, first + GLOBAL_BATCH)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(y[rows], model(x[rows])))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return [w.numpy() for w in model.weights]


def assert_same_weights(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=1e-6)


def mirrored(devices) -> tf.distribute.MirroredStrategy:
    """A strategy over `devices` that reduces through one device: TensorFlow's collectives
    allow one group size per process, and the suite's 4-replica strategy has taken it."""
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


@pytest.fixture(scope="module")
def strategy(devices) -> tf.distribute.MirroredStrategy:
    """This module's 4-replica strategy, reducing through one device (see `mirrored`): with the
    suite's collective strategy, models traced one after another collided on collective keys."""
    return mirrored(devices)


def trained_on_replicas(
    devices, replicas: int, kind: str, depth: int = 2, **options
) -> keras.Model:
    strategy = mirrored(devices[:replicas])
    with strategy.scope():
        model, optimizer = make_model(), make_optimizer(kind)
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy, depth=depth) as feeder:
        fp.Trainer(model, "mse", optimizer, strategy=strategy, **options).fit(
            feeder, EPOCHS, verbose=0
        )
    return model


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_training_on_any_replica_count_equals_single_device_training(devices, replicas, kind):
    model = trained_on_replicas(devices, replicas, kind)
    assert_same_weights([w.numpy() for w in model.weights], reference_weights(kind))


def test_steps_per_execution_changes_nothing_but_speed(devices):
    model = trained_on_replicas(devices, 4, "adam", depth=3, steps_per_execution=3)
    assert_same_weights([w.numpy() for w in model.weights], reference_weights("adam"))


def test_steps_per_execution_beyond_the_staging_depth_is_refused(strategy):
    with strategy.scope():
        model = make_model()
    with (
        fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy, depth=2) as feeder,
        pytest.raises(ValueError, match=r"`steps_per_execution`=3 .* build the feeder with depth"),
    ):
        fp.Trainer(model, "mse", "sgd", strategy=strategy, steps_per_execution=3).fit(feeder)


def test_model_fit_on_as_dataset_reaches_the_same_weights(devices):
    strategy = mirrored(devices)
    with strategy.scope():
        model = make_model()
        model.compile(make_optimizer("sgd"), "mse")
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder:
        # Padded, each replica's rows weighted to the global batch's real rows' mean loss.
        model.fit(feeder.as_dataset(pad_last=True), epochs=EPOCHS, verbose=0, shuffle=False)
    assert_same_weights([w.numpy() for w in model.weights], reference_weights("sgd"))


def test_the_tower_step_reaches_the_same_weights(devices):
    model, optimizer = make_model(), make_optimizer("adam")
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, devices=devices) as feeder:
        step = fp.TowerStep(model, "mse", optimizer, feeder.devices)
        for _ in range(EPOCHS):
            for batch in feeder:
                step(batch)
    assert_same_weights([w.numpy() for w in model.weights], reference_weights("adam"))


def test_epoch_logs_hold_the_mean_loss_metrics_and_the_feeders_view(devices, strategy):
    with strategy.scope():
        model = make_model()
        frozen = keras.optimizers.SGD(0.0)  # the logs can be checked exactly
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder:
        history = fp.train(
            model,
            feeder,
            loss="mse",
            optimizer=frozen,
            metrics=["mae"],
            verbose=0,
        )
    x, y = regression_data(LENGTH)
    predictions = model(x).numpy()
    logs = history.history
    np.testing.assert_allclose(logs["loss"][0], np.mean((predictions - y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(logs["mae"][0], np.mean(np.abs(predictions - y)), rtol=1e-5)
    assert 0.0 <= logs["input_bound_fraction"][0] <= 1.0
    assert logs["steps_per_s"][0] > 0


@pytest.mark.parametrize("name", ["accuracy", "acc"])
def test_accuracy_is_resolved_from_the_labels_as_compile_does(name):
    x, y = regression_data(LENGTH)
    labels = (y > 0).astype(np.float32)  # binary labels, a sigmoid output: binary accuracy
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, "sigmoid")])
    with fp.Feeder((x, labels), GLOBAL_BATCH, devices=["/cpu:0"]) as feeder:
        logs = fp.train(
            model,
            feeder,
            loss="binary_crossentropy",
            optimizer=keras.optimizers.SGD(0.0),
            metrics=[name],
            verbose=0,
        ).history
    expected = np.mean((model(x).numpy() > 0.5) == (labels > 0.5))
    assert logs[name][0] == pytest.approx(expected)


def test_a_trainer_fits_again_with_its_compiled_step_and_metrics(strategy):
    with strategy.scope():
        model = make_model()
        frozen = keras.optimizers.SGD(0.0)
    trainer = fp.Trainer(model, "mse", frozen, strategy=strategy, metrics=["mae"])
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder:
        first = trainer.fit(feeder, verbose=0).history
        second = trainer.fit(feeder, epochs=2, initial_epoch=1, verbose=0).history
    assert second["mae"][0] == pytest.approx(first["mae"][0], rel=1e-6)
    assert trainer._run_steps.experimental_get_tracing_count() == 1


def test_training_stopped_early_leaves_the_feeder_where_it_stopped(strategy):
    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    with strategy.scope():
        model = make_model()
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder:
        fp.train(model, feeder, loss="mse", optimizer="sgd", callbacks=[StopAfterTwo()], verbose=0)
        assert feeder.get_state()["step"] == 2


# ---- bad input ------------------------------------------------------------------------------


def test_a_model_whose_output_rows_differ_from_the_labels_is_refused(strategy):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(1),
                keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=0, keepdims=True)),
            ]
        )
    with (
        fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder,
        pytest.raises(ValueError, match=r"returned 1 rows of predictions for 2 rows of labels"),
    ):
        fp.train(model, feeder, loss="mse", optimizer="sgd", verbose=0)


def test_a_loss_that_is_already_reduced_is_refused(strategy):
    def mean_loss(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_true - y_pred))

    with strategy.scope():
        model = make_model()
    with (
        fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, strategy=strategy) as feeder,
        pytest.raises(ValueError, match=r"loss returned a scalar .* one loss per sample"),
    ):
        fp.train(model, feeder, loss=mean_loss, optimizer="sgd", verbose=0)


def test_a_keras_loss_object_has_its_reduction_turned_off(devices):
    loss = keras.losses.MeanSquaredError()  # reduces by default
    assert training.per_sample_loss(loss)(np.zeros((3, 1)), np.ones((3, 1))).shape == (3,)


def test_a_strategy_with_another_replica_count_is_refused(devices):
    two = mirrored(devices[:2])
    with two.scope():
        model = make_model()
    with (
        fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, devices=devices) as feeder,
        pytest.raises(ValueError, match=r"strategy has 2 replicas but the feeder stages .* for 4"),
    ):
        fp.Trainer(model, "mse", "sgd", strategy=two).fit(feeder, verbose=0)


def test_an_optimizer_made_outside_the_strategy_scope_is_refused(strategy):
    with strategy.scope():
        model = make_model()
    outside = keras.optimizers.Adam()
    with pytest.raises(ValueError, match=r"Adam was made outside the trainer's strategy scope"):
        fp.Trainer(model, "mse", outside, strategy=strategy)


def test_samples_that_are_not_x_y_pairs_are_refused(strategy):
    with strategy.scope():
        model = make_model()
    with (
        fp.Feeder(regression_data(LENGTH)[0], GLOBAL_BATCH, strategy=strategy) as feeder,
        pytest.raises(ValueError, match=r"needs samples of the form \(x, y\)"),
    ):
        fp.train(model, feeder, loss="mse", optimizer="sgd", verbose=0)


def test_towers_and_batch_must_agree_on_the_devices(devices):
    with fp.Feeder(regression_data(LENGTH), GLOBAL_BATCH, devices=devices) as feeder:
        step = fp.TowerStep(make_model(), "mse", "sgd", devices[:2])
        with pytest.raises(ValueError, match=r"staged for 4 devices but the towers are 2"):
            step(next(iter(feeder)))


# ---- the learning-rate rule -------------------------------------------------------------------


def test_warmup_rises_linearly_from_the_base_rate_to_the_scaled_rate():
    schedule = fp.WarmupLinearScaling(0.1, global_batch_size=1024, warmup_steps=100)
    assert schedule.scaled_learning_rate == pytest.approx(0.4)
    rates = [float(schedule(step)) for step in (0, 50, 100, 1000)]
    assert rates == pytest.approx([0.1, 0.25, 0.4, 0.4])
    again = fp.WarmupLinearScaling.from_config(schedule.get_config())
    assert float(again(50)) == pytest.approx(0.25)


def test_the_schedule_drives_a_keras_optimizer():
    schedule = fp.WarmupLinearScaling(0.01, global_batch_size=512, base_batch_size=256)
    optimizer = keras.optimizers.SGD(schedule)
    assert float(optimizer.learning_rate) == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_learning_rate": 0.0}, "`base_learning_rate`=0.0 must be > 0"),
        ({"global_batch_size": 0}, "`global_batch_size`=0 must be an integer >= 1"),
        ({"warmup_steps": -1}, "`warmup_steps`=-1 must be an integer >= 0"),
        ({"base_batch_size": True}, r"`base_batch_size`=True must be an integer >= 1 \(a bool"),
    ],
)
def test_bad_schedule_arguments_are_named(kwargs, message):
    arguments = {"base_learning_rate": 0.1, "global_batch_size": 256, **kwargs}
    with pytest.raises(ValueError, match=message):
        fp.WarmupLinearScaling(**arguments)
