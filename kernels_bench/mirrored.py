"""Under real TensorFlow compute, does feedpipe feed MirroredStrategy at least as well as tf.data,
and how close to the step's own speed? (steps/s of four ways to feed the same step)

An MLP (features -> h -> h -> 10 classes, ReLU, softmax cross-entropy, SGD with all-reduced
gradients) is trained under `tf.distribute.MirroredStrategy` on 2 logical CPU devices, with
global batches of 2 MB and 16 MB of float32 features (1024 per sample). The hidden width `h`
is calibrated per batch size so that the step on pre-staged batches takes about `--step-ms`
(default 6 and 15 ms); where even the smallest model (h = 8) is slower than a target, as at
16 MB here, the size runs one case with that model. Cases are named by batch size and `h`;
`synthetic_step_ms` says how long their step took. One compiled `tf.function` step,
`strategy.run(replica_step, ...)`,
is fed by:

* `feedpipe`: `fp.Feeder((x, y), B, strategy=..., shuffle=True)`, `step(*batch.distributed())`;
* `tf.data`: `from_tensor_slices().shuffle(N).repeat().batch(B).prefetch(AUTOTUNE)` through
  `strategy.experimental_distribute_dataset` (a full shuffle buffer: the same uniform order
  feedpipe's `shuffle=True` gives);
* `sync`: per step, gather the shuffled rows with numpy in Python, cut them per replica, convert
  them on each device and call the step: the `feed_dict` pattern, nothing overlaps;
* `synthetic`: the same step on 4 batches made once and kept on the devices: the upper bound.

Reported per repetition and as medians: steps/s of each, feedpipe / tf.data, and real / synthetic
(R/S). Targets: feedpipe / tf.data >= 1; R/S >= 0.95 where the synthetic step takes >= 10 ms.
On this 2-core machine the feeder's copy competes with TensorFlow's compute for the cores.

Run: `python -m kernels_bench.mirrored [--quick] [--step-ms 6,15] [--batch-mb 2,16]`; writes
`kernels_bench/results/mirrored.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kernels_bench import harness

FEATURES = 1024
CLASSES = 10
SYNTHETIC_BATCHES = 4
LEARNING_RATE = 1e-3


class Model:
    """The MLP's variables, and one compiled distributed train step over them."""

    def __init__(self, strategy, hidden: int, global_batch: int, seed: int):
        import tensorflow as tf

        self.hidden = hidden
        init = tf.random.stateless_normal
        shapes = [
            (FEATURES, hidden),
            (hidden,),
            (hidden, hidden),
            (hidden,),
            (hidden, CLASSES),
            (CLASSES,),
        ]
        with strategy.scope():
            # SUM aggregation: each replica's update is its share of the global-batch gradient.
            self.variables = [
                tf.Variable(
                    init(shape, seed=[seed, i]) * (0.05 if len(shape) == 2 else 0.0),
                    aggregation=tf.VariableAggregation.SUM,
                )
                for i, shape in enumerate(shapes)
            ]
        variables = self.variables

        def replica_step(inputs, mask):
            x, y = inputs
            with tf.GradientTape() as tape:
                w1, b1, w2, b2, w3, b3 = variables
                h = tf.nn.relu(tf.matmul(x, w1) + b1)
                h = tf.nn.relu(tf.matmul(h, w2) + b2)
                logits = tf.matmul(h, w3) + b3
                per_sample = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
                loss = tf.reduce_sum(per_sample * tf.cast(mask, tf.float32)) / global_batch
            grads = tape.gradient(loss, variables)
            for variable, grad in zip(variables, grads, strict=True):
                variable.assign_sub(LEARNING_RATE * grad)
            return loss

        @tf.function
        def train_step(inputs, mask):
            return strategy.run(replica_step, args=(inputs, mask))

        self.train_step = train_step


class Data:
    """Features and labels, and the per-replica pieces every peer needs."""

    def __init__(self, rows: int, global_batch: int, strategy, devices, seed: int):
        import tensorflow as tf

        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
        self.y = rng.integers(0, CLASSES, rows, dtype=np.int32)
        self.global_batch = global_batch
        self.per_replica = global_batch // len(devices)
        self.strategy = strategy
        self.devices = devices

        def on_devices(make):
            def value(context):
                with tf.device(devices[context.replica_id_in_sync_group]):
                    return make(context.replica_id_in_sync_group)

            return strategy.experimental_distribute_values_from_function(value)

        self.on_devices = on_devices
        self.all_real = on_devices(lambda r: tf.ones([self.per_replica], tf.bool))

    def distribute(self, x: np.ndarray, y: np.ndarray):
        """Per-replica tensors on each device, from one global batch on the host."""
        import tensorflow as tf

        b = self.per_replica
        return self.on_devices(
            lambda r: (
                tf.convert_to_tensor(x[r * b : (r + 1) * b]),
                tf.convert_to_tensor(y[r * b : (r + 1) * b]),
            )
        )


class Peers:
    """The four ways to feed one model, each kept alive across repetitions."""

    def __init__(self, model: Model, data: Data, strategy, seed: int):
        import tensorflow as tf

        import feedpipe as fp

        self.model = model
        self.data = data
        b = data.global_batch
        rows = len(data.y)
        self.feeder = fp.Feeder((data.x, data.y), b, strategy=strategy, shuffle=True, seed=seed)
        self.feedpipe_batches = harness.endless(self.feeder)
        dataset = (
            tf.data.Dataset.from_tensor_slices((data.x, data.y))
            .shuffle(rows, seed=seed, reshuffle_each_iteration=True)
            .repeat()
            .batch(b, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )
        self.tf_iterator = iter(strategy.experimental_distribute_dataset(dataset))
        self.sync_rng = np.random.default_rng(seed)
        self.sync_order = self.sync_rng.permutation(rows)
        self.sync_next = 0
        self.synthetic = []
        for _ in range(SYNTHETIC_BATCHES):
            index = self.sync_rng.integers(0, rows, b)
            self.synthetic.append(data.distribute(data.x[index], data.y[index]))
        self.synthetic_next = 0

    def step(self, peer: str):
        """One training step fed by `peer`; returns the per-replica losses."""
        train_step = self.model.train_step
        if peer == "feedpipe":
            batch = next(self.feedpipe_batches)
            return train_step(*batch.distributed())
        if peer == "tf.data":
            return train_step(next(self.tf_iterator), self.data.all_real)
        if peer == "sync":
            b = self.data.global_batch
            if self.sync_next + b > len(self.sync_order):
                self.sync_order = self.sync_rng.permutation(len(self.sync_order))
                self.sync_next = 0
            rows = self.sync_order[self.sync_next : self.sync_next + b]
            self.sync_next += b
            inputs = self.data.distribute(self.data.x[rows], self.data.y[rows])
            return train_step(inputs, self.data.all_real)
        if peer == "synthetic":
            inputs = self.synthetic[self.synthetic_next % SYNTHETIC_BATCHES]
            self.synthetic_next += 1
            return train_step(inputs, self.data.all_real)
        raise ValueError(peer)

    def timed(self, peer: str, drain: int, steps: int) -> float:
        """Seconds for `steps` steps fed by `peer`, after `drain` untimed steps that use up
        what its pipeline staged while the other peers ran (so the timed steps are steady)."""
        strategy = self.data.strategy
        for _ in range(drain):
            loss = self.step(peer)
        _ = [t.numpy() for t in strategy.experimental_local_results(loss)]
        started = time.perf_counter()
        for _ in range(steps):
            loss = self.step(peer)
        _ = [t.numpy() for t in strategy.experimental_local_results(loss)]
        return time.perf_counter() - started

    def close(self) -> None:
        self.feeder.close()


PEERS = ("feedpipe", "tf.data", "sync", "synthetic")


def synthetic_step_s(strategy, data: Data, hidden: int, seed: int, steps: int) -> float:
    """Median time of the step on pre-staged batches for hidden width `hidden`."""
    model = Model(strategy, hidden, data.global_batch, seed)
    inputs = data.distribute(data.x[: data.global_batch], data.y[: data.global_batch])
    times = []
    for i in range(steps + 3):
        started = time.perf_counter()
        loss = model.train_step(inputs, data.all_real)
        _ = [t.numpy() for t in strategy.experimental_local_results(loss)]
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


HIDDEN_PROBES = (8, 256)


def _cost(hidden: int) -> float:
    """The step's multiply-adds per sample, for the hidden width `hidden`."""
    return FEATURES * hidden + hidden * hidden + hidden * CLASSES


def calibrate(strategy, data: Data, seed: int) -> tuple[float, float]:
    """The synthetic step's time at the smallest probed width, and its growth per unit of
    `_cost`: a linear fit between two probes."""
    lo, hi = HIDDEN_PROBES
    t_lo = synthetic_step_s(strategy, data, lo, seed, 10)
    t_hi = synthetic_step_s(strategy, data, hi, seed, 10)
    return t_lo, max((t_hi - t_lo) / (_cost(hi) - _cost(lo)), 1e-15)


def hidden_for(target_s: float, t_lo: float, slope: float) -> int:
    """The hidden width whose synthetic step takes about `target_s` (at least the smallest)."""
    wanted = _cost(HIDDEN_PROBES[0]) + (target_s - t_lo) / slope
    a = FEATURES + CLASSES  # solve h*h + a*h = wanted
    h = (-a + (a * a + 4 * max(wanted, 0.0)) ** 0.5) / 2
    return int(min(max(round(h / 8) * 8, HIDDEN_PROBES[0]), 4096))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-mb", default="2,16", help="global batch sizes in MiB of features (default 2,16)"
    )
    parser.add_argument(
        "--step-ms",
        default="6,15",
        help="synthetic step times to size the model for (default 6,15)",
    )


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    devices = harness.configure_tf(2)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(devices)
    report = harness.Report(
        "mirrored",
        "steps/s under MirroredStrategy: feedpipe vs tf.data, sync feeding and synthetic",
        settings,
        "kernels_bench.mirrored",
    )
    # Each repetition runs `rounds` rounds; in each, every peer (in rotating order) runs
    # `drain` untimed and `block` timed steps. Short interleaved blocks spread the load of
    # other work on the machine evenly over the peers.
    warmup, drain, block, rounds = settings.pick((5, 4, 8, 3), (8, 4, 10, 6))
    sizes_mb = [float(v) for v in settings.args.batch_mb.split(",")]
    targets_ms = [float(v) for v in settings.args.step_ms.split(",")]

    for size_mb in sizes_mb:
        global_batch = int(size_mb * 2**20) // (FEATURES * 4)
        global_batch -= global_batch % len(devices)
        rows = max(settings.pick(8, 16) * global_batch, settings.pick(16384, 32768))
        rows -= rows % global_batch
        data = Data(rows, global_batch, strategy, devices, settings.seed)
        used: set[int] = set()
        floor_s, slope = calibrate(strategy, data, settings.seed)
        for target_ms in targets_ms:
            hidden = hidden_for(target_ms / 1000, floor_s, slope)
            if hidden in used:
                print(
                    f"{size_mb:g} MB: a ~{target_ms:g} ms step needs the same model as a case "
                    f"already run (hidden {hidden}; smallest probe's step "
                    f"{floor_s * 1e3:.1f} ms); skipped",
                    flush=True,
                )
                continue
            used.add(hidden)
            model = Model(strategy, hidden, global_batch, settings.seed)
            peers = Peers(model, data, strategy, settings.seed)
            case = f"{size_mb:g} MB, hidden {hidden}"
            print(
                f"{case}: global batch {global_batch} x {FEATURES} float32, sized for a "
                f"~{target_ms:g} ms step (the smallest model's step: {floor_s * 1e3:.1f} ms)",
                flush=True,
            )
            reps = []
            try:
                for peer in PEERS:  # tracing, tf.data's shuffle buffer, the feeder's slots
                    peers.timed(peer, warmup, 1)
                for rep in range(settings.reps):
                    seconds = dict.fromkeys(PEERS, 0.0)
                    before = peers.feeder.stats()
                    for round_ in range(rounds):
                        for peer in harness.rotate(PEERS, rep + round_):
                            seconds[peer] += peers.timed(peer, drain, block)
                    after = peers.feeder.stats()
                    rates = {peer: rounds * block / s for peer, s in seconds.items()}
                    wall = after.wall_s - before.wall_s
                    row = {
                        "feedpipe_over_tfdata": rates["feedpipe"] / rates["tf.data"],
                        "real_over_synthetic": rates["feedpipe"] / rates["synthetic"],
                        "tfdata_over_synthetic": rates["tf.data"] / rates["synthetic"],
                        "sync_over_synthetic": rates["sync"] / rates["synthetic"],
                        "feedpipe_over_sync": rates["feedpipe"] / rates["sync"],
                        "synthetic_step_ms": 1000 / rates["synthetic"],
                        **{f"{p.replace('.', '')}_steps_s": r for p, r in rates.items()},
                        # Steps outside the feedpipe peer's turns (while other peers ran) are
                        # counted too; the wait share is a lower bound there.
                        "feedpipe_input_bound": (
                            (after.consumer_wait_s - before.consumer_wait_s) / wall
                            if wall > 0
                            else 0.0
                        ),
                    }
                    reps.append(row)
                    print(
                        f"  rep {rep + 1}/{settings.reps}: "
                        + "  ".join(f"{p} {r:.1f}/s" for p, r in rates.items())
                        + f"  R/S {row['real_over_synthetic']:.3f}",
                        flush=True,
                    )
                traces = model.train_step.experimental_get_tracing_count()
            finally:
                peers.close()
            entry = report.add_case(
                case,
                {
                    "batch_mb": size_mb,
                    "global_batch": global_batch,
                    "features": FEATURES,
                    "batch_bytes": global_batch * (FEATURES * 4 + 4),
                    "dataset_rows": rows,
                    "hidden": hidden,
                    "target_step_ms": target_ms,
                    "replicas": len(devices),
                    "warmup_steps": warmup,
                    "drain_steps": drain,
                    "block_steps": block,
                    "rounds_per_rep": rounds,
                    "depth": 2,
                },
                reps,
                extra={"train_step_traces": traces},
            )
            report.target(case, "feedpipe_over_tfdata", ">=", 1.0, "feedpipe / tf.data")
            step_ms = entry["metrics"]["synthetic_step_ms"]["median"]
            harness.target_real_over_synthetic(report, case, step_ms)
        del data
    report.note(
        "Within a repetition the peers take turns in short blocks (rotating order), "
        "each block after untimed steps that drain what was staged meanwhile; ratios "
        "are taken within a repetition, then the median over repetitions."
    )
    report.finish(
        columns=[
            "synthetic_step_ms",
            "feedpipe_over_tfdata",
            "real_over_synthetic",
            "tfdata_over_synthetic",
            "sync_over_synthetic",
        ]
    )


if __name__ == "__main__":
    main()
