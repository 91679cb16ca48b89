"""How long does the step wait to take a batch that is already staged? (get latency)

The pipeline is kept staged: depth 8, a producer far faster than a 2 ms consumer step, so every
`next()` finds batches waiting (the script checks and reports the share that did; the ring is
refilled from half-empty, so it holds 4 to 8). Only
`next(iterator)` is timed; freeing the previous batch (which hands its host slot back to the
pool) happens when the loop rebinds its variable, and is reported beside it as `release`.

Two emulated steps are run, because the machine matters here: `sleep` (a GIL-free
`time.sleep`, the MLPerf Storage method) and `busy` (GIL-free hashing that keeps the core
awake). On virtual CPUs the first microseconds after a sleep run slowly whatever they do, so
a third case, `back to back`, takes `depth` staged batches in a row between 20 ms pauses: its
p50 is the code path's own cost on a warm core (no target; the floor). The peers below are
measured the same way in the same repetition:

* `queue`: a `queue.Queue(maxsize=depth)` filled by a thread with per-replica numpy arrays, the
  usual Python prefetch hand-off (what it costs to take one item, nothing more);
* `tf.data`: `next()` on `strategy.experimental_distribute_dataset(...)` over a prefetched
  dataset, the TensorFlow way to get per-replica batches.

Targets: feedpipe p50 <= 20 µs and p99 <= 100 µs.

Run: `python -m kernels_bench.get_latency [--quick]`; writes
`kernels_bench/results/get_latency.json`.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import numpy as np

from kernels_bench import harness

GLOBAL_BATCH = 128
ROW_FLOATS = 64
DEPTH = 8
STEP_S = 0.002


class BurstStep:
    """No step between takes, except a 20 ms pause after every `depth` of them.

    The pause lets the pipeline refill; the takes in between run back to back on a warm core,
    so their latency is the code path's own cost (only the first after each pause is cold).
    """

    def __init__(self, every: int, pause_s: float = 0.02):
        self.every = every
        self.pause_s = pause_s
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            time.sleep(self.pause_s)

    def as_dict(self) -> dict:
        return {"kind": "burst", "takes_per_burst": self.every, "pause_s": self.pause_s}


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    us = np.asarray(seconds) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


class Data:
    """The arrays every peer draws its batches from."""

    def __init__(self, batches: int, seed: int):
        rows = GLOBAL_BATCH * batches
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((rows, ROW_FLOATS), dtype=np.float32)
        self.y = rng.integers(0, 10, rows, dtype=np.int32)


def time_feedpipe(feeder, step, warmup: int, gets: int) -> dict:
    """One epoch of the feeder: `next()` timed alone, then the release of the previous batch."""
    pipeline_of = lambda: feeder._assembly.pipeline  # noqa: E731 (private: to check batches are staged)
    batches = iter(feeder)
    batch = next(batches)
    for _ in range(warmup):
        step()
        batch = next(batches)
    handoff = pipeline_of().handoff
    got, released, staged = [], [], 0
    for _ in range(gets):
        step()
        staged += handoff.staged > 0
        started = time.perf_counter()
        new = next(batches)
        taken = time.perf_counter()
        batch = new  # frees the previous batch, as `for batch in feeder` does
        done = time.perf_counter()
        del new
        got.append(taken - started)
        released.append(done - taken)
    del batch
    for _ in batches:  # finish the epoch so the next repetition starts a fresh one
        pass
    p50, p99 = _percentiles(got)
    r50, r99 = _percentiles(released)
    return {
        "feedpipe_p50_us": p50,
        "feedpipe_p99_us": p99,
        "feedpipe_release_p50_us": r50,
        "feedpipe_release_p99_us": r99,
        "staged_fraction": staged / gets,
    }


class QueuePeer:
    """A thread that keeps a bounded `queue.Queue` full of per-replica numpy batches."""

    def __init__(self, data: Data, replicas: int, seed: int):
        self.data = data
        self.replicas = replicas
        self.queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self.stop = threading.Event()
        self.rng = np.random.default_rng(seed)
        self.thread = threading.Thread(target=self._fill, name="bench-queue-peer", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        n = len(self.data.y)
        per = GLOBAL_BATCH // self.replicas
        while not self.stop.is_set():
            rows = self.rng.integers(0, n, GLOBAL_BATCH)
            x, y = self.data.x[rows], self.data.y[rows]
            item = [
                (x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
                for r in range(self.replicas)
            ]
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def time_getter(get, step, warmup: int, gets: int) -> tuple[float, float]:
    """p50 and p99 (µs) of `get()` after each step."""
    item = get()
    for _ in range(warmup):
        step()
        item = get()
    got = []
    for _ in range(gets):
        step()
        started = time.perf_counter()
        new = get()
        got.append(time.perf_counter() - started)
        item = new
        del new
    del item
    return _percentiles(got)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-tfdata", action="store_true", help="leave out the tf.data peer")


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    devices = harness.configure_tf(2)
    import tensorflow as tf

    import feedpipe as fp

    report = harness.Report(
        "get_latency",
        "latency of taking an already-staged batch",
        settings,
        "kernels_bench.get_latency",
    )
    warmup, gets = settings.pick((20, 200), (30, 600))
    data = Data(warmup + gets + DEPTH + 8, settings.seed)
    feeder = fp.Feeder((data.x, data.y), GLOBAL_BATCH, devices=devices, depth=DEPTH)
    peer = QueuePeer(data, len(devices), settings.seed)
    strategy = tf.distribute.MirroredStrategy(devices)
    tf_iter = None
    if not settings.args.no_tfdata:
        dataset = (
            tf.data.Dataset.from_tensor_slices((data.x, data.y))
            .repeat()
            .batch(GLOBAL_BATCH, drop_remainder=True)
            .prefetch(DEPTH)
        )
        tf_iter = iter(strategy.experimental_distribute_dataset(dataset))

    steps = {
        "sleep": harness.EmulatedStep(STEP_S),
        "busy": harness.BusyStep(STEP_S),
        "burst": BurstStep(DEPTH),
    }
    try:
        for mode, step in steps.items():
            rows = []
            for rep in range(settings.reps):
                row: dict = {}
                peers = ["feedpipe", "queue"] + (["tf.data"] if tf_iter is not None else [])
                for name in harness.rotate(peers, rep):
                    if name == "feedpipe":
                        row.update(time_feedpipe(feeder, step, warmup, gets))
                    elif name == "queue":
                        p50, p99 = time_getter(peer.queue.get, step, warmup, gets)
                        row.update(queue_p50_us=p50, queue_p99_us=p99)
                    else:
                        p50, p99 = time_getter(lambda: next(tf_iter), step, warmup, gets)
                        row.update(tfdata_p50_us=p50, tfdata_p99_us=p99)
                row["p50_over_queue"] = row["feedpipe_p50_us"] / row["queue_p50_us"]
                if "tfdata_p50_us" in row:
                    row["p50_over_tfdata"] = row["feedpipe_p50_us"] / row["tfdata_p50_us"]
                rows.append(row)
                print(
                    f"  {mode} rep {rep + 1}/{settings.reps}: feedpipe p50 "
                    f"{row['feedpipe_p50_us']:.1f} µs p99 {row['feedpipe_p99_us']:.1f} µs; "
                    f"queue p50 {row['queue_p50_us']:.1f} µs",
                    flush=True,
                )
            case = {"burst": "back to back (no step)"}.get(mode, f"{mode} step")
            report.add_case(
                case,
                {
                    "step": step.as_dict(),
                    "depth": DEPTH,
                    "global_batch": GLOBAL_BATCH,
                    "row_bytes": ROW_FLOATS * 4 + 4,
                    "replicas": len(devices),
                    "warmup_gets": warmup,
                    "gets_per_rep": gets,
                },
                rows,
            )
            if mode != "burst":  # the targets are for a taking step; burst shows the floor
                report.target(case, "feedpipe_p50_us", "<=", 20.0, "p50 µs")
                report.target(case, "feedpipe_p99_us", "<=", 100.0, "p99 µs")
    finally:
        feeder.close()
        peer.close()
    report.note(
        "Percentiles are taken within each repetition; the table shows their median "
        "over repetitions. `staged_fraction` is the share of gets that found a batch "
        "already staged (1.0 = the pipeline was always full)."
    )
    report.finish(
        columns=[
            "feedpipe_p50_us",
            "feedpipe_p99_us",
            "queue_p50_us",
            "tfdata_p50_us",
            "feedpipe_release_p50_us",
            "staged_fraction",
        ]
    )


if __name__ == "__main__":
    main()
