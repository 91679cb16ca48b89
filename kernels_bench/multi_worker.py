"""Under MultiWorkerMirroredStrategy, what does each host spend on input, how fast does
`fp.train` step, and what does the per-epoch plan cost as hosts and datasets grow?

The script starts a cluster of 2 hosts on loopback: 2 worker processes of this module, each
with its `TF_CONFIG` naming both on free ports of 127.0.0.1 (no traffic leaves the machine),
each a `MultiWorkerMirroredStrategy` of 1 replica on its CPU (on CPU the strategy uses one
device per worker), made with a collective timeout, `TF_CPP_MIN_LOG_LEVEL=2`. The parent waits
under a hard deadline (`--deadline-s`) and in the end kills each host and each process the
hosts started, by PID. Each host writes its figures to a JSON file in a temporary folder; the
parent takes, per repetition, the mean of the 2 hosts, then the ratios and medians, and writes
`kernels_bench/results/multi_worker.json`. Before each peer the hosts meet at a barrier (an
all-reduce), so that the peers run side by side on both; peers run in rotating order
(`harness.rotate`, the same on both hosts).

Case "input CPU": the input alone (no model), global batch 64, shuffled, each host taking
`--input-steps` steps after a warm-up, CPU-seconds per step per host (`time.process_time` of the
host, every thread, plus the CPU of the processes it started: feedpipe's worker processes).
The samples come from one map-style source (`SpinSource`): `source[i]` runs `--sample-ms`
(1) of GIL-holding pure-Python arithmetic (`gil_source.spin`, calibrated once in the parent,
so both hosts do the same work per sample) and returns `(x, y)`: float32 (32, 32, 3) and an
int64 label. Peers:

* `bare`: the host's 32 rows of each step made in the consumer's thread, `source[i]` for
  each and `np.stack`: the per-sample work alone, what no pipeline can go below;
* `w0`: `fp.Feeder(source, 64, strategy=mwms, shuffle=True)` (one background thread), read
  as `fp.train` reads it: `for batch in feeder`, `batch.distributed(strategy)`;
* `w2`: the same with `workers=2` worker processes per host;
* `dataset`: `feeder.as_dataset()` of a `workers=0` feeder, the `DistributedDataset` made by
  `distribute_datasets_from_function` (the stream for a custom loop over a dataset);
* `tfdata`: `Dataset.range(N).shuffle(N, seed).repeat().map(numpy_function(source[i]))
  .batch(64).prefetch(AUTOTUNE)` with `AutoShardPolicy.DATA`, through
  `strategy.experimental_distribute_dataset`: what a `Dataset` handed to the strategy (or to
  `model.fit`) does with a source that has no files. Each host reads every global batch and
  keeps its replicas' rows.

Why this is fair: both call the same Python `source[i]` for each sample they make, so the
per-sample work is identical and the difference is how many samples each host makes (feedpipe
32 per step, its rows; tf.data 64, every row) plus each pipeline's own cost per sample and per
batch. `tf.numpy_function` is how tf.data runs Python per-sample code (an equivalent tf map
would not be the same work). The map is sequential: the work holds the GIL, so parallel calls
cannot make it faster (`num_parallel_calls=AUTOTUNE` took the same CPU per batch, within a few
per cent, when this was written); one thread making the samples is also what `w0` does.
`rows_per_step` (the samples made in the host's process per step, counted in `source[i]`; not
for `w2`, whose samples are made in its worker processes) shows the 32 against 64;
`<peer>_over_bare` says how far each peer is from the work alone. Target: `w0` and `w2` CPU per
step / tf.data's <= 1/2 (1/W, W = 2 hosts); `dataset`'s ratio is reported.

Case "training": steps/s of `fp.train(model, fp.Feeder((x, y), 64, strategy=mwms,
shuffle=True), ...)` against a custom loop: `strategy.run` of a replica step inside a
`tf.function` (loss `tf.nn.compute_average_loss(per_sample, global_batch_size=64)`, the same
Keras optimizer's `apply_gradients`), over `strategy.distribute_datasets_from_function` of
`from_tensor_slices((x, y)).shard(hosts, host).shuffle(n).repeat().batch(32).prefetch(
AUTOTUNE)` (TensorFlow's multi-worker tutorial pattern; the step count is given, so no step
asks whether every host still has data). The same model (Flatten -> Dense 64 relu -> Dense
10 logits; sparse categorical cross-entropy from logits; SGD 0.01), made fresh for every
session with the same seed, on the same in-memory data (float32 (32, 32, 3), `--train-steps`
global batches per epoch), `--epochs` epochs per session. Start-up and steady state apart, as
in `fit_paths.py`: `first_step_s` (from before the input is built to the end of the first
step: input, tracing, first batch), `first_epoch_s`; steady: the epochs after the first,
`steps_s` and `cpu_ms` (process CPU per step). One untimed session of each peer first (what
the process does once per kind of loop). Target: fp.train / custom loop >= 1.0 in steady
steps/s.

Cases "epoch plan, N samples", "lazy plan per call" and "hosts to 64": what feedpipe's global
plan costs every host every epoch, and on paper as hosts grow to 64, measured in the parent
after the cluster (TensorFlow not loaded) by `epoch_plan.py`, whose docstring describes them,
against the per-sample work `bare` measured.

Run: `python -m kernels_bench.multi_worker [--quick] [--reps N] [--sample-ms 1]
[--input-steps 30] [--train-steps 100] [--epochs 3] [--max-length 1e8] [--deadline-s S]`;
writes `kernels_bench/results/multi_worker.json`.

This module imports neither TensorFlow nor feedpipe at the top: feedpipe's worker processes
unpickle `SpinSource` by module reference, and the parent never loads TensorFlow.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kernels_bench import harness
from kernels_bench.epoch_plan import GLOBAL_BATCH, HOSTS, run_plan
from kernels_bench.gil_source import SAMPLE_SHAPE, GilSource, make_sample, spin
from kernels_bench.harness.processes import (
    Relay,
    child_env,
    exit_with_parent,
    free_loopback_port,
    kill_tree,
)

FEED_WORKERS = 2
"""Worker processes per host of the `w2` peer."""
CLASSES = 10
COLLECTIVE_TIMEOUT_S = 60.0
"""A host waits this long for the other at a collective before raising, far beyond a step."""
INPUT_WARMUP_STEPS = 4
INPUT_PEERS = ("bare", "w0", "w2", "dataset", "tfdata")
FEEDPIPE_PEERS = ("w0", "w2", "dataset")
TRAIN_PEERS = ("train", "loop")
PEER_NAMES = {
    "bare": "the host's 32 rows of each step made in the consumer's thread: source[i] for each, "
    "np.stack (the per-sample work alone)",
    "w0": "fp.Feeder(source, 64, strategy=mwms, shuffle=True): for batch in feeder, "
    "batch.distributed(strategy)",
    "w2": f"the same with workers={FEED_WORKERS} (processes)",
    "dataset": "iter(fp.Feeder(source, 64, strategy=mwms, shuffle=True).as_dataset())",
    "tfdata": "Dataset.range(N).shuffle(N).repeat().map(tf.numpy_function(source[i])).batch(64)"
    ".prefetch(AUTOTUNE), AutoShardPolicy.DATA, strategy.experimental_distribute_dataset",
    "train": "fp.train(model, fp.Feeder((x, y), 64, strategy=mwms, shuffle=True), ...)",
    "loop": "tf.function(strategy.run(step)) over strategy.distribute_datasets_from_function("
    "from_tensor_slices((x, y)).shard(W, w).shuffle(n).repeat().batch(32).prefetch(AUTOTUNE))",
}


# ---- the source ---------------------------------------------------------------------------------


class SpinSource:
    """`length` samples; `source[i]` runs `iterations` turns of GIL-holding Python arithmetic,
    then returns `(x, y)` (`gil_source.make_sample`). `SpinSource.calls` counts the samples
    made in this process."""

    calls = 0

    def __init__(self, length: int, iterations: int):
        self.length = length
        self.iterations = iterations

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        SpinSource.calls += 1
        spin(self.iterations)
        return make_sample(int(index))


# ---- one host of the cluster -----------------------------------------------------------------


def make_barrier(strategy) -> Callable[[], None]:
    """A function that returns once every host has called it (one all-reduce)."""
    import tensorflow as tf

    @tf.function
    def meet():
        ones = strategy.run(lambda: tf.constant(1.0))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

    def barrier() -> None:
        meet().numpy()

    return barrier


@contextlib.contextmanager
def input_stream(peer: str, strategy, source: SpinSource, seed: int) -> Iterator[Callable]:
    """A function taking one step's input of `peer`, as the step would take it."""
    import tensorflow as tf

    import feedpipe as fp

    if peer == "bare":
        per_host = GLOBAL_BATCH // HOSTS
        first = [strategy.cluster_resolver.task_id * per_host]

        def make_rows():
            samples = [source[i] for i in range(first[0], first[0] + per_host)]
            first[0] = (first[0] + GLOBAL_BATCH) % (len(source) - GLOBAL_BATCH)
            return np.stack([x for x, _ in samples]), np.stack([y for _, y in samples])

        yield make_rows
        return
    if peer in ("w0", "w2", "dataset"):
        workers = FEED_WORKERS if peer == "w2" else 0
        with fp.Feeder(
            source, GLOBAL_BATCH, strategy=strategy, shuffle=True, seed=seed, workers=workers
        ) as feeder:
            if peer == "dataset":
                yield iter(feeder.as_dataset()).__next__
            else:
                batches = harness.endless(feeder)
                held: list = [None]

                def take():
                    # Holds the batch until the next, as `for batch in feeder` does.
                    held[0] = next(batches)
                    return held[0].distributed(strategy)

                yield take
                held.clear()
                batches.close()
        return
    if peer != "tfdata":
        raise ValueError(peer)

    def read(index):
        x, y = source[int(index)]
        return x, np.int64(y)

    def mapped(index):
        x, y = tf.numpy_function(read, [index], (tf.float32, tf.int64), stateful=False)
        return tf.ensure_shape(x, SAMPLE_SHAPE), tf.ensure_shape(y, ())

    dataset = (
        tf.data.Dataset.range(len(source))
        .shuffle(len(source), seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .map(mapped)
        .batch(GLOBAL_BATCH, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    yield iter(strategy.experimental_distribute_dataset(dataset.with_options(options))).__next__


def input_session(peer: str, strategy, source: SpinSource, steps: int, seed: int) -> dict:
    """One peer's input alone: a warm-up, then `steps` steps timed in CPU and wall time."""
    gc.collect()
    with input_stream(peer, strategy, source, seed) as take:
        for _ in range(INPUT_WARMUP_STEPS):
            take()
        calls, cpu, wall = SpinSource.calls, harness.tree_cpu_s(), time.perf_counter()
        for _ in range(steps):
            take()
        wall = time.perf_counter() - wall
        cpu = harness.tree_cpu_s() - cpu
        calls = SpinSource.calls - calls
    return {
        "cpu_ms": 1000 * cpu / steps,
        "wall_ms": 1000 * wall / steps,
        "rows_per_step": None if peer == "w2" else calls / steps,
    }


def build_model(strategy, seed: int):
    """The model of case "training" and its optimizer, made under `strategy`, seeded."""
    import keras

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(SAMPLE_SHAPE),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = keras.optimizers.SGD(learning_rate=0.01)
    return model, optimizer


def custom_loop(strategy, model, optimizer, x, y, epochs: int, seed: int) -> tuple:
    """The custom loop peer: its (wall, CPU) at the end of the first step and of each epoch."""
    import keras
    import tensorflow as tf

    per_sample = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(GLOBAL_BATCH)
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .shuffle(len(x) // context.num_input_pipelines, seed=seed)
            .repeat()
            .batch(per_replica, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )

    with strategy.scope():
        optimizer.build(model.trainable_variables)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    def replica_step(features, labels):
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            loss = tf.nn.compute_average_loss(
                per_sample(labels, logits), global_batch_size=GLOBAL_BATCH
            )
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    steps = len(x) // GLOBAL_BATCH
    first_step, epoch_ends = None, []
    for _ in range(epochs):
        total = 0.0
        for _ in range(steps):
            total += train_step(next(iterator))
            if first_step is None:
                float(total)
                first_step = (time.perf_counter(), time.process_time())
        float(total)
        epoch_ends.append((time.perf_counter(), time.process_time()))
    return first_step, epoch_ends


def train_session(peer: str, strategy, x, y, epochs: int, seed: int) -> dict:
    """One fresh model trained by `peer` for `epochs` epochs: start-up and steady figures."""
    import keras

    import feedpipe as fp
    from kernels_bench.fit_paths import clock_callback

    model, optimizer = build_model(strategy, seed)
    gc.collect()
    started = (time.perf_counter(), time.process_time())
    if peer == "train":
        clock = clock_callback(started)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        with fp.Feeder((x, y), GLOBAL_BATCH, strategy=strategy, shuffle=True, seed=seed) as feeder:
            fp.train(
                model,
                feeder,
                epochs=epochs,
                loss=loss,
                optimizer=optimizer,
                verbose=0,
                callbacks=[clock],
            )
        first_step, epoch_ends = clock.first_step, clock.epoch_ends
    elif peer == "loop":
        first_step, epoch_ends = custom_loop(strategy, model, optimizer, x, y, epochs, seed)
    else:
        raise ValueError(peer)
    if len(epoch_ends) != epochs:
        raise RuntimeError(f"{peer}: {len(epoch_ends)} epochs ended, not {epochs}")
    steady_steps = (len(x) // GLOBAL_BATCH) * (epochs - 1)
    wall0, (first_wall, first_cpu) = started[0], epoch_ends[0]
    last_wall, last_cpu = epoch_ends[-1]
    return {
        "first_step_s": first_step[0] - wall0,
        "first_epoch_s": first_wall - wall0,
        "steps_s": steady_steps / (last_wall - first_wall),
        "cpu_ms": 1000 * (last_cpu - first_cpu) / steady_steps,
    }


def host_main(settings: harness.Settings) -> None:
    """One host of the cluster: every repetition of both cases; writes `host<i>.json`."""
    threading.Thread(
        target=exit_with_parent, args=(os.getppid(),), name="host-parent-watch", daemon=True
    ).start()
    work_dir = Path(settings.args.work_dir)
    plan = json.loads((work_dir / "plan.json").read_text())
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    host = strategy.cluster_resolver.task_id
    if strategy.num_replicas_in_sync != HOSTS or host != settings.args.host:
        raise RuntimeError(
            f"host {settings.args.host}: the strategy has {strategy.num_replicas_in_sync} "
            f"replicas and calls this host {host}; expected {HOSTS} replicas, one per host"
        )
    barrier = make_barrier(strategy)
    seed = settings.seed
    source = SpinSource(GLOBAL_BATCH * 1000, plan["iterations"])
    rng = np.random.default_rng(seed)
    rows = GLOBAL_BATCH * plan["train_steps"]
    x = rng.random((rows, *SAMPLE_SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, rows).astype(np.int64)
    result: dict[str, Any] = {
        "host": host,
        "devices": list(strategy.extended.worker_devices),
        "input": [],
        "training": [],
    }

    def log(text: str) -> None:
        print(f"host {host}: {text}", flush=True)

    for peer in TRAIN_PEERS:  # untimed: what the process does once per kind of loop
        barrier()
        train_session(peer, strategy, x[: 2 * GLOBAL_BATCH], y[: 2 * GLOBAL_BATCH], 2, seed)
    for rep in range(settings.reps):
        measured = {}
        for peer in harness.rotate(INPUT_PEERS, rep):
            barrier()
            measured[peer] = input_session(peer, strategy, source, plan["input_steps"], seed)
        result["input"].append(measured)
        log(
            f"input rep {rep + 1}/{settings.reps}, CPU-ms per step: "
            + "  ".join(f"{p} {measured[p]['cpu_ms']:.1f}" for p in INPUT_PEERS)
        )
        measured = {}
        for peer in harness.rotate(TRAIN_PEERS, rep):
            barrier()
            measured[peer] = train_session(peer, strategy, x, y, plan["epochs"], seed)
        result["training"].append(measured)
        log(
            f"training rep {rep + 1}/{settings.reps}, steady steps/s: "
            + "  ".join(f"{p} {measured[p]['steps_s']:.1f}" for p in TRAIN_PEERS)
        )
    barrier()
    (work_dir / f"host{host}.json").write_text(json.dumps(result, indent=1))


# ---- the parent: the cluster ---------------------------------------------------------------------


def run_cluster(settings: harness.Settings, plan: dict, work_dir: Path) -> list[dict]:
    """Runs the hosts under the deadline; their results, by host. Kills them all in the end."""
    (work_dir / "plan.json").write_text(json.dumps(plan))
    addresses = [f"127.0.0.1:{free_loopback_port()}" for _ in range(HOSTS)]
    command = [sys.executable, "-m", "kernels_bench.multi_worker", "--work-dir", str(work_dir)]
    command += ["--seed", str(settings.seed), "--reps", str(settings.reps)]
    if settings.quick:
        command.append("--quick")
    env = child_env()
    processes: list[subprocess.Popen] = []
    deadline = time.monotonic() + settings.args.deadline_s
    try:
        for host in range(HOSTS):
            config = {
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": host},
            }
            with open(work_dir / f"host{host}.log", "w") as log:
                processes.append(
                    subprocess.Popen(
                        [*command, "--host", str(host)],
                        cwd=harness.REPO_DIR,
                        env={**env, "TF_CONFIG": json.dumps(config)},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        print(f"cluster: hosts {addresses}, PIDs {[p.pid for p in processes]}", flush=True)
        relay = Relay(work_dir / "host0.log", "host 0: ")
        while any(p.poll() is None for p in processes):
            relay()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the cluster did not finish within --deadline-s={settings.args.deadline_s}"
                )
            if any(p.poll() not in (None, 0) for p in processes):
                break  # one host failed: the other would wait for it at a collective
            time.sleep(0.5)
        relay()
        failed = [h for h, p in enumerate(processes) if p.poll() != 0]
        if failed:
            raise RuntimeError(f"host(s) {failed} failed")
    except BaseException:
        for host in range(HOSTS):
            path = work_dir / f"host{host}.log"
            if path.exists():
                print(f"--- host {host} log (tail) ---\n{path.read_text()[-3000:]}", flush=True)
        raise
    finally:
        for process in processes:
            kill_tree(process)
    return [json.loads((work_dir / f"host{h}.json").read_text()) for h in range(HOSTS)]


def mean_of_hosts(hosts: list[dict], case: str, rep: int, peer: str, key: str) -> float | None:
    values = [h[case][rep][peer][key] for h in hosts]
    return None if None in values else float(np.mean(values))


def input_rows(hosts: list[dict], reps: int) -> list[dict]:
    rows = []
    for rep in range(reps):
        row: dict[str, float | None] = {}
        for peer in INPUT_PEERS:
            for key in ("cpu_ms", "wall_ms", "rows_per_step"):
                row[f"{peer}_{key}"] = mean_of_hosts(hosts, "input", rep, peer, key)
        for peer in FEEDPIPE_PEERS:
            row[f"{peer}_over_tfdata"] = row[f"{peer}_cpu_ms"] / row["tfdata_cpu_ms"]
        for peer in INPUT_PEERS[1:]:
            row[f"{peer}_over_bare"] = row[f"{peer}_cpu_ms"] / row["bare_cpu_ms"]
        rows.append(row)
    return rows


def training_rows(hosts: list[dict], reps: int) -> list[dict]:
    rows = []
    for rep in range(reps):
        row: dict[str, float | None] = {}
        for peer in TRAIN_PEERS:
            for key in ("steps_s", "cpu_ms", "first_step_s", "first_epoch_s"):
                row[f"{peer}_{key}"] = mean_of_hosts(hosts, "training", rep, peer, key)
        row["train_over_loop"] = row["train_steps_s"] / row["loop_steps_s"]
        row["train_cpu_over_loop"] = row["train_cpu_ms"] / row["loop_cpu_ms"]
        row["train_first_step_over_loop"] = row["train_first_step_s"] / row["loop_first_step_s"]
        row["train_first_epoch_over_loop"] = row["train_first_epoch_s"] / row["loop_first_epoch_s"]
        rows.append(row)
    return rows


# ---- the parent ---------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sample-ms", type=float, default=1.0, help="per-sample Python work in ms (1)"
    )
    parser.add_argument(
        "--input-steps", type=int, default=None, help="input steps timed per peer (30; 12 quick)"
    )
    parser.add_argument(
        "--train-steps", type=int, default=None, help="training steps per epoch (100; 40 quick)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per training session, >= 2 (3; 2 quick)"
    )
    parser.add_argument(
        "--max-length",
        type=float,
        default=None,
        help="largest epoch plan timed, in samples (1e8; 1e7 quick)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="hard deadline of the cluster, seconds (420; 180 quick)",
    )
    # Set by the parent for the hosts it starts.
    parser.add_argument("--host", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    if settings.args.host is not None:
        host_main(settings)
        return
    args = settings.args
    args.input_steps = args.input_steps or settings.pick(12, 30)
    args.train_steps = args.train_steps or settings.pick(40, 100)
    args.epochs = args.epochs or settings.pick(2, 3)
    args.max_length = args.max_length or settings.pick(1e7, 1e8)
    args.deadline_s = args.deadline_s or settings.pick(180.0, 420.0)
    if args.epochs < 2:
        raise SystemExit(f"--epochs={args.epochs}: the steady state is the epochs after the first.")
    report = harness.Report(
        "multi_worker",
        "under MultiWorkerMirroredStrategy (2 hosts on loopback): input CPU per step of "
        "feedpipe against tf.data's DATA sharding, fp.train against a custom loop, and the "
        "per-epoch plan's cost as hosts and datasets grow",
        settings,
        "kernels_bench.multi_worker",
    )
    calibrated = GilSource(1, args.sample_ms / 1000)
    plan = {
        "iterations": calibrated.iterations,
        "input_steps": args.input_steps,
        "train_steps": args.train_steps,
        "epochs": args.epochs,
    }
    print(
        f"per-sample work: {calibrated.iterations} iterations "
        f"({1000 * calibrated.calibrated_s:.3f} ms when calibrated); {HOSTS} hosts, global "
        f"batch {GLOBAL_BATCH}; deadline {args.deadline_s:.0f} s",
        flush=True,
    )
    work = tempfile.TemporaryDirectory(prefix="feedpipe-multi-worker-")
    with work as tmp, harness.OtherLoad() as other:
        hosts = run_cluster(settings, plan, Path(tmp))
    common = {
        "hosts": HOSTS,
        "replicas_per_host": 1,
        "strategy": "MultiWorkerMirroredStrategy on 127.0.0.1, CommunicationOptions("
        f"timeout_seconds={COLLECTIVE_TIMEOUT_S:g}), 1 CPU device per host",
        "devices": {f"host {h['host']}": h["devices"] for h in hosts},
        "global_batch": GLOBAL_BATCH,
        "other_cores_during_cluster": other.cores,
    }
    entry = report.add_case(
        "input CPU",
        {
            **common,
            "peers": {p: PEER_NAMES[p] for p in INPUT_PEERS},
            "source": "SpinSource: source[i] = gil_source.spin(iterations) + make_sample(i)",
            "iterations": calibrated.iterations,
            "calibrated_sample_s": calibrated.calibrated_s,
            "rows_per_host_per_step": GLOBAL_BATCH // HOSTS,
            "warmup_steps": INPUT_WARMUP_STEPS,
            "timed_steps": args.input_steps,
            "source_length": GLOBAL_BATCH * 1000,
        },
        input_rows(hosts, settings.reps),
        units={f"{p}_cpu_ms": "CPU-ms per step per host" for p in INPUT_PEERS}
        | {f"{p}_wall_ms": "ms per step" for p in INPUT_PEERS},
        extra={"per_host": [h["input"] for h in hosts]},
    )
    sample_us = 1000 * entry["metrics"]["bare_cpu_ms"]["median"] / (GLOBAL_BATCH // HOSTS)
    for peer in ("w0", "w2"):
        report.target(
            "input CPU", f"{peer}_over_tfdata", "<=", 1 / HOSTS, f"{peer} CPU / tf.data DATA CPU"
        )
    report.target(
        "input CPU",
        "dataset_over_tfdata",
        "<=",
        1 / HOSTS,
        "as_dataset CPU / tf.data DATA CPU",
        applies=False,
        why_not="reported, no target",
    )
    report.add_case(
        "training",
        {
            **common,
            "peers": {p: PEER_NAMES[p] for p in TRAIN_PEERS},
            "model": "Flatten -> Dense 64 relu -> Dense 10 (logits)",
            "loss": "SparseCategoricalCrossentropy(from_logits=True)",
            "optimizer": "SGD(learning_rate=0.01)",
            "steps_per_epoch": args.train_steps,
            "epochs_per_session": args.epochs,
        },
        training_rows(hosts, settings.reps),
        units={f"{p}_steps_s": "steps/s" for p in TRAIN_PEERS}
        | {f"{p}_cpu_ms": "CPU-ms per step" for p in TRAIN_PEERS},
        extra={"per_host": [h["training"] for h in hosts]},
    )
    report.target("training", "train_over_loop", ">=", 1.0, "fp.train / custom loop")
    print("epoch plan (this process, TensorFlow not loaded):", flush=True)
    run_plan(report, settings, sample_us)
    report.note(
        "Per repetition: the mean of the 2 hosts, then the ratios; medians over repetitions. "
        "input CPU: time.process_time of the host plus its child processes, per step, after "
        f"{INPUT_WARMUP_STEPS} warm-up steps. training: steady = the epochs after the first. "
        "The 2 hosts share the machine's cores (and each has TensorFlow's default thread "
        "pools): wall-clock figures are the cluster's, CPU figures each host's. "
        "other_cores_during_cluster: the CPU other processes on the machine used meanwhile."
    )
    report.finish(
        columns=[
            "w0_cpu_ms",
            "w2_cpu_ms",
            "dataset_cpu_ms",
            "tfdata_cpu_ms",
            "w0_over_tfdata",
            "w2_over_tfdata",
            "dataset_over_tfdata",
            "bare_cpu_ms",
            "w0_rows_per_step",
            "tfdata_rows_per_step",
            "train_steps_s",
            "loop_steps_s",
            "train_over_loop",
            "train_first_step_s",
            "loop_first_step_s",
            "order_s",
            "order_bytes_per_sample",
            "steps_first_s",
            "steps_step_us",
            "lazy_step_us",
            "lazy_peak_bytes",
            "lazy_epoch_over_order",
            "us_1_rows",
            "us_64_rows",
            "us_4096_rows",
            "full_plan_us_per_own_row_64_hosts",
            "full_plan_over_sample_work_64_hosts",
            "lazy_plan_us_per_own_row_64_hosts",
            "lazy_plan_over_sample_work_64_hosts",
        ]
    )


if __name__ == "__main__":
    main()
