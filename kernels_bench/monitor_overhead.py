"""Does `fp.StarvationMonitor` slow the training step it watches?

`model.fit` on an emulated accelerator: a Keras model whose compiled step sleeps `--step-ms`
(default 10) once per step, GIL-free, through `tf.numpy_function` (the MLPerf Storage method,
inside the step as a device's compute would be), fed from a `tf.data` input that is already in
memory (`from_tensors(...).repeat()`), so the step alone sets the pace. Two arms alternate in
each repetition (order rotated): the fit without the monitor, and with
`StarvationMonitor(verbose=0)`. Each fit runs 2 epochs of `--steps` steps; a timing callback
listed last reads, in the second epoch (the steady state), the wall clock from the start of
its first step to the end of its last: the monitor's per-step cost (its wrapper around
`train_function`). Its measurement of the step alone, which runs after every epoch, is
reported apart as `headspace_s`: the second epoch's extra time outside its steps with the
monitor.

Target: mean step with the monitor / without <= 1.01. The monitor's own verdict on these runs
(`input_wait_fraction`, expected near 0: the input is in memory) is recorded beside it.

Run: `python -m kernels_bench.monitor_overhead [--quick] [--step-ms 10] [--steps 100]`;
writes `kernels_bench/results/monitor_overhead.json`.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from kernels_bench import harness

ARMS = ("without", "with")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step-ms", type=float, default=10.0, help="emulated step (default 10)")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (100; 40 quick)")


def build(step_s: float):
    """The emulated-step model and its in-memory input."""
    import keras
    import tensorflow as tf

    class Sleep(keras.layers.Layer):
        """Sleeps `step_s` once per step, GIL-free, inside the compiled step."""

        def call(self, x):
            slept = tf.numpy_function(lambda: np.float32(time.sleep(step_s) or 0), [], tf.float32)
            return x + tf.reshape(slept, [])

        def compute_output_shape(self, input_shape):
            return input_shape

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), Sleep(), keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((64, 32), dtype=np.float32)
    y = np.arange(64) % 10
    return model, tf.data.Dataset.from_tensors((x, y)).repeat()


def epoch_walls(model, dataset, steps: int, callbacks: list) -> list[tuple[float, float]]:
    """Runs a 2-epoch fit; returns each epoch's (steps_s, wall_s), read by a callback listed
    last: from its first step's start to its last step's end, and from its start to its end."""
    import keras

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.first = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            walls.append((self.last - self.first, time.perf_counter() - self.began))

    walls: list[tuple[float, float]] = []
    model.fit(
        dataset,
        epochs=2,
        steps_per_epoch=steps,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, EpochClock()],
    )
    return walls


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    harness.configure_tf(1)
    import feedpipe as fp

    step_s = settings.args.step_ms / 1000
    steps = settings.args.steps or settings.pick(40, 100)
    report = harness.Report(
        "monitor_overhead",
        "does fp.StarvationMonitor slow the step of model.fit it watches?",
        settings,
        "kernels_bench.monitor_overhead",
    )
    model, dataset = build(step_s)
    epoch_walls(model, dataset, 5, [])  # traces the step: no fit below pays for it
    rows = []
    for rep in range(settings.reps):
        walls, fraction = {}, None
        for arm in harness.rotate(ARMS, rep):
            gc.collect()
            if arm == "with":
                monitor = fp.StarvationMonitor(verbose=0)
                walls[arm] = epoch_walls(model, dataset, steps, [monitor])
                fraction = monitor.epochs[-1].input_wait_fraction
            else:
                walls[arm] = epoch_walls(model, dataset, steps, [])
        (with_steps, with_wall), (without_steps, without_wall) = (
            walls["with"][1],
            walls["without"][1],
        )
        row = {
            "step_ratio": with_steps / without_steps,
            "without_step_ms": without_steps / steps * 1e3,
            "with_step_ms": with_steps / steps * 1e3,
            "headspace_s": (with_wall - with_steps) - (without_wall - without_steps),
            "monitor_input_wait_fraction": fraction,
        }
        rows.append(row)
        print(
            f"  rep {rep + 1}/{settings.reps}: step without {row['without_step_ms']:.3f} ms, "
            f"with the monitor {row['with_step_ms']:.3f} ms (ratio {row['step_ratio']:.4f}); "
            f"headspace {row['headspace_s'] * 1e3:.0f} ms per epoch; monitor says "
            f"{fraction:.1%} input wait",
            flush=True,
        )
    case = "emulated step"
    report.add_case(
        case,
        {"step_s": step_s, "steps_per_epoch": steps, "epochs": 2, "measured_epoch": 2},
        rows,
        units={"without_step_ms": "ms", "with_step_ms": "ms", "headspace_s": "s"},
    )
    report.target(case, "step_ratio", "<=", 1.01, "mean step with the monitor / without")
    report.note(
        "step_ratio: wall time of the second epoch's steps (steady state, first step's start "
        "to last step's end) with the monitor over without, the same model and input, arms "
        "alternated. headspace_s: the second epoch's extra time outside its steps with the "
        "monitor: its measurement of the step alone, after every epoch."
    )
    report.finish(
        columns=[
            "step_ratio",
            "without_step_ms",
            "with_step_ms",
            "headspace_s",
            "monitor_input_wait_fraction",
        ]
    )


if __name__ == "__main__":
    main()
