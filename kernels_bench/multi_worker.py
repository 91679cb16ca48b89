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

Case "epoch plan, N samples" (in the parent, after the cluster, TensorFlow not loaded): what
feedpipe's global plan costs every host every epoch, N = 1e5, 1e6, 1e7 and 1e8 (1e8 in a full
run only, where the machine has the memory, over 3 repetitions: one takes seconds):

* `order_*`: `Sampler(N, 64, shuffle=True).order(epoch)`, the full permutation: its time and
  peak memory in one pass (`tracemalloc`, which sees numpy's buffers; a few large allocations,
  which tracing does not slow), and that time spread over the epoch's steps. Where the sampler
  says it plans lazily (`Sampler.lazy`), the flag is turned off on that instance, so that the
  figure stays the full permutation the lazy plan replaces;
* `steps_*`: `Sampler(..., share=host 0 of 2).steps(epoch)`, as the feeder reads it, whatever
  the sampler does at that length: the time to its first step, per step after it, and (in a
  second pass: tracing slows each of its many small allocations) the peak memory. A sampler
  that materialises its order pays `order_s` before its first step, so at 1e8 the steps are
  timed only where the sampler is lazy;
* `lazy_*`, the hook for a lazy permutation (indices computed per batch, without the whole
  permutation): where `feedpipe.core.sampler` (or `feedpipe.permutation`) has a
  `LazyPermutation(length, key)` whose call maps positions to sample indices, its build time,
  time per step (one global batch of 64 positions) and peak memory, and `lazy_epoch_s`, that
  time per step over the epoch's steps, against `order_s` in `lazy_epoch_over_order` (what
  the lazy plan costs in CPU for the memory it saves); the case's `lazy_plan` param says which
  was found, or that none was.

Case "lazy plan per call" (where there is a lazy permutation): its time per call at the
largest N, by the number of positions asked for, 1 to 4096: a host computes only its own rows
of each step, B/H positions.

Case "hosts to 64" (on paper, from those figures): for 1 to 64 hosts, each host's rows per
step (`feedpipe.split.HostShare`: B/H, for this run's B = 64 with 1 replica per host and for
B = 4096 with 8), and what the plan costs per row the host makes, against the per-sample work
measured by `bare` (`*_over_sample_work`). The full permutation costs O(N) on every host
whatever H while a host makes N/H rows an epoch: order_s x H / N per own row. A lazy plan
costs a call on the host's B/H positions of several steps at once (up to 4,096 rows a call):
the metrics at 64 hosts time the host's `Sampler(..., share=).steps()` itself, per own row.
The metrics are those at 64 hosts of B = 64 (1 row per host per step) and the largest N; the
whole table is the case's `table`.

Run: `python -m kernels_bench.multi_worker [--quick] [--reps N] [--sample-ms 1]
[--input-steps 30] [--train-steps 100] [--epochs 3] [--max-length 1e8] [--deadline-s S]`;
writes
`kernels_bench/results/multi_worker.json`.

This module imports neither TensorFlow nor feedpipe at the top: feedpipe's worker processes
unpickle `SpinSource` by module reference, and the parent never loads TensorFlow.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import socket
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
from kernels_bench.gil_source import SAMPLE_SHAPE, GilSource, make_sample, spin

HOSTS = 2
"""Worker processes of the cluster, 1 replica each (one CPU device per worker)."""
GLOBAL_BATCH = 64
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
PLAN_LENGTHS = (10**5, 10**6, 10**7, 10**8)
PLAN_STEPS_TIMED = 200
"""Steps of a plan timed after its first: enough to average out one slice's noise."""
LAZY_CALLS_TIMED = 50
"""Calls of a lazy permutation timed per size of the positions asked for."""
BIG_PLAN_REPS = harness.MIN_REPS
"""Repetitions at 1e8 samples, where one takes seconds."""
SCALE_HOSTS = (1, 2, 4, 8, 16, 32, 64)
SCALE_BATCHES = ((GLOBAL_BATCH, 1), (4096, 8))
"""(global batch, replicas per host) of the hosts-to-64 table: this run's, and a large one."""


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


def _exit_with_parent(parent: int) -> None:
    """Ends this host once the process that started it is gone (however it ended)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def host_main(settings: harness.Settings) -> None:
    """One host of the cluster: every repetition of both cases; writes `host<i>.json`."""
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(),), name="host-parent-watch", daemon=True
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


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def kill_tree(process: subprocess.Popen) -> None:
    """Kills `process` and every process it started, each by its PID (psutil checks that a
    PID still names the process it listed before signalling it)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if process.poll() is None:
        process.kill()
    process.wait()
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


class Relay:
    """Prints the new lines of a host's log that start with `prefix` (its progress)."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix, self.offset = path, prefix, 0

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                text = log.read()
        except OSError:
            return
        complete = text[: text.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(self.prefix):
                print(f"  {line}", flush=True)


def run_cluster(settings: harness.Settings, plan: dict, work_dir: Path) -> list[dict]:
    """Runs the hosts under the deadline; their results, by host. Kills them all in the end."""
    (work_dir / "plan.json").write_text(json.dumps(plan))
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(HOSTS)]
    command = [sys.executable, "-m", "kernels_bench.multi_worker", "--work-dir", str(work_dir)]
    command += ["--seed", str(settings.seed), "--reps", str(settings.reps)]
    if settings.quick:
        command.append("--quick")
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(harness.REPO_DIR), os.environ.get("PYTHONPATH")])
        ),
    }
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


# ---- the parent: the plan's cost -----------------------------------------------------------------


def lazy_plan() -> tuple[Any, str]:
    """The hook for a lazy permutation: `LazyPermutation(length, key)` from `feedpipe.core.sampler`
    (or `feedpipe.permutation`), called with positions, returning sample indices; and where
    it was found (None and why not, where none is)."""
    import importlib

    for module in ("feedpipe.core.sampler", "feedpipe.permutation"):
        try:
            found = getattr(importlib.import_module(module), "LazyPermutation", None)
        except ImportError:
            continue
        if found is not None:
            return found, f"{module}.LazyPermutation"
    return None, (
        "none found: feedpipe.core.sampler (and feedpipe.permutation) has no LazyPermutation"
    )


def plan_rep(length: int, lazy: Any, with_steps: bool, seed: int) -> dict:
    """One repetition of the plan's cost at `length` samples (epoch 0 of `seed`)."""
    from feedpipe.core.sampler import Sampler
    from feedpipe.core.split import HostShare

    epoch = 0
    sampler = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed)
    if getattr(sampler, "lazy", False):
        # The full permutation that the lazy plan replaces at this length, for comparison.
        sampler.lazy = False
    row: dict[str, float | None] = {}
    with harness.traced() as memory:
        started = time.perf_counter()
        order = sampler.order(epoch)
        row["order_s"] = time.perf_counter() - started
    del order
    row["order_peak_bytes"] = memory["peak_bytes"]
    row["order_bytes_per_sample"] = memory["peak_bytes"] / length
    row["order_us_per_step"] = 1e6 * row["order_s"] / len(sampler)
    timed = min(PLAN_STEPS_TIMED, len(sampler) - 1)
    row["steps_first_s"] = row["steps_step_us"] = row["steps_peak_bytes"] = None
    if with_steps:
        share = HostShare(GLOBAL_BATCH, HOSTS, 0, 1).rows
        shared = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed, share=share)
        started = time.perf_counter()
        steps = shared.steps(epoch)
        next(steps)
        row["steps_first_s"] = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(timed):
            next(steps)
        row["steps_step_us"] = 1e6 * (time.perf_counter() - started) / timed
        steps.close()
        with harness.traced() as memory:  # apart: tracing slows each small allocation
            steps = shared.steps(epoch)
            for _ in range(timed + 1):
                next(steps)
            steps.close()
        row["steps_peak_bytes"] = memory["peak_bytes"]
    row["lazy_build_s"] = row["lazy_step_us"] = row["lazy_peak_bytes"] = None
    row["lazy_epoch_s"] = row["lazy_epoch_over_order"] = None
    if lazy is not None:

        def lazy_steps() -> tuple[float, float]:
            """Builds the permutation and plans `timed` steps: the seconds of each."""
            started = time.perf_counter()
            permutation = lazy(length, (seed, epoch))
            built = time.perf_counter()
            for step in range(timed):
                permutation(np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
            return built - started, time.perf_counter() - built

        build_s, steps_s = lazy_steps()
        row["lazy_build_s"], row["lazy_step_us"] = build_s, 1e6 * steps_s / timed
        with harness.traced() as memory:  # apart, as above
            lazy_steps()
        row["lazy_peak_bytes"] = memory["peak_bytes"]
        row["lazy_epoch_s"] = row["lazy_step_us"] * len(sampler) / 1e6
        row["lazy_epoch_over_order"] = row["lazy_epoch_s"] / row["order_s"]
    return row


PLAN_UNITS = {
    "order_s": "s",
    "order_peak_bytes": "bytes",
    "order_bytes_per_sample": "bytes",
    "order_us_per_step": "µs per step (amortised)",
    "steps_first_s": "s",
    "steps_step_us": "µs",
    "steps_peak_bytes": "bytes",
    "lazy_build_s": "s",
    "lazy_step_us": "µs",
    "lazy_peak_bytes": "bytes",
    "lazy_epoch_s": "s (its steps of one epoch, from lazy_step_us)",
}


def run_plan(report: harness.Report, settings: harness.Settings, sample_us: float) -> None:
    """The cases "epoch plan, N samples" and "hosts to 64"; `sample_us` is the CPU of one
    sample's work, as measured in case "input CPU"."""
    import psutil

    from feedpipe.core.sampler import Sampler

    lazy, lazy_where = lazy_plan()
    available = psutil.virtual_memory().available
    plans: dict[int, dict] = {}
    for length in (n for n in PLAN_LENGTHS if n <= settings.args.max_length):
        # The permutation, a copy, and room for everything else.
        if 3 * 16 * length > available:
            report.note(f"epoch plan at {length:.0e} samples skipped: {available} bytes free")
            continue
        sampler_is_lazy = bool(getattr(Sampler(length, GLOBAL_BATCH, shuffle=True), "lazy", False))
        # A sampler that materialises its order pays a full permutation before its first
        # step: at 1e8 that is seconds per repetition again, for the figure `order_s` gives.
        with_steps = length < 10**8 or sampler_is_lazy
        reps = settings.reps if length < 10**8 else min(settings.reps, BIG_PLAN_REPS)
        plan_rep(min(length, 10**5), lazy, with_steps, 99)  # warm-up: imports, first calls
        rows = [plan_rep(length, lazy, with_steps, settings.seed + rep) for rep in range(reps)]
        case = f"epoch plan, {length:.0e} samples"
        entry = report.add_case(
            case,
            {
                "length": length,
                "global_batch": GLOBAL_BATCH,
                "reps": reps,
                "sampler_is_lazy": sampler_is_lazy,
                "order": "Sampler(length, 64, shuffle=True).order(epoch): the full permutation"
                + (" (the instance's `lazy` flag turned off)" if sampler_is_lazy else ""),
                "steps": f"Sampler(..., share=HostShare(64, {HOSTS}, 0, 1).rows).steps(epoch), "
                "as the feeder reads it"
                if with_steps
                else "not timed: the sampler materialises its order (order_s) before its first",
                "lazy_plan": lazy_where,
                "steps_timed": min(PLAN_STEPS_TIMED, -(-length // GLOBAL_BATCH) - 1),
            },
            rows,
            units=PLAN_UNITS,
        )
        plans[length] = entry
        print(f"  {case}: order {entry['metrics']['order_s']['median']:.3g} s", flush=True)
    if plans:
        scale_model(report, settings, plans, lazy, lazy_where, sample_us)


def lazy_call_rep(lazy: Any, length: int, sizes: list[int], seed: int) -> dict:
    """One repetition of a lazy permutation's cost per call, by the positions asked for."""
    permutation = lazy(length, (seed, 0))
    row = {}
    for size in sizes:
        calls = LAZY_CALLS_TIMED
        starts = np.random.default_rng([seed, size]).integers(0, length - size, calls)
        started = time.perf_counter()
        for first in starts:
            permutation(np.arange(first, first + size))
        row[f"us_{size}_rows"] = 1e6 * (time.perf_counter() - started) / calls
    return row


def sampler_step_us(length: int, share: range, seed: int) -> float:
    """µs per step of the sampler a host with `share` runs, after its first step."""
    from feedpipe.core.sampler import Sampler

    steps = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed, share=share).steps(0)
    next(steps)
    started = time.perf_counter()
    for _ in range(PLAN_STEPS_TIMED):
        next(steps)
    return 1e6 * (time.perf_counter() - started) / PLAN_STEPS_TIMED


def scale_model(
    report: harness.Report,
    settings: harness.Settings,
    plans: dict[int, dict],
    lazy: Any,
    lazy_where: str,
    sample_us: float,
) -> None:
    """The case "hosts to 64" (and "lazy plan per call"): the plan's measured cost spread over
    the rows each host makes."""
    from feedpipe.core.split import HostShare

    largest = max(plans)
    shares = [
        (batch, local, hosts, HostShare(batch, hosts, 0, local))
        for batch, local in SCALE_BATCHES
        for hosts in SCALE_HOSTS
    ]
    lazy_us: dict[int, float] = {}
    if lazy is not None:
        # The host computes its own positions of each step: its share's size, timed as such.
        sizes = sorted({len(share.rows) for *_, share in shares})
        lazy_call_rep(lazy, largest, sizes, 99)  # warm-up
        entry = report.add_case(
            "lazy plan per call",
            {"length": largest, "lazy_plan": lazy_where, "calls_timed": LAZY_CALLS_TIMED},
            [lazy_call_rep(lazy, largest, sizes, settings.seed + r) for r in range(settings.reps)],
            units={f"us_{size}_rows": "µs per call" for size in sizes},
        )
        lazy_us = {size: entry["metrics"][f"us_{size}_rows"]["median"] for size in sizes}

    table = []
    for batch, local, hosts, share in shares:
        rows = len(share.rows)
        line: dict[str, Any] = {
            "global_batch": batch,
            "hosts": hosts,
            "replicas_per_host": local,
            "rows_per_host_per_step": rows,
            "rows_per_replica_per_step": share.local_split.per_replica,
        }
        for length, entry in plans.items():
            key = f"{length:.0e}"
            own_rows = math.ceil(length / batch) * rows
            full_us = 1e6 * entry["metrics"]["order_s"]["median"] / own_rows
            line[f"own_rows_per_epoch_{key}"] = own_rows
            line[f"full_plan_us_per_own_row_{key}"] = full_us
            line[f"full_plan_over_sample_work_{key}"] = full_us / sample_us
        if lazy_us:
            key = f"{largest:.0e}"
            line[f"lazy_plan_us_per_own_row_{key}"] = lazy_us[rows] / rows
            line[f"lazy_plan_over_sample_work_{key}"] = lazy_us[rows] / rows / sample_us
            line[f"lazy_over_full_plan_{key}"] = (
                lazy_us[rows] / rows / line[f"full_plan_us_per_own_row_{key}"]
            )
        table.append(line)

    metrics = plans[largest]["metrics"]
    one_row = HostShare(GLOBAL_BATCH, SCALE_HOSTS[-1], 0, 1)  # 64 rows over 64 hosts: 1 each
    own_rows = math.ceil(largest / GLOBAL_BATCH) * len(one_row.rows)
    reps = []
    for index, order_s in enumerate(metrics["order_s"]["reps"]):
        rep: dict[str, float | None] = {
            "full_plan_us_per_own_row_64_hosts": 1e6 * order_s / own_rows,
            "full_plan_over_sample_work_64_hosts": 1e6 * order_s / own_rows / sample_us,
            "full_plan_peak_bytes_per_host": metrics["order_peak_bytes"]["reps"][index],
            "lazy_plan_us_per_own_row_64_hosts": None,
            "lazy_plan_over_sample_work_64_hosts": None,
            "lazy_plan_peak_bytes_per_host": None,
        }
        if lazy_us:
            # As the feeder pays it: the host's sampler plans its one row of each step, several
            # steps per call of the lazy permutation.
            per_row = sampler_step_us(largest, one_row.rows, settings.seed + index)
            rep["lazy_plan_us_per_own_row_64_hosts"] = per_row
            rep["lazy_plan_over_sample_work_64_hosts"] = per_row / sample_us
            rep["lazy_plan_peak_bytes_per_host"] = metrics["lazy_peak_bytes"]["reps"][index]
        reps.append(rep)
    report.add_case(
        "hosts to 64",
        {
            "length": largest,
            "global_batch": GLOBAL_BATCH,
            "hosts": SCALE_HOSTS[-1],
            "sample_us": sample_us,
            "model": "Every host computes the plan of every epoch. The full permutation costs "
            "O(N) time and memory whatever H, and a host makes N/H rows of it: its cost per own "
            "row is order_s x H / N. A lazy plan computes each step's positions of the host "
            "alone: per own row, one call on B/H positions (case 'lazy plan per call') over "
            "B/H.",
            "lazy_plan": lazy_where,
        },
        reps,
        units={
            "full_plan_us_per_own_row_64_hosts": "µs",
            "full_plan_peak_bytes_per_host": "bytes",
            "lazy_plan_us_per_own_row_64_hosts": "µs",
            "lazy_plan_peak_bytes_per_host": "bytes",
        },
        extra={"table": table},
    )


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
