"""Which path feeds a Keras model fastest, and at what CPU cost?

Four ways to train the same model on the same in-memory data, with the same global batch,
loss, optimizer and metric, each shuffling every epoch:

* `arrays`: `model.fit(x, y, batch_size=B, shuffle=True)`: Keras's own array adapter, the
  reference every ratio is taken against;
* `tfdata`: `model.fit` on `from_tensor_slices((x, y)).shuffle(N).batch(B).prefetch(AUTOTUNE)`
  (a full shuffle buffer: the uniform order of the others);
* `feeder`: `model.fit(feeder.as_dataset(), callbacks=[feeder.fit_callback()])` over
  `fp.Feeder((x, y), B, shuffle=True)` (its defaults otherwise: the dataset yields `(x, y)`,
  a last batch that the data do not fill as its real rows, as `fit(x, y)` gives it). Arrays
  in memory are gathered by TensorFlow's threads in the feeder's order
  (`feedpipe/tf/array_dataset.py`);
* `train`: `fp.train(model, feeder, ...)` over the same kind of feeder, its batches staged on
  the replicas' devices.

Four models: keras-io's MNIST convnet (Conv 32 -> pool -> Conv 64 -> pool
-> Dropout -> Dense 10 softmax; categorical cross-entropy on one-hot labels, Adam, accuracy,
batch 128), a small MLP (Flatten -> Dense 32 -> Dense 10), where the input's cost per step is
large beside the step's, and a larger convnet (keras-io's CIFAR-10 one: Conv 32, 32 -> pool ->
Conv 64, 64 -> pool -> Dense 256 -> Dropout -> Dense 10; 477k parameters), where it is small,
all three on MNIST-shaped data; and a small convnet (the MNIST convnet's layers) on 12,000
CIFAR-shaped images (32x32x3), 94 steps an epoch, the last of 96 rows. The data are
synthetic (uint8 pixels scaled to float32 in [0, 1], one-hot float32 labels; no download).
Each model runs without a strategy (Keras's default, one device) and under
`MirroredStrategy` on 2 logical CPU devices (`ReductionToOneDevice`, what it picks for CPU
devices); the feeders are built with that strategy.

A session is one fresh model (the same initial weights every time), its input built inside
the timed call, and one `fit` (or `fp.train`) of `--epochs` epochs (3; 2 with --quick) of
`--steps` steps each (the MNIST convnet 100, the MLP 1200, the larger convnet 20, the small
convnet 94; 12, 80, 8 and 24 with --quick: a steady epoch of at least ~2 s without a
strategy, so that a minute-to-minute change of the machine's speed moves all of a
repetition's peers alike; the data hold exactly that many global batches, the small
convnet's last one 96 rows). Before the repetitions, each peer runs one untimed session on
2 batches (what the process does once per kind of fit). A callback listed last reads the
wall clock and the process CPU time (`time.process_time`: every thread of the process,
TensorFlow's pools, tf.data's and the feeder's) at the end of the first step (as the second
begins) and of every epoch; it has no `on_train_batch_end`, which would make Keras run every
callback's in the step's thread:

* start-up: `first_step_s` (from before the input is built to the end of the first step:
  building the input, tracing the step, the input's first batch) and `first_epoch_s`,
  `first_epoch_cpu_s` (the whole first epoch, start-up included);
* steady state: the epochs after the first, start-up excluded (each later epoch still pays
  its input's restart: tf.data's shuffle buffer refill, the feeder's new pass): `steps_s`
  and `cpu_ms` (process CPU per step).

Each repetition runs one session of every peer, in rotating order (`harness.rotate`), and
takes its ratios against `arrays` within the repetition: `<peer>_over_arrays` (steps/s),
`<peer>_cpu_over_arrays` (CPU per step), `<peer>_first_epoch_over_arrays` and
`_first_epoch_cpu_over_arrays` (the first epoch's wall and CPU time, start-up included); then
the medians over repetitions. Each repetition also records `other_cores` (as in `workers.py`):
the CPU other processes on the machine used during its sessions. Wall-clock ratios move with
it; CPU per step much less.

Targets, without a strategy, every model: `fit(feeder.as_dataset())` / `fit(tf.data)` >= 1.0
and `fit(feeder.as_dataset())` / `fit(x, y)` >= 1.0 in steady steps/s. Reported beside them,
without a target: the first epoch's time, and the CPU per step of `fit(feeder.as_dataset())`
over `fit(x, y)`.

Run: `python -m kernels_bench.fit_paths [--quick] [--steps 100,1200,20,94] [--epochs 3]
[--models mlp] [--strategies none]` (a subset: more repetitions of one case in the same time);
writes `kernels_bench/results/fit_paths.json`.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from kernels_bench import harness
from kernels_bench.harness import OtherLoad

GLOBAL_BATCH = 128
"""keras-io's MNIST convnet batch."""
IMAGE_SHAPE = (28, 28, 1)
CLASSES = 10
PEERS = ("arrays", "tfdata", "feeder", "train")
PEER_NAMES = {
    "arrays": "model.fit(x, y, batch_size=128, shuffle=True)",
    "tfdata": ("model.fit(from_tensor_slices((x, y)).shuffle(N).batch(128).prefetch(AUTOTUNE))"),
    "feeder": (
        "model.fit(fp.Feeder((x, y), 128, shuffle=True).as_dataset(), "
        "callbacks=[feeder.fit_callback()])"
    ),
    "train": "fp.train(model, fp.Feeder((x, y), 128, shuffle=True), ...)",
}
MODELS = ("mnist convnet", "mlp", "larger convnet", "small convnet")
STRATEGIES = ("none", "mirrored")
"""Without a strategy (Keras's default) and under MirroredStrategy on 2 logical CPUs."""
STEPS = {
    "mnist convnet": (12, 100),
    "mlp": (80, 1200),
    "larger convnet": (8, 20),
    "small convnet": (24, 94),
}
"""Steps per epoch (quick, full): a steady epoch of at least ~2 s of training, so that its
input's restart does not dominate it."""
SHAPES = {"small convnet": (32, 32, 3)}
"""Images of another shape than `IMAGE_SHAPE`: CIFAR-10's."""
SHORT_LAST = {"small convnet": 96}
"""Rows of the last batch where the data do not fill it: 94 steps of 128 hold 12,000 images,
so the feeder hands Keras a last batch of 96 real rows, as `fit(x, y)` and tf.data do."""


def build_model(name: str, strategy, seed: int):
    """The model `name`, its variables made under `strategy` (or the default), seeded."""
    import keras

    shape = SHAPES.get(name, IMAGE_SHAPE)

    def layers():
        if name in ("mnist convnet", "small convnet"):  # keras-io's MNIST convnet
            return [
                keras.Input(shape),
                keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Flatten(),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(CLASSES, activation="softmax"),
            ]
        if name == "larger convnet":  # keras-io's CIFAR-10 convnet, on the same images
            return [
                keras.Input(IMAGE_SHAPE),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Flatten(),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(CLASSES, activation="softmax"),
            ]
        if name == "mlp":
            return [
                keras.Input(IMAGE_SHAPE),
                keras.layers.Flatten(),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(CLASSES, activation="softmax"),
            ]
        raise ValueError(name)

    keras.utils.set_random_seed(seed)
    if strategy is None:
        return keras.Sequential(layers())
    with strategy.scope():
        return keras.Sequential(layers())


def make_data(rows: int, seed: int, shape=IMAGE_SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """Images of `shape` (MNIST's by default): uint8 pixels scaled to float32 [0, 1], one-hot
    float32 labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (rows, *shape), dtype=np.uint8).astype(np.float32) / 255
    y = np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, rows)]
    return x, y


def clock_callback(started: tuple[float, float]):
    """A Keras callback marking (wall, process CPU) at the end of the first step (as the second
    begins) and of every epoch, counting each epoch's steps; `started` is the session's (wall,
    CPU) at its start. It has no `on_train_batch_end`: a callback with one makes Keras run
    every callback's in the step's own thread, which no user's fit without one pays."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.started = started
            self.first_step = None
            self.epoch_ends: list[tuple[float, float]] = []
            self.epoch_steps: list[int] = []
            self._steps = 0

        def on_epoch_begin(self, epoch, logs=None):
            self._steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            self._steps += 1
            if self.first_step is None and self._steps == 2:
                self.first_step = (time.perf_counter(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append((time.perf_counter(), time.process_time()))
            self.epoch_steps.append(self._steps)

    return Clock()


def session(peer: str, model_name: str, strategy, x, y, epochs: int, seed: int) -> dict:
    """One fresh model trained by `peer` for `epochs` epochs: its start-up and steady figures."""
    import tensorflow as tf

    import feedpipe as fp

    model = build_model(model_name, strategy, seed)
    compile_args = {"loss": "categorical_crossentropy", "metrics": ["accuracy"]}
    if peer != "train":
        if strategy is None:
            model.compile(optimizer="adam", **compile_args)
        else:
            with strategy.scope():
                model.compile(optimizer="adam", **compile_args)
    gc.collect()
    started = (time.perf_counter(), time.process_time())
    clock = clock_callback(started)
    fit = {"epochs": epochs, "verbose": 0, "callbacks": [clock]}
    if peer == "arrays":
        model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=True, **fit)
    elif peer == "tfdata":
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
            .batch(GLOBAL_BATCH)
            .prefetch(tf.data.AUTOTUNE)
        )
        model.fit(dataset, shuffle=False, **fit)  # the dataset shuffles
    else:
        with fp.Feeder((x, y), GLOBAL_BATCH, strategy=strategy, shuffle=True, seed=seed) as feeder:
            if peer == "feeder":
                fit["callbacks"] = [feeder.fit_callback(), clock]
                model.fit(feeder.as_dataset(), shuffle=False, **fit)  # the feeder shuffles
            elif peer == "train":
                fp.train(model, feeder, optimizer="adam", **compile_args, **fit)
            else:
                raise ValueError(peer)
    steps = -(-len(x) // GLOBAL_BATCH)
    if clock.epoch_steps != [steps] * epochs:
        raise RuntimeError(f"{peer}: epochs of {clock.epoch_steps} steps, not {epochs} x {steps}")
    (wall0, cpu0), (first_wall, first_cpu) = started, clock.epoch_ends[0]
    last_wall, last_cpu = clock.epoch_ends[-1]
    steady_steps = steps * (epochs - 1)
    return {
        "first_step_s": clock.first_step[0] - wall0,
        "first_epoch_s": first_wall - wall0,
        "first_epoch_cpu_s": first_cpu - cpu0,
        "steps_s": steady_steps / (last_wall - first_wall),
        "cpu_ms": 1000 * (last_cpu - first_cpu) / steady_steps,
    }


def repetition_row(measured: dict[str, dict]) -> dict:
    """One repetition's figures and its ratios against `fit(x, y)` (and tf.data)."""
    row = {}
    for peer in PEERS:
        row.update({f"{peer}_{key}": value for key, value in measured[peer].items()})
    ref = measured["arrays"]
    for peer in PEERS[1:]:
        seen = measured[peer]
        row[f"{peer}_over_arrays"] = seen["steps_s"] / ref["steps_s"]
        row[f"{peer}_cpu_over_arrays"] = seen["cpu_ms"] / ref["cpu_ms"]
        row[f"{peer}_first_epoch_over_arrays"] = seen["first_epoch_s"] / ref["first_epoch_s"]
        row[f"{peer}_first_epoch_cpu_over_arrays"] = (
            seen["first_epoch_cpu_s"] / ref["first_epoch_cpu_s"]
        )
    row["feeder_over_tfdata"] = measured["feeder"]["steps_s"] / measured["tfdata"]["steps_s"]
    row["feeder_first_epoch_over_tfdata"] = (
        measured["feeder"]["first_epoch_s"] / measured["tfdata"]["first_epoch_s"]
    )
    row["train_over_feeder"] = measured["train"]["steps_s"] / measured["feeder"]["steps_s"]
    return row


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        default=None,
        help="steps per epoch of the MNIST convnet, the MLP, the larger convnet and the small "
        "convnet, e.g. 100,1200,20,94 (12,80,8,24 with --quick)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per session, >= 2 (3; 2 with --quick)"
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"the models to run, of {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="without a strategy (none), under MirroredStrategy (mirrored), or both (default)",
    )


def chosen(given: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """The names in the comma-separated `given`, each one of `allowed`, in `allowed`'s order."""
    names = [name.strip() for name in given.split(",") if name.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise SystemExit(f"{option}={given!r}: name one or more of {', '.join(allowed)}.")
    return [name for name in allowed if name in names]


def steps_per_epoch(settings) -> dict[str, int]:
    if settings.args.steps is None:
        return {model: settings.pick(*STEPS[model]) for model in MODELS}
    values = [int(v) for v in settings.args.steps.split(",")]
    if len(values) != len(MODELS) or min(values) < 1:
        raise SystemExit(
            f"--steps={settings.args.steps}: give {len(MODELS)} counts >= 1, one per model "
            "of --models' list, e.g. 100,1200,20,94."
        )
    return dict(zip(MODELS, values, strict=True))


def run_case(report, settings, model_name, strategy, steps, epochs) -> None:
    """One model under one strategy: every peer, `settings.reps` repetitions."""
    import keras

    case = f"{model_name}, {'mirrored' if strategy is not None else 'no strategy'}"
    rows = steps * GLOBAL_BATCH - GLOBAL_BATCH + SHORT_LAST.get(model_name, GLOBAL_BATCH)
    x, y = make_data(rows, settings.seed, SHAPES.get(model_name, IMAGE_SHAPE))
    # Untimed, on 2 batches: what the process does once for each kind of fit (the models
    # are fresh in every session, so every session traces its own step).
    for peer in PEERS:
        session(peer, model_name, strategy, x[: 2 * GLOBAL_BATCH], y[: 2 * GLOBAL_BATCH], 2, 0)
    rows = []
    for rep in range(settings.reps):
        measured, other_cores = {}, []
        for peer in harness.rotate(PEERS, rep):
            with OtherLoad() as other:
                measured[peer] = session(peer, model_name, strategy, x, y, epochs, settings.seed)
            other_cores.append(other.cores)
        row = repetition_row(measured)
        row["other_cores"] = max(other_cores)
        rows.append(row)
        print(
            f"  {case} rep {rep + 1}/{settings.reps}: "
            + "  ".join(
                f"{p} {measured[p]['steps_s']:.1f}/s {measured[p]['cpu_ms']:.1f} CPU-ms"
                for p in PEERS
            )
            + f"  as_dataset/tf.data {row['feeder_over_tfdata']:.3f}"
            + f"  (other processes: up to {row['other_cores']:.2f} core)",
            flush=True,
        )
    units = {}
    for peer in PEERS:
        units.update(
            {
                f"{peer}_first_step_s": "s",
                f"{peer}_first_epoch_s": "s",
                f"{peer}_first_epoch_cpu_s": "CPU-s",
                f"{peer}_steps_s": "steps/s",
                f"{peer}_cpu_ms": "CPU-ms per step",
            }
        )
    report.add_case(
        case,
        {
            "model": model_name,
            "strategy": (
                "none (Keras's default, one device)"
                if strategy is None
                else "MirroredStrategy(2 logical CPUs, ReductionToOneDevice)"
            ),
            "peers": PEER_NAMES,
            "global_batch": GLOBAL_BATCH,
            "per_replica_batch": GLOBAL_BATCH // (1 if strategy is None else 2),
            "steps_per_epoch": steps,
            "samples": rows,
            "image_shape": list(SHAPES.get(model_name, IMAGE_SHAPE)),
            "epochs_per_session": epochs,
            "loss": "categorical_crossentropy",
            "optimizer": "adam",
            "metrics": ["accuracy"],
            "parameters": build_model(model_name, None, 0).count_params(),
            "keras": keras.__version__,
        },
        rows,
        units=units,
    )
    if strategy is None:
        report.target(case, "feeder_over_tfdata", ">=", 1.0, "fit(as_dataset) / fit(tf.data)")
        report.target(case, "feeder_over_arrays", ">=", 1.0, "fit(as_dataset) / fit(x, y)")
    report.target(
        case,
        "feeder_cpu_over_arrays",
        "<=",
        1.0,
        "CPU per step, fit(as_dataset) / fit(x, y)",
        applies=False,
        why_not="reported, no target",
    )


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    models = chosen(settings.args.models, MODELS, "--models")
    strategy_names = chosen(settings.args.strategies, STRATEGIES, "--strategies")
    devices = harness.configure_tf(2)
    import tensorflow as tf

    steps = steps_per_epoch(settings)
    epochs = settings.args.epochs or settings.pick(2, 3)
    if epochs < 2:
        raise SystemExit(f"--epochs={epochs}: the steady state is the epochs after the first.")
    report = harness.Report(
        "fit_paths",
        "steps/s and CPU per step of model.fit(x, y), fit on tf.data, fit on "
        "feeder.as_dataset() and fp.train, without a strategy and under MirroredStrategy",
        settings,
        "kernels_bench.fit_paths",
    )
    mirrored = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    strategies = dict(zip(STRATEGIES, (None, mirrored), strict=True))
    for model_name in models:
        print(
            f"{model_name}: {steps[model_name]} steps of {GLOBAL_BATCH} x "
            f"{SHAPES.get(model_name, IMAGE_SHAPE)} per "
            f"epoch, {epochs} epochs per session (the first is start-up)",
            flush=True,
        )
        for name in strategy_names:
            run_case(report, settings, model_name, strategies[name], steps[model_name], epochs)
            gc.collect()
    report.note(
        "Steady state: the epochs after the first of each session (each later epoch includes "
        "its input's restart). Start-up: from before the input is built to the end of the "
        "first step / of the first epoch, on a fresh model (tracing included). CPU: "
        "time.process_time, every thread of the process. Ratios within a repetition, peers in "
        "rotating order; medians over repetitions. other_cores: the most CPU (in cores) that "
        "other processes on the machine used during one of the repetition's sessions."
    )
    report.finish(
        columns=[
            "tfdata_over_arrays",
            "feeder_over_arrays",
            "train_over_arrays",
            "feeder_over_tfdata",
            "tfdata_cpu_over_arrays",
            "feeder_cpu_over_arrays",
            "train_cpu_over_arrays",
            "feeder_first_epoch_over_arrays",
            "feeder_first_epoch_over_tfdata",
            "train_first_epoch_over_arrays",
            "other_cores",
        ]
    )


if __name__ == "__main__":
    main()
