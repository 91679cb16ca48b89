"""Does the feedpipe training loop on staged batches train at least as fast as `model.fit` on a
tf.data input of the same data, under MirroredStrategy on 2 and 4 logical CPU devices, with the
same model; and how close is it to the same steps on batches already on the devices?

One Keras MLP (1024 features -> h -> h -> 10 classes, ReLU, sparse softmax cross-entropy from
logits, SGD) is trained under `tf.distribute.MirroredStrategy` with a global batch of
`--batch-mb` (default 2) MB of float32 features. The hidden width `h` is calibrated once, on
the trainer's own compiled step on pre-staged batches over 2 replicas, so that the step takes
about `--step-ms` (default 15; `mirrored.py`'s linear fit between two probed widths); both
replica counts train that same model, and `synthetic_step_ms` says what their step took. Three
peers train it, each with its own copy of the same initial weights and its own optimizer:

* `loop`: `fp.Trainer(model, loss, SGD, strategy=...).fit(feeder, 1, verbose=0)` over
  `fp.Feeder((x, y), B, strategy=..., shuffle=True)`;
* `fit`: the model compiled with the same loss and optimizer (`jit_compile=False`, as the
  trainer's `tf.function`; Keras turns XLA off under tf.distribute on CPUs anyway),
  `model.fit(dataset, epochs=1, verbose=0)` on `from_tensor_slices((x, y)).shuffle(N)
  .batch(B).prefetch(AUTOTUNE)` (a full shuffle buffer: the uniform order of the feeder's
  `shuffle=True`), which `fit` distributes itself (`experimental_distribute_dataset`);
* `synthetic`: the loop's trainer's compiled step (`trainer._run_steps`, private API) on the
  per-replica values of 4 staged batches taken in turn (`trainer._step_args(batch)`, built
  once and kept alive with their batches; DESIGN.md's "the same batches pre-staged", as in
  `mirrored.py`): the same step with no input at all, the upper bound.

The data set holds exactly `warm-up + timed` global batches, so one epoch of `fit` and of the
loop is one session of each peer: its first `--warmup` steps untimed (the tf.data iterator
fills its shuffle buffer, the feeder restarts its stream), then a window of `timed` steps read
by a callback at `on_train_batch_end` (the same callback class in both, listed last; both
fits read their loss on the host every step). The synthetic peer runs the same number of
untimed and timed steps. A repetition runs `rounds` sessions of every peer, in rotating order
(`harness.rotate`); its ratios come from the summed windows; the figures are medians over
repetitions. Before the repetitions every peer runs one untimed session (tracing).

2 and 4 replicas run in one process: TensorFlow is given 4 logical CPU devices and the
strategies span the first 2 and all 4, each with `cross_device_ops=ReductionToOneDevice()`
(what MirroredStrategy picks by itself for CPU devices; it also sidesteps the collectives'
one group size per process). Logical CPU devices share one intra-op thread pool, so the idle
two do not take cores from the 2-replica case (checked: its step takes the same time in a
process with 2 devices).

Targets, per replica count: loop / fit >= 1.0; real / synthetic (R/S, the loop over the
synthetic step) >= 0.95 where the synthetic step takes >= 10 ms. Also reported:
`feedpipe_input_bound`, the share of the loop's timed windows it waited for a staged batch
(`feeder.stats()`); the time per step each fed peer adds to the synthetic step; and each
peer's process CPU per step (every thread): on a 2-core machine that the step alone keeps
busy, the CPU an input needs (the feeder's gather, tf.data's threads) is taken from the step.

Run: `python -m kernels_bench.train_loop [--quick] [--step-ms 15] [--batch-mb 2]`; writes
`kernels_bench/results/train_loop.json`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time

import numpy as np

from kernels_bench import harness
from kernels_bench.mirrored import (
    CLASSES,
    FEATURES,
    HIDDEN_PROBES,
    LEARNING_RATE,
    SYNTHETIC_BATCHES,
    _cost,
    hidden_for,
)

REPLICAS = (2, 4)
PEERS = ("loop", "fit", "synthetic")


def build_model(strategy, hidden: int, seed: int):
    """The MLP, its variables made under `strategy` (mirrored on each replica's device)."""
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )


def loss_and_optimizer(strategy):
    import keras

    with strategy.scope():
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer


def make_trainer(strategy, hidden: int, seed: int):
    import feedpipe as fp

    loss, optimizer = loss_and_optimizer(strategy)
    return fp.Trainer(build_model(strategy, hidden, seed), loss, optimizer, strategy=strategy)


def window_callback(warmup: int, timed: int, feeder=None):
    """A Keras callback timing steps `warmup` .. `warmup + timed - 1` of an epoch: from the end
    of step `warmup - 1` to the end of the last one (and `feeder.stats()` at both ends)."""
    import keras

    class Window(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.started = self.ended = None
            self.cpu = 0.0
            self.stats = []
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if batch == warmup - 1:
                self.started = time.perf_counter()
                self.cpu = time.process_time()
                if feeder is not None:
                    self.stats.append(feeder.stats())
            elif batch == warmup + timed - 1:
                self.ended = time.perf_counter()
                self.cpu = time.process_time() - self.cpu
                if feeder is not None:
                    self.stats.append(feeder.stats())

        @property
        def seconds(self) -> float:
            if self.started is None or self.ended is None or self.steps != warmup + timed:
                raise RuntimeError(
                    f"the window saw {self.steps} steps, not {warmup} + {timed}: the data set "
                    "must hold exactly that many global batches"
                )
            return self.ended - self.started

    return Window()


class PreStaged:
    """`SYNTHETIC_BATCHES` batches staged on the devices and kept alive, and the trainer's
    compiled step on them in turn (as `mirrored.py`'s synthetic peer: distinct batches, so
    the step reads its inputs from memory as a fed step does, not from a warm cache)."""

    def __init__(self, trainer, x: np.ndarray, y: np.ndarray, global_batch: int):
        import feedpipe as fp

        self.trainer = trainer
        rows = SYNTHETIC_BATCHES * global_batch
        self.feeder = fp.Feeder(
            (x[:rows], y[:rows]),
            global_batch,
            strategy=trainer.strategy,
            depth=SYNTHETIC_BATCHES,
        )
        self.batches = iter(self.feeder)
        # Held: their slots are never reused while the step runs on them.
        self.kept = [next(self.batches) for _ in range(SYNTHETIC_BATCHES)]
        self.args = [(trainer._step_args(batch),) for batch in self.kept]

    def seconds(self, warmup: int, timed: int) -> tuple[float, float]:
        """Wall and process CPU seconds of `timed` steps after `warmup` untimed ones."""
        run = self.trainer._run_steps
        turns = itertools.cycle(self.args)
        for _ in range(warmup):
            float(run(next(turns)))
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(timed):
            float(run(next(turns)))  # the loop reads each step's loss on the host too
        return time.perf_counter() - started, time.process_time() - cpu

    def close(self) -> None:
        self.batches.close()
        self.feeder.close()


def synthetic_step_s(strategy, x, y, global_batch: int, hidden: int, seed: int) -> float:
    """The trainer's step on a pre-staged batch, for hidden width `hidden` (median of 10)."""
    import feedpipe as fp

    trainer = make_trainer(strategy, hidden, seed)
    with fp.Feeder((x[:global_batch], y[:global_batch]), global_batch, strategy=strategy) as f:
        trainer.fit(f, 1, verbose=0)  # builds the model and optimizer, traces the step
    staged = PreStaged(trainer, x, y, global_batch)
    try:
        staged.seconds(3, 0)
        times = [staged.seconds(0, 1)[0] for _ in range(10)]
    finally:
        staged.close()
    return statistics.median(times)


def calibrate(strategy, x, y, global_batch: int, seed: int) -> tuple[float, float]:
    """As `mirrored.calibrate`, on the trainer's step: the time at the smallest probed width
    and its growth per unit of `mirrored._cost`."""
    lo, hi = HIDDEN_PROBES
    t_lo = synthetic_step_s(strategy, x, y, global_batch, lo, seed)
    t_hi = synthetic_step_s(strategy, x, y, global_batch, hi, seed)
    return t_lo, max((t_hi - t_lo) / (_cost(hi) - _cost(lo)), 1e-15)


class Peers:
    """The three peers of one replica count, kept alive across repetitions."""

    def __init__(self, strategy, x, y, global_batch: int, hidden: int, seed: int, window):
        import tensorflow as tf

        import feedpipe as fp

        self.window = window  # (warmup, timed)
        self.trainer = make_trainer(strategy, hidden, seed)
        self.feeder = fp.Feeder((x, y), global_batch, strategy=strategy, shuffle=True, seed=seed)
        loss, optimizer = loss_and_optimizer(strategy)
        self.model = build_model(strategy, hidden, seed)
        with strategy.scope():
            self.model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
        self.dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
            .batch(global_batch)
            .prefetch(tf.data.AUTOTUNE)
        )
        self.staged = None
        self.x, self.y, self.global_batch = x, y, global_batch
        self.wait_s = self.wall_s = 0.0

    def session(self, peer: str) -> tuple[float, float]:
        """One session of `peer`: the window's wall and process CPU seconds."""
        warmup, timed = self.window
        gc.collect()
        if peer == "synthetic":
            if self.staged is None:  # after the loop's first fit built and traced the step
                self.staged = PreStaged(self.trainer, self.x, self.y, self.global_batch)
            return self.staged.seconds(warmup, timed)
        if peer == "loop":
            clock = window_callback(warmup, timed, self.feeder)
            self.trainer.fit(self.feeder, 1, verbose=0, callbacks=[clock])
            before, after = clock.stats
            self.wait_s += after.consumer_wait_s - before.consumer_wait_s
            self.wall_s += after.wall_s - before.wall_s
            return clock.seconds, clock.cpu
        if peer == "fit":
            clock = window_callback(warmup, timed)
            self.model.fit(self.dataset, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
            return clock.seconds, clock.cpu
        raise ValueError(peer)

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
        self.feeder.close()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-mb", type=float, default=2.0, help="global batch in MiB of features (default 2)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=15.0, help="synthetic step to size the model for (15)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per session (5)")


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    all_devices = harness.configure_tf(max(REPLICAS))
    import tensorflow as tf

    def mirrored(replicas: int):
        return tf.distribute.MirroredStrategy(
            all_devices[:replicas], cross_device_ops=tf.distribute.ReductionToOneDevice()
        )

    report = harness.Report(
        "train_loop",
        "steps/s of fp.Trainer on staged batches vs model.fit on tf.data, and vs its own step "
        "on pre-staged batches (MirroredStrategy, 2 and 4 logical CPUs)",
        settings,
        "kernels_bench.train_loop",
    )
    warmup = settings.args.warmup
    if warmup < 1:
        raise SystemExit(f"--warmup={warmup}: the timed window starts after at least 1 step.")
    timed, rounds = settings.pick((20, 2), (40, 3))
    global_batch = int(settings.args.batch_mb * 2**20) // (FEATURES * 4)
    global_batch -= global_batch % max(REPLICAS)
    rows = (warmup + timed) * global_batch  # one epoch = one session
    rng = np.random.default_rng(settings.seed)
    x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, rows, dtype=np.int32)

    floor_s, slope = calibrate(mirrored(min(REPLICAS)), x, y, global_batch, settings.seed)
    hidden = hidden_for(settings.args.step_ms / 1000, floor_s, slope)
    print(
        f"global batch {global_batch} x {FEATURES} float32 ({settings.args.batch_mb:g} MB); "
        f"hidden {hidden}, sized for a ~{settings.args.step_ms:g} ms step on {min(REPLICAS)} "
        f"replicas (the smallest model's step: {floor_s * 1e3:.1f} ms)",
        flush=True,
    )

    for replicas in REPLICAS:
        strategy = mirrored(replicas)
        peers = Peers(strategy, x, y, global_batch, hidden, settings.seed, (warmup, timed))
        case = f"{replicas} replicas"
        print(f"{case}: {rounds} sessions of {warmup} + {timed} steps per peer", flush=True)
        reps = []
        try:
            for peer in PEERS:  # tracing, the model's and optimizer's variables
                peers.session(peer)
            for rep in range(settings.reps):
                seconds, cpu = dict.fromkeys(PEERS, 0.0), dict.fromkeys(PEERS, 0.0)
                peers.wait_s = peers.wall_s = 0.0
                for round_ in range(rounds):
                    for peer in harness.rotate(PEERS, rep + round_):
                        wall_s, cpu_s = peers.session(peer)
                        seconds[peer] += wall_s
                        cpu[peer] += cpu_s
                rates = {peer: rounds * timed / s for peer, s in seconds.items()}
                row = {
                    "loop_over_fit": rates["loop"] / rates["fit"],
                    "real_over_synthetic": rates["loop"] / rates["synthetic"],
                    "fit_over_synthetic": rates["fit"] / rates["synthetic"],
                    "synthetic_step_ms": 1000 / rates["synthetic"],
                    "loop_extra_ms": 1000 / rates["loop"] - 1000 / rates["synthetic"],
                    "fit_extra_ms": 1000 / rates["fit"] - 1000 / rates["synthetic"],
                    **{f"{p}_steps_s": r for p, r in rates.items()},
                    # Process CPU per step (every thread: TF's pools, tf.data's, the feeder's).
                    **{f"{p}_cpu_ms": 1000 * c / (rounds * timed) for p, c in cpu.items()},
                    "feedpipe_input_bound": (
                        peers.wait_s / peers.wall_s if peers.wall_s > 0 else 0.0
                    ),
                }
                reps.append(row)
                print(
                    f"  rep {rep + 1}/{settings.reps}: "
                    + "  ".join(f"{p} {r:.1f}/s" for p, r in rates.items())
                    + f"  loop/fit {row['loop_over_fit']:.3f}"
                    + f"  R/S {row['real_over_synthetic']:.3f}",
                    flush=True,
                )
            traces = peers.trainer._run_steps.experimental_get_tracing_count()
        finally:
            peers.close()
        entry = report.add_case(
            case,
            {
                "replicas": replicas,
                "batch_mb": settings.args.batch_mb,
                "global_batch": global_batch,
                "per_replica_batch": global_batch // replicas,
                "features": FEATURES,
                "hidden": hidden,
                "target_step_ms": settings.args.step_ms,
                "dataset_rows": rows,
                "warmup_steps": warmup,
                "timed_steps": timed,
                "sessions_per_rep": rounds,
                "depth": peers.feeder.options.depth,
                "optimizer": f"SGD({LEARNING_RATE})",
                "cross_device_ops": "ReductionToOneDevice",
            },
            reps,
            units={
                "synthetic_step_ms": "ms",
                "loop_extra_ms": "ms",
                "fit_extra_ms": "ms",
                **{f"{p}_steps_s": "steps/s" for p in PEERS},
                **{f"{p}_cpu_ms": "ms" for p in PEERS},
            },
            extra={"trainer_step_traces": traces},
        )
        report.target(case, "loop_over_fit", ">=", 1.0, "loop / model.fit")
        step_ms = entry["metrics"]["synthetic_step_ms"]["median"]
        harness.target_real_over_synthetic(report, case, step_ms)
        del peers, strategy
        gc.collect()
    report.note(
        "Each session is one epoch of exactly warm-up + timed global batches; a callback "
        "times the window after the warm-up in both fits, the synthetic peer runs the same "
        "steps. Sessions rotate between peers within a repetition; ratios are taken within a "
        "repetition, then the median over repetitions."
    )
    report.note(
        "2 and 4 replicas share one process with 4 logical CPU devices; every strategy uses "
        "ReductionToOneDevice (MirroredStrategy's own choice for CPU devices)."
    )
    report.finish(
        columns=[
            "synthetic_step_ms",
            "loop_over_fit",
            "real_over_synthetic",
            "fit_over_synthetic",
            "loop_extra_ms",
            "fit_extra_ms",
            "feedpipe_input_bound",
        ]
    )


if __name__ == "__main__":
    main()
