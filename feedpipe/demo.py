"""`feedpipe demo`: the same training, fed synchronously and then through `fp.Feeder`.

A small Keras model trains twice under `tf.distribute.MirroredStrategy`, from the same weights,
on the same batches, with the same compiled step and the same number of steps:

1. *synchronous feeding*, the `feed_dict` pattern: every step the host reads the batch's
   samples, stacks them, places each replica's rows on its device, and only then runs the step;
   reading and computing never overlap;
2. *through the feeder*: a background thread reads and stages the next batches while the step
   runs, so the step finds its batch already on its devices.

The source is a map-style dataset whose samples take real time to read (a GIL-free wait, as
storage or network reads are), so the overlap the feeder buys is the one a user would see. The
wait is sized on the machine the demo runs on, so that reading a global batch takes half as
long as its step: slow enough that synchronous feeding pays for it every step, fast enough
that a feeder can hide it entirely. Without GPUs the replicas are logical CPU devices, made
before TensorFlow initialises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

import feedpipe as fp
from feedpipe.core.stats import verdict

FEATURES = 256
"""Floats per sample: 1 KiB records, small enough that reading, not copying, dominates."""
CLASSES = 10
DATASET_SIZE = 5000
"""Not a multiple of the global batch, so every epoch ends on a padded, masked batch."""
PER_REPLICA_BATCH = 32
"""Rows per replica; the global batch is this times the replicas, so it always divides."""
READ_SHARE = 0.5
"""Reading a global batch takes this share of the step's time: synchronous feeding adds it to
every step, and the feeder hides it behind the step."""
SLEEP_QUANTUM_S = 0.001
"""Waits are slept off in portions of at least this: a sleep of tens of microseconds overshoots
by about as much again, so per-sample sleeps would not add up to the wait asked for."""
TIMED_STEPS = 5
HIDDEN_UNITS = 1024
"""Width of the MLP's two hidden layers: its step outlasts reading a batch, on 2 cores too."""
NOISE_BANK = 4096
"""Distinct noise vectors the samples draw from, so building a sample is one cheap add."""
DEFAULT_STEPS = 150
QUICK_STEPS = 20


class SyntheticRecords:
    """A map-style dataset of labelled feature vectors whose reads take storage time.

    `__getitem__` waits `read_latency_s` on average with `time.sleep`, which releases the GIL
    as a real file or network read does (the waits of each reading thread are booked and slept
    off in portions of `SLEEP_QUANTUM_S`, oversleep carried over), then builds the sample with
    numpy. Classes are overlapping clusters, so the loss falls steadily over the run.
    """

    def __init__(self, size: int = DATASET_SIZE, read_latency_s: float = 0.0, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.size = size
        self.read_latency_s = read_latency_s
        self._debt = threading.local()
        self._centers = rng.normal(scale=0.1, size=(CLASSES, FEATURES)).astype(np.float32)
        self._noise = rng.normal(size=(NOISE_BANK, FEATURES)).astype(np.float32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample index {index} is outside 0..{self.size - 1}")
        self._wait()
        label = index % CLASSES
        features = self._centers[label] + self._noise[(index * 7919) % NOISE_BANK]
        return features, np.int32(label)

    def _wait(self) -> None:
        debt = getattr(self._debt, "s", 0.0) + self.read_latency_s
        if debt >= SLEEP_QUANTUM_S:
            started = time.perf_counter()
            time.sleep(debt)
            debt -= time.perf_counter() - started
        self._debt.s = debt

    def __repr__(self) -> str:
        return f"SyntheticRecords(size={self.size}, read_latency_s={self.read_latency_s})"


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one training run measured, in the units the report prints."""

    name: str
    steps: int
    wall_s: float
    """The whole training loop, from asking for the first batch to the last step's loss."""
    input_bound_fraction: float
    """Share of wall time the step waited for its input."""
    final_loss: float
    """Mean loss over the real samples of the last step."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s


def configure_devices(count: int) -> list[str]:
    """The replica devices: the first `count` GPUs if there are any, else `count` CPU devices.

    Logical CPU devices can only be made before TensorFlow initialises its runtime, so this
    must run before any op; a machine without GPUs then still trains on several replicas.
    """
    if count < 1:
        raise ValueError(f"`--devices`={count} must be at least 1.")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(min(count, len(gpus)))]
    cpu = tf.config.list_physical_devices("CPU")[0]
    # Raises once TensorFlow is running; then the CPU devices it has are checked below.
    with contextlib.suppress(RuntimeError):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    available = len(tf.config.list_logical_devices("CPU"))
    if available < count:
        raise RuntimeError(
            f"TensorFlow was initialised with {available} CPU device(s) before the demo could "
            f"make {count}; run the demo in a fresh process or pass --devices {available}."
        )
    return [f"/cpu:{i}" for i in range(count)]


def build_model() -> keras.Model:
    """A three-layer MLP whose step outlasts reading its batch, so the input can be hidden."""
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def make_train_step(
    strategy: tf.distribute.Strategy, model: keras.Model, optimizer: keras.Optimizer
) -> Callable:
    """One compiled step, `step(inputs, mask, num_valid) -> loss`, shared by both runs.

    Each replica sums the loss of its real rows (the mask zeroes padding) and divides by the
    real samples of the whole global batch; the optimizer sums the replicas' gradients, so a
    padded last batch weighs exactly its real samples.
    """
    per_sample_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(inputs, mask, num_valid):
        features, labels = inputs
        with tf.GradientTape() as tape:
            losses = per_sample_loss(labels, model(features, training=True))
            loss = tf.reduce_sum(tf.where(mask, losses, 0.0)) / num_valid
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(inputs, mask, num_valid):
        losses = strategy.run(replica_step, args=(inputs, mask, num_valid))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return step


def build_batch_synchronously(
    dataset: SyntheticRecords,
    step: int,
    global_batch_size: int,
    strategy: tf.distribute.Strategy,
) -> tuple[object, object, int]:
    """The feed_dict pattern: read, stack, pad and place step `step`'s batch, in the caller.

    Batches follow the feeder's unshuffled order (epoch after epoch, the last batch of each
    padded and masked), so both runs train on the same samples.
    """
    steps_per_epoch = -(-len(dataset) // global_batch_size)
    first = (step % steps_per_epoch) * global_batch_size
    samples = [dataset[i] for i in range(first, min(first + global_batch_size, len(dataset)))]
    num_valid = len(samples)
    # Padding repeats the real rows, as the feeder's does; the mask hides it from the loss.
    rows_taken = np.resize(np.arange(num_valid), global_batch_size)
    features = np.stack([s[0] for s in samples])[rows_taken]
    labels = np.array([s[1] for s in samples], np.int32)[rows_taken]
    real = np.arange(global_batch_size) < num_valid
    rows = global_batch_size // strategy.num_replicas_in_sync
    devices = strategy.extended.worker_devices

    def place(context):
        i = context.replica_id_in_sync_group
        part = slice(i * rows, (i + 1) * rows)
        with tf.device(devices[i]):
            return (tf.constant(features[part]), tf.constant(labels[part])), tf.constant(real[part])

    inputs, mask = strategy.experimental_distribute_values_from_function(place)
    return inputs, mask, num_valid


def progress_bar(steps: int) -> keras.utils.Progbar:
    """A live bar on a terminal; one summary line when the output is a file or a pipe."""
    return keras.utils.Progbar(steps, verbose=1 if sys.stdout.isatty() else 2)


def train_synchronously(
    step_fn: Callable,
    dataset: SyntheticRecords,
    global_batch_size: int,
    strategy: tf.distribute.Strategy,
    steps: int,
) -> RunResult:
    """Trains `steps` steps, building each batch on the host right before its step."""
    bar = progress_bar(steps)
    input_s = 0.0
    started = time.perf_counter()
    for i in range(steps):
        asked = time.perf_counter()
        inputs, mask, num_valid = build_batch_synchronously(dataset, i, global_batch_size, strategy)
        input_s += time.perf_counter() - asked
        loss = float(step_fn(inputs, mask, tf.constant(num_valid, tf.float32)))
        bar.update(i + 1, [("loss", loss)])
    wall_s = time.perf_counter() - started
    return RunResult("synchronous feeding", steps, wall_s, input_s / wall_s, loss)


def train_with_feeder(
    step_fn: Callable, feeder: fp.Feeder, steps: int
) -> tuple[RunResult, fp.FeedStats]:
    """Trains `steps` steps on batches the feeder has already staged on the devices."""
    bar = progress_bar(steps)
    done = 0
    started = time.perf_counter()
    while done < steps:
        for batch in feeder:  # each pass is one epoch
            inputs, mask = batch.distributed()
            loss = float(step_fn(inputs, mask, tf.constant(batch.num_valid, tf.float32)))
            done += 1
            bar.update(done, [("loss", loss)])
            if done == steps:
                break
    wall_s = time.perf_counter() - started
    stats = feeder.stats()
    return RunResult("fp.Feeder", steps, wall_s, stats.input_bound_fraction, loss), stats


def snapshot(variables: Sequence[tf.Variable]) -> Callable[[], None]:
    """A function that puts `variables` back to their current values (weights and optimizer)."""
    values = [v.numpy() for v in variables]

    def restore() -> None:
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)

    return restore


def _replicas(count: int) -> str:
    return f"{count} replica{'' if count == 1 else 's'}"


def print_report(devices: Sequence[str], runs: Sequence[RunResult], stats: fp.FeedStats) -> None:
    """Both runs side by side, the speedup, and the feeder's own verdict."""
    print(f"\n{'':22}{'steps/s':>9}{'input-bound':>13}  {'verdict':<24}{'final loss':>10}")
    for run in runs:
        print(
            f"{run.name:<22}{run.steps_per_s:>9.1f}{run.input_bound_fraction:>13.1%}  "
            f"{verdict(run.input_bound_fraction):<24}{run.final_loss:>10.4f}"
        )
    sync, fed = runs
    print(
        f"\nspeedup with the feeder: {fed.steps_per_s / sync.steps_per_s:.2f}x on "
        f"{_replicas(len(devices))} ({', '.join(devices)})"
    )
    print(f"feeder: {stats}")
    print(
        "input-bound = share of wall time the step waited for its batch (synchronous: the "
        "host building it;\nfeeder: feeder.stats()); verdicts use the TensorFlow profiler's "
        "thresholds of 5 % and 20 %."
    )


def measure_read_s(dataset: SyntheticRecords, samples: int = 256) -> float:
    """Seconds to read one sample here, on average: the wait and the building."""
    started = time.perf_counter()
    for index in range(samples):
        dataset[index % len(dataset)]
    return (time.perf_counter() - started) / samples


def measure_step_s(step_fn: Callable, inputs, mask, num_valid: int) -> float:
    """The median time of the compiled step on a batch already on its devices."""
    times = []
    for _ in range(TIMED_STEPS):
        started = time.perf_counter()
        float(step_fn(inputs, mask, tf.constant(num_valid, tf.float32)))
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def build_training(strategy: tf.distribute.Strategy) -> tuple[Callable, list[tf.Variable]]:
    """The model's compiled step and every variable it trains (weights and optimizer state)."""
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
        # The slots must exist before the step is traced: variables made inside
        # `strategy.run` in a tf.function are not mirrored.
        optimizer.build(model.trainable_variables)
    return make_train_step(strategy, model, optimizer), [*model.variables, *optimizer.variables]


def run(steps: int | None = None, devices: int = 4, quick: bool = False) -> list[RunResult]:
    """Runs the demo and prints its report; returns both runs' results."""
    if steps is None:
        steps = QUICK_STEPS if quick else DEFAULT_STEPS
    if steps < 1:
        raise ValueError(f"`--steps`={steps} must be at least 1.")
    replica_devices = configure_devices(devices)
    strategy = tf.distribute.MirroredStrategy(replica_devices)
    global_batch_size = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    dataset = SyntheticRecords()
    keras.utils.set_random_seed(0)  # the same initial weights, and final loss, every run
    step_fn, variables = build_training(strategy)
    # One step outside the timing traces the step; both runs then start from its weights.
    inputs, mask, num_valid = build_batch_synchronously(dataset, 0, global_batch_size, strategy)
    step_fn(inputs, mask, tf.constant(num_valid, tf.float32))
    restore = snapshot(variables)
    step_s = measure_step_s(step_fn, inputs, mask, num_valid)
    restore()
    per_sample_s = READ_SHARE * step_s / global_batch_size
    dataset.read_latency_s = max(0.0, per_sample_s - measure_read_s(dataset))
    read_s = measure_read_s(dataset) * global_batch_size
    on = "GPUs" if replica_devices[0].startswith("/gpu") else "logical CPU devices: no GPU found"
    print(
        f"feedpipe demo: {steps} steps of a {HIDDEN_UNITS}-unit MLP on "
        f"{_replicas(strategy.num_replicas_in_sync)} ({on}), global batch {global_batch_size}\n"
        f"source: {len(dataset):,} synthetic samples of {FEATURES} floats; each read waits "
        f"{dataset.read_latency_s * 1e6:.0f} µs (GIL-free, like storage), so that reading a "
        f"batch takes about half a step here ({read_s * 1e3:.1f} ms; the step alone "
        f"{step_s * 1e3:.1f} ms)"
    )

    print("\n1/2 synchronous feeding (feed_dict pattern): build the batch, then run the step")
    sync = train_synchronously(step_fn, dataset, global_batch_size, strategy, steps)
    restore()
    print("2/2 fp.Feeder: the next batches are read and staged while the step runs")
    with fp.Feeder(dataset, global_batch_size, strategy=strategy) as feeder:
        fed, stats = train_with_feeder(step_fn, feeder, steps)
    print_report(replica_devices, [sync, fed], stats)
    return [sync, fed]
