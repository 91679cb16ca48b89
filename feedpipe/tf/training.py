"""Train: a data-parallel loop on the feeder's staged batches, equal to one device's training.

Each replica runs forward and backward on its own staged rows. Its loss is the sum of its real
rows' per-sample losses divided by the real samples of the *whole* global batch, so when the
optimizer sums the replicas' gradients (Keras all-reduces them under a strategy) the result is
the gradient of the global batch's mean loss: the same update one device would make on the
whole batch. Padding rows weigh exactly zero, so a padded last batch equals training on its
real rows alone, and no replica ever sees a different shape or step count.

`Trainer` runs this under `tf.distribute` (`fit` over a `Feeder`); `TowerStep` does the same
the way tower-style wrappers do, one tape per device over `batch.replicas`, for code built
that way; `WarmupLinearScaling` is the learning-rate rule for large global batches.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from feedpipe._internals.keras import keras_metric
from feedpipe._internals.tf import collective_timeout
from feedpipe.core.checks import check_int
from feedpipe.feeder import Feeder
from feedpipe.tf.batch import Batch
from feedpipe.tf.loss import per_sample_loss, replica_loss, unpack_sample


def _built_metrics(metrics: Sequence[Any], y_true: Any, y_pred: Any) -> list:
    """Fresh metric objects, resolved as `model.compile` resolves them ("accuracy" picks its
    kind from a batch's labels and predictions). Call under the strategy's scope, so that
    their variables sum over the replicas."""
    built = []
    for metric in metrics:
        if isinstance(metric, keras.metrics.Metric):
            built.append(type(metric).from_config(metric.get_config()))
        else:
            built.append(keras_metric(metric, y_true, y_pred))
    return built


class Trainer:
    """Trains a Keras model on a `Feeder`'s staged batches, data-parallel across its replicas.

    Every step equals one step of single-device training on the same global batch (see the
    module docstring). `steps_per_execution` steps run inside one compiled function, which
    saves a host round trip per step when steps are short. Build the model, and the optimizer
    if it has state, under `strategy.scope()`.
    """

    def __init__(
        self,
        model: keras.Model,
        loss: Any,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        strategy: tf.distribute.Strategy | None = None,
        metrics: Sequence[Any] = (),
        steps_per_execution: int = 1,
    ):
        self.steps_per_execution = check_int(
            "steps_per_execution",
            steps_per_execution,
            "use 1 to run one step per call, or N to run N steps in one compiled call",
        )
        if not (isinstance(loss, str) or callable(loss)):
            per_sample_loss(loss)  # raises, naming what a loss must be
        self.strategy = strategy or tf.distribute.get_strategy()
        self.model = model
        self.loss = loss
        with self.strategy.scope():
            self.optimizer = keras.optimizers.get(optimizer)
        made_under = getattr(self.optimizer, "_distribution_strategy", self.strategy)
        if made_under is not self.strategy:
            raise ValueError(
                f"The optimizer {type(self.optimizer).__name__} was made outside the trainer's "
                "strategy scope, so its variables cannot be mirrored on the replicas; make it "
                'inside `with strategy.scope():` (or pass its name, e.g. optimizer="adam").'
            )
        self._metric_specs = tuple(metrics)
        self.metrics: list[keras.metrics.Metric] = []
        """The metrics, built from `metrics` when the first batch shows the labels' kind."""
        self._loss_fn: Callable | None = None
        self._run_steps = tf.function(self._steps)

    def __repr__(self) -> str:
        return (
            f"Trainer(model={self.model.name!r}, loss={self.loss!r}, "
            f"optimizer={type(self.optimizer).__name__}, "
            f"replicas={self.strategy.num_replicas_in_sync}, "
            f"metrics={list(self._metric_specs)}, "
            f"steps_per_execution={self.steps_per_execution})"
        )

    def _replica_step(self, sample, mask, num_valid):
        replicas = self.strategy.num_replicas_in_sync
        with tf.GradientTape() as tape:
            loss, predictions, y, weights = replica_loss(
                self.model, self._loss_fn, sample, mask, num_valid, replicas
            )
        variables = self.model.trainable_variables
        gradients = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        for metric in self.metrics:
            metric.update_state(y, predictions, sample_weight=weights)
        return loss

    def _steps(self, steps):
        """`len(steps)` training steps; returns the sum of their losses, each weighted by its
        real samples (each step's loss is its mean over them)."""
        total = 0.0
        for sample, mask, num_valid in steps:
            shares = self.strategy.run(self._replica_step, args=(sample, mask, num_valid))
            total += self.strategy.reduce(tf.distribute.ReduceOp.SUM, shares, axis=None) * num_valid
        return total

    def _check(self, feeder: Feeder) -> None:
        replicas = self.strategy.num_replicas_in_sync
        if feeder.share.num_replicas != replicas:
            raise ValueError(
                f"The strategy has {replicas} replicas but the feeder stages batches for "
                f"{feeder.share.num_replicas} ({', '.join(feeder.devices)}"
                + (
                    f" on each of {feeder.share.num_hosts} hosts"
                    if feeder.share.num_hosts > 1
                    else ""
                )
                + "); build the feeder with strategy= the trainer's strategy."
            )
        if feeder.share.num_hosts > 1 and collective_timeout(self.strategy) is None:
            warnings.warn(
                "The MultiWorkerMirroredStrategy has no collective timeout: if a host hangs, "
                "every other host waits for it forever. Make it with communication_options="
                "tf.distribute.experimental.CommunicationOptions(timeout_seconds=...) (longer "
                "than the slowest step) to have them raise instead.",
                stacklevel=3,
            )
        k, depth = self.steps_per_execution, feeder.options.depth
        if depth < k:
            raise ValueError(
                f"`steps_per_execution`={k} runs {k} staged batches in one call, but the feeder "
                f"keeps only `depth`={depth} staged (holding more would take a fresh host "
                f"buffer per step); build the feeder with depth >= {k}."
            )

    def _build(self, first: Batch) -> None:
        """Builds, once, what the first trace needs: the model, optimizer, loss and metrics."""
        x, y, _ = unpack_sample(first.replicas[0])
        with self.strategy.scope():
            predictions = self.model(x)  # builds the model on its first call
            if not self.optimizer.built:
                # Variables made inside `strategy.run` in a tf.function are not mirrored.
                self.optimizer.build(self.model.trainable_variables)
            self._loss_fn = per_sample_loss(self.loss, y, predictions)
            self.metrics = _built_metrics(self._metric_specs, y, predictions)

    def fit(
        self,
        feeder: Feeder,
        epochs: int = 1,
        *,
        initial_epoch: int = 0,
        verbose: int = 1,
        callbacks: Sequence[keras.callbacks.Callback] = (),
    ) -> keras.callbacks.History:
        """Trains epochs `initial_epoch` to `epochs - 1` from the feeder's position, as
        `model.fit` counts them (after a resume, pass the restored state's epoch as
        `initial_epoch`: its first pass is the rest of the interrupted epoch); returns Keras's
        `History`.

        Each epoch's logs hold `loss` (the mean over the epoch's real samples), the metrics,
        and the feeder's `input_bound_fraction` and `steps_per_s` over that epoch. Keras
        callbacks work as under `model.fit` (`model.stop_training` ends the run).
        """
        try:
            steps = len(feeder)
        except TypeError:
            steps = None
        callback_list = keras.callbacks.CallbackList(
            list(callbacks),
            add_history=True,
            add_progbar=verbose != 0,
            verbose=verbose,
            epochs=epochs,
            steps=steps,
            model=self.model,
        )
        self.model.stop_training = False
        callback_list.on_train_begin()
        self._check(feeder)
        for epoch in range(initial_epoch, epochs):
            for metric in self.metrics:
                metric.reset_state()
            callback_list.on_epoch_begin(epoch)
            before = feeder.stats()
            started = time.perf_counter()
            loss_sum, samples, step = 0.0, 0, 0
            group: list[Batch] = []
            # Closing the loop when training stops early keeps the feeder's position there;
            # batches taken but not trained (the step raised) are the next loop's first.
            with _untaken_on_error(feeder, group), contextlib.closing(iter(feeder)) as batches:
                while True:
                    batch = next(batches, None)
                    if batch is not None:
                        if self._loss_fn is None:
                            self._build(batch)
                        group.append(batch)
                        if len(group) < self.steps_per_execution:
                            continue
                    if not group:
                        break
                    callback_list.on_train_batch_begin(step)
                    loss_sum += self._run(group, feeder)
                    samples += sum(b.num_valid for b in group)
                    step += len(group)
                    del batch, group[:]
                    callback_list.on_train_batch_end(step - 1, {"loss": loss_sum / samples})
                    if self.model.stop_training:
                        break
            if samples == 0:
                break
            logs = {"loss": loss_sum / samples}
            logs.update({m.name: float(m.result()) for m in self.metrics})
            logs.update(_epoch_feed_logs(before, feeder.stats(), step, started))
            callback_list.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        callback_list.on_train_end()
        return self.model.history

    def _run(self, group: list[Batch], feeder: Feeder) -> float:
        """Runs the steps of `group`; a host lost under a multi-worker strategy is said so."""
        try:
            return float(self._run_steps(tuple(self._step_args(b) for b in group)))
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as error:
            if feeder.share.num_hosts == 1:
                raise
            first = group[0]
            raise RuntimeError(
                f"Step {first.step} of epoch {first.epoch} did not complete on host "
                f"{feeder.share.host} of {feeder.share.num_hosts}: another host died or stopped "
                f"answering ({type(error).__name__}: {_first_line(error)}). A host that dies is "
                "noticed at once; one that hangs, after the strategy's "
                "CommunicationOptions(timeout_seconds=...) (without it, never). Restart every "
                "host and restore the last checkpoint (the chief's feeder.get_state() saved with "
                "the model); it may have another number of hosts."
            ) from error

    def _step_args(self, batch: Batch) -> tuple[Any, Any, tf.Tensor]:
        sample, mask = batch.distributed(self.strategy)
        return sample, mask, _count(batch.num_valid)


@contextlib.contextmanager
def _untaken_on_error(feeder: Feeder, group: list[Batch]) -> Iterator[None]:
    """On an error, gives the feeder back the batches in `group`: taken, never trained."""
    try:
        yield
    except BaseException:
        if group:
            feeder._consumer.untake(group[0])
        raise


def _first_line(error: BaseException) -> str:
    """The line of a collective's error that says what happened (TensorFlow's are long)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if "aborted" in line or "timed out" in line.lower()]
    return (useful or lines or [""])[0].strip()[:200]


@functools.lru_cache(maxsize=64)
def _count(num_valid: int) -> tf.Tensor:
    """`num_valid` as a float32 tensor, made once per value (all steps but the last share one)."""
    return tf.constant(num_valid, tf.float32)


def _epoch_feed_logs(before, after, steps: int, started: float) -> dict[str, float]:
    """The feeder's view of one epoch: the share of it spent waiting for input, and steps/s."""
    wall = after.wall_s - before.wall_s
    waited = after.consumer_wait_s - before.consumer_wait_s
    elapsed = time.perf_counter() - started
    return {
        "input_bound_fraction": waited / wall if wall > 0 else 0.0,
        "steps_per_s": steps / elapsed if elapsed > 0 else 0.0,
    }


def train(
    model: keras.Model,
    feeder: Feeder,
    *,
    loss: Any,
    optimizer: keras.optimizers.Optimizer | str,
    epochs: int = 1,
    initial_epoch: int = 0,
    strategy: tf.distribute.Strategy | None = None,
    metrics: Sequence[Any] = (),
    steps_per_execution: int = 1,
    verbose: int = 1,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> keras.callbacks.History:
    """Trains `model` on `feeder` for `epochs` epochs (see `Trainer`); `strategy` defaults to
    the feeder's."""
    trainer = Trainer(
        model,
        loss,
        optimizer,
        strategy=strategy or feeder.strategy,
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )
    return trainer.fit(
        feeder, epochs, initial_epoch=initial_epoch, verbose=verbose, callbacks=callbacks
    )


class TowerStep:
    """One training step the tower way: each device computes its own rows' loss and gradients.

    For code shaped like the `make_parallel` / `DataParallelModel` wrappers: no strategy, one
    set of variables, and `batch.replicas[i]` consumed on `devices[i]`. Each tower's loss is
    its share of the global mean over real samples (as in `Trainer`), so the sum of the towers'
    gradients, applied once, is the global batch's gradient (their average weighted by real
    samples, never an average of per-tower means).
    """

    def __init__(
        self,
        model: keras.Model,
        loss: Any,
        optimizer: keras.optimizers.Optimizer | str,
        devices: Sequence[str],
    ):
        if not (isinstance(loss, str) or callable(loss)):
            per_sample_loss(loss)  # raises, naming what a loss must be
        self.model = model
        self.devices = tuple(devices)
        self.loss = loss
        self._loss_fn: Callable | None = None
        self.optimizer = keras.optimizers.get(optimizer)
        self._step = tf.function(self._towers)

    def _towers(self, replicas, masks, num_valid):
        variables = self.model.trainable_variables
        total, summed = 0.0, None
        for device, sample, mask in zip(self.devices, replicas, masks, strict=True):
            with tf.device(device), tf.GradientTape() as tape:
                loss, _, _, _ = replica_loss(
                    self.model, self._loss_fn, sample, mask, num_valid, len(self.devices)
                )
            gradients = tape.gradient(loss, variables)
            summed = (
                gradients
                if summed is None
                else [a + b for a, b in zip(summed, gradients, strict=True)]
            )
            total += loss
        self.optimizer.apply_gradients(zip(summed, variables, strict=True))
        return total

    def __call__(self, batch: Batch) -> tf.Tensor:
        """Trains on `batch`; returns its mean loss over real samples."""
        if len(batch.replicas) != len(self.devices):
            raise ValueError(
                f"The batch was staged for {len(batch.replicas)} devices but the towers are "
                f"{len(self.devices)} ({', '.join(self.devices)}); pass the feeder's devices."
            )
        if self._loss_fn is None:
            x, y, _ = unpack_sample(batch.replicas[0])
            predictions = self.model(x)  # builds the model on its first call
            self._loss_fn = per_sample_loss(self.loss, y, predictions)
            if not self.optimizer.built:
                self.optimizer.build(self.model.trainable_variables)
        return self._step(
            tuple(batch.replicas),
            tuple(batch.masks),
            _count(batch.num_valid),
        )


@keras.saving.register_keras_serializable("feedpipe")
class WarmupLinearScaling(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate for a large global batch: linear scaling with a gradual warm-up.

    Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017): when the
    global batch grows k-fold (more replicas, the same per-replica batch), multiply the
    learning rate by k; to survive the first steps, start from the unscaled rate and raise it
    linearly to the scaled one over `warmup_steps` (they used 5 epochs). Afterwards the rate
    stays at `base_learning_rate * global_batch_size / base_batch_size`.
    """

    def __init__(
        self,
        base_learning_rate: float,
        global_batch_size: int,
        base_batch_size: int = 256,
        warmup_steps: int = 0,
    ):
        if not base_learning_rate > 0:
            raise ValueError(f"`base_learning_rate`={base_learning_rate!r} must be > 0.")
        self.base_learning_rate = float(base_learning_rate)
        self.global_batch_size = check_int(
            "global_batch_size", global_batch_size, "pass the samples per step you train with"
        )
        self.base_batch_size = check_int(
            "base_batch_size",
            base_batch_size,
            "pass the batch size `base_learning_rate` was tuned for (e.g. 256)",
        )
        self.warmup_steps = check_int(
            "warmup_steps",
            warmup_steps,
            "use 0 to start at the scaled rate, or the steps over which to raise it",
            minimum=0,
        )

    @property
    def scaled_learning_rate(self) -> float:
        """The rate after warm-up: the base rate times global / base batch size."""
        return self.base_learning_rate * self.global_batch_size / self.base_batch_size

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        base, peak = self.base_learning_rate, self.scaled_learning_rate
        if self.warmup_steps == 0:
            return tf.constant(peak, tf.float32) + 0.0 * step
        progress = tf.minimum(step / self.warmup_steps, 1.0)
        return base + (peak - base) * progress

    def get_config(self) -> dict:
        return {
            "base_learning_rate": self.base_learning_rate,
            "global_batch_size": self.global_batch_size,
            "base_batch_size": self.base_batch_size,
            "warmup_steps": self.warmup_steps,
        }

    def __repr__(self) -> str:
        return (
            f"WarmupLinearScaling(base_learning_rate={self.base_learning_rate}, "
            f"global_batch_size={self.global_batch_size}, base_batch_size="
            f"{self.base_batch_size}, warmup_steps={self.warmup_steps}; scaled rate "
            f"{self.scaled_learning_rate:g})"
        )
