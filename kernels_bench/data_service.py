"""What does feeding through tf.data service cost, and is it exact? Samples/s of a TensorFlow
decode-and-augment transform run locally and on 1 and 2 tf.data service workers on loopback,
feedpipe over the service against the same pipeline through
`tf.data.experimental.service.distribute` alone.

On a 2-core machine this measures the plumbing's correctness and its overhead, not a speed-up:
the service's processes run on the same two cores as the trainer's process.

The files: 512 JPEGs (8 classes x 64, 51-96 px a side) written once into a temporary folder by
`examples/make_image_folder.py`, listed `--repeat` (4) times, so that an epoch is 2,048 samples
(32 steps of 64). The source is three arrays: the paths, the class labels (int64) and each
sample's index (int64, the tag the checks read). The transform (`augment(sample, seed)`,
TensorFlow ops only): `read_file`, `decode_jpeg` (3 channels), a square crop of 60-100 % of the
short side at a random place (`stateless_random_crop`), resize to 64 x 64 (bilinear),
`stateless_random_flip_left_right`, float32 / 255; it returns (image, label, index). Its
randomness comes only from `seed`, a stateless-RNG seed, so a sample's value does not depend on
the process that made it.

Peers, each over the same files and transform, global batch 64, shuffled, producing alone (no
model, no step), on one CPU device:

* `tfdata_local`: `from_tensor_slices(arrays).shuffle(N, reshuffle_each_iteration=True)
  .map(augment with seed [seed, index], AUTOTUNE, deterministic=False).batch(64)
  .prefetch(AUTOTUNE)`, in this process: the machine's own ceiling for this work;
* `fp_local`: `fp.Feeder(arrays, 64, shuffle=True, transform=augment)` without a service: the
  feeder's thread calls the transform once per sample, eagerly (TensorFlow op by op), with the
  same stateless seed the service's workers get;
* `distribute_1w`, `distribute_2w`: the `tfdata_local` pipeline up to `batch(64)`
  `.apply(tf.data.experimental.service.distribute("distributed_epoch", address))`: shuffle, map
  and batch on the service's workers, elements of 64 rows (what a user who moves the pipeline
  to the service writes; feedpipe's 64-row elements are its own choice, and their cost is part
  of what is measured); one dataset, iterated once per epoch, so one job per epoch, as
  `model.fit` iterates it;
* `distribute_repeat_1w`, `distribute_repeat_2w`: distribute's steady state: the same pipeline
  with `repeat()` after `from_tensor_slices`, so one job serves an endless stream shuffled
  through one buffer (epochs mix, so no epoch is checked), timed over as many samples as
  `--epochs` epochs hold after one epoch's worth;
* `fp_job_1w`, `fp_job_2w`: feedpipe's own job read plainly, without the feeder: each epoch
  `ServiceWork(...).job(address, Sampler(...).order(epoch), epoch, 0)` (splits sized from the
  job, `ServiceWork.split_rows`: 32 rows at 2,048 rows;
  64-row elements) iterated until all its rows are in, as the feeder's reader does, nothing
  written into slots. It splits fp_service's cost into the service's side (fp_job /
  distribute) and the feeder's (fp_service / fp_job);
* `fp_service_1w`, `fp_service_2w`: `fp.Feeder(arrays, 64, shuffle=True, transform=augment,
  service=address)`: one job per epoch over the rows of the steps, 64 rows per element
  (`feedpipe.service.ROWS_PER_ELEMENT`), each row written into its place in the host slot.

The service runs as two clusters on loopback started by this script before the repetitions,
each a `python -m feedpipe service` dispatcher with its workers (1, and 2), every process on a
free port of 127.0.0.1; the cluster a peer does not use stands idle. At the end, on an error,
or past `--deadline-s` (then the script exits 2) every process the script started is stopped by
PID: SIGTERM, then SIGKILL after a grace.

Measured per peer, built fresh in each repetition, peers in rotating order (`harness.rotate`):
`first_batch_s` (start-up: from building the peer to its first batch in hand); then the rest of
the first epoch, untimed (warm-up; its values are checked); then `--epochs` whole epochs back
to back, timed: `samples_s` (from asking each epoch to its last batch: each epoch's start
counts, as in training; the metric of the targets), `steady_samples_s` (from each epoch's first
batch to its last), `epoch_start_s` (from asking an epoch to its first batch). `fp_local`, ~15x
slower, is timed over `--local-batches` batches of its first epoch instead. CPU per sample over
the timed epochs says where the work went: `client_cpu_us` (this process, every thread),
`dispatcher_cpu_us` and `worker_cpu_us` (the service's processes), `total_cpu_us`. Ratios are
taken within each repetition, then the median over repetitions.

Two comparisons, because a job per epoch and a steady stream cost differently. tf.data
service's dynamic sharding hands out a `from_tensor_slices` source one element per split: one
RPC from the worker to the dispatcher per sample. In `distribute_*`, `shuffle` asks for all the
epoch's splits, one after the other, to fill its buffer before the first batch, and the client
then waits for the job's end: that sits in each epoch's time but outside `steady_samples_s`,
while feedpipe's jobs ask for their splits as the map runs, inside it, and the feeder starts
the next epoch's job before the consumer asks. So: whole epochs, a job each, feedpipe against
`distribute_*` (what training over epochs sees); and the steady state, feedpipe within its
epochs against `distribute_repeat_*`'s endless job, where `distribute` pays one split per
sample as it goes and feedpipe one per 16 rows or more (`ServiceWork.split_rows`).

Exactness, checked in every repetition and recorded: `exact` is 1 where every epoch seen (the
first and the timed ones) delivered each index exactly once (for the feeders in their plan's
order, `Sampler(N, 64, shuffle=True, seed).order(epoch)`; for `fp_local`, the rows taken are
that order's first rows), else 0. `same_values` is the share of the first epoch's images that
are bit-identical to what `tfdata_local`'s pipeline makes here for the same index (the seed is
[seed, index] in the first epoch for all; `fp_local`'s are those of its first batches).

Targets, for 1 and 2 workers: fp_service / distribute >= 0.9 in samples/s over whole epochs;
fp_service's steady samples/s / distribute_repeat's >= 0.9; `exact` = 1 for both feeders. The
rest is reported.

Run: `python -m kernels_bench.data_service [--quick] [--reps N] [--repeat 4] [--epochs 2]
[--local-batches 8] [--deadline-s 590]`; writes `kernels_bench/results/data_service.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kernels_bench import harness
from kernels_bench.harness import OtherLoad
from kernels_bench.harness.processes import Servers, deadline

EXAMPLES = harness.REPO_DIR / "examples"
GLOBAL_BATCH = 64
CLASSES, PER_CLASS, SIZE_HINT = 8, 64, 64
"""512 files, 51-96 px a side (make_image_folder draws 0.8x-1.5x the hint), as in images.py."""
OUT_SIZE = 64
CROP_RANGE = (0.6, 1.0)
"""The crop's side as a share of the image's short side."""
WORKER_COUNTS = (1, 2)
PEERS = (
    "tfdata_local",
    "fp_local",
    "distribute_1w",
    "distribute_2w",
    "distribute_repeat_1w",
    "distribute_repeat_2w",
    "fp_job_1w",
    "fp_job_2w",
    "fp_service_1w",
    "fp_service_2w",
)
PEER_NAMES = {
    "tfdata_local": "from_tensor_slices(arrays).shuffle(N).map(augment, AUTOTUNE, "
    "deterministic=False).batch(64).prefetch(AUTOTUNE), in this process",
    "fp_local": "fp.Feeder(arrays, 64, shuffle=True, transform=augment), service=None: the "
    "transform run eagerly per sample in the feeder's thread",
    "distribute_1w": "the same pipeline up to batch(64) .apply(tf.data.experimental.service."
    "distribute('distributed_epoch', address)): shuffle, map and batch on 1 service worker, 64-row "
    "elements, one job per epoch",
    "distribute_2w": "the same on 2 service workers",
    "distribute_repeat_1w": "from_tensor_slices(arrays).repeat().shuffle(N).map(...).batch(64)"
    " .apply(distribute('distributed_epoch', address)): one job, one endless stream shuffled "
    "through one buffer (epochs mix), 1 service worker: distribute's steady state",
    "distribute_repeat_2w": "the same on 2 service workers",
    "fp_job_1w": "feedpipe's own job, read plainly: ServiceWork(arrays, augment, seed).job("
    "address, Sampler(N, 64, shuffle=True, seed).order(epoch), epoch, 0) (64-row elements, "
    "splits sized from the job), iterated until all its rows are in, no slots: the service's "
    "side of fp_service alone; 1 service worker",
    "fp_job_2w": "the same on 2 service workers",
    "fp_service_1w": "fp.Feeder(arrays, 64, shuffle=True, transform=augment, service=address): "
    "1 service worker, 64-row elements, one job per epoch",
    "fp_service_2w": "the same on 2 service workers",
}
WORKERS_OF = {
    f"{kind}_{w}w": w
    for kind in ("distribute", "distribute_repeat", "fp_job", "fp_service")
    for w in WORKER_COUNTS
}
"""The service's workers of each peer that uses it."""
FEEDERS = ("fp_local", "fp_service_1w", "fp_service_2w")
METRICS = (
    "samples_s",
    "steady_samples_s",
    "first_batch_s",
    "epoch_start_s",
    "client_cpu_us",
    "dispatcher_cpu_us",
    "worker_cpu_us",
    "exact",
)
LOCAL_WARMUP_BATCHES = 3
SETTLE_S = 1.0
"""Pause after each peer, so that a job it left behind ends before the next peer is timed."""


# ---- the transform -----------------------------------------------------------------------------


def augment(sample, seed):
    """Decodes a JPEG, crops a random square of 60-100 % of its short side, resizes it to 64 x 64,
    flips it at random and scales it to [0, 1]; random only through `seed` (int64 [2])."""
    import tensorflow as tf

    path, label, index = sample
    image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
    size_seed, crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
    short = tf.cast(tf.reduce_min(tf.shape(image)[:2]), tf.float32)
    side = tf.cast(short * tf.random.stateless_uniform([], size_seed, *CROP_RANGE), tf.int32)
    image = tf.image.stateless_random_crop(image, tf.stack([side, side, 3]), crop_seed)
    image = tf.image.resize(image, (OUT_SIZE, OUT_SIZE))
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    return image / 255.0, label, index


# ---- the peers ---------------------------------------------------------------------------------


def tf_pipeline(
    arrays: tuple[np.ndarray, ...], seed: int, shuffle: bool = True, repeat: bool = False
):
    """The tf.data pipeline of `tfdata_local` and `distribute_*`, up to `batch(64)`; with
    `repeat`, one endless stream of epochs shuffled through one buffer."""
    import tensorflow as tf

    seed_t = tf.constant(seed, tf.int64)

    def mapped(path, label, index):
        return augment((path, label, index), tf.stack([seed_t, index]))

    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if repeat:
        dataset = dataset.repeat()
    if shuffle:
        dataset = dataset.shuffle(len(arrays[0]), seed=seed, reshuffle_each_iteration=True)
    return dataset.map(mapped, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False).batch(
        GLOBAL_BATCH
    )


def job_epochs(work, address: str, plan, length: int) -> Callable[[], Iterator]:
    """`fp_job_*`: each call reads the next epoch's feedpipe job (`ServiceWork.job` over the
    plan's order) plainly, up to its last row, as the feeder's reader does."""
    epochs = itertools.count()

    def epoch():
        owed, number = length, next(epochs)
        for tags, images, _, indices in work.job(address, plan.order(number), number, 0):
            yield images, indices
            owed -= len(tags)
            if owed <= 0:
                return

    return epoch


@contextlib.contextmanager
def open_peer(
    peer: str, arrays: tuple[np.ndarray, ...], addresses: dict[int, str], device: str, seed: int
) -> Iterator[tuple[Callable[[], Iterator], Any]]:
    """`peer`, built: a function returning an iterator over its next epoch's (images, indices),
    and the feeder (None for the other peers)."""
    import tensorflow as tf

    import feedpipe as fp

    address = addresses.get(WORKERS_OF.get(peer, 0))
    if peer in FEEDERS:
        with fp.Feeder(
            arrays,
            GLOBAL_BATCH,
            devices=[device],
            shuffle=True,
            seed=seed,
            transform=augment,
            service=address,
        ) as feeder:

            def feeder_epoch():
                for batch in feeder:
                    images, _, indices = batch.replicas[0]
                    yield images, indices

            yield feeder_epoch, feeder
        return
    if peer.startswith("fp_job"):
        from feedpipe.core.sampler import Sampler
        from feedpipe.core.sources import as_source
        from feedpipe.service.client import ServiceWork, check_address

        work = ServiceWork(as_source(arrays, text=True), augment, seed)
        plan = Sampler(len(arrays[0]), GLOBAL_BATCH, shuffle=True, seed=seed)
        yield job_epochs(work, check_address(address), plan, len(arrays[0])), None
        return
    stream = peer.startswith("distribute_repeat")
    dataset = tf_pipeline(arrays, seed, repeat=stream)
    if peer == "tfdata_local":
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
    else:
        dataset = dataset.apply(
            tf.data.experimental.service.distribute(
                processing_mode="distributed_epoch", service=address
            )
        )

    def dataset_epoch():
        for images, _, indices in dataset:
            yield images, indices

    if stream:  # one job: every call goes on with the same stream
        batches = dataset_epoch()
        yield (lambda: batches), None
    else:
        yield dataset_epoch, None


def digests(images, indices) -> dict[int, str]:
    """Each image's digest by its sample index."""
    images = np.asarray(images)
    return {
        int(i): hashlib.sha1(np.ascontiguousarray(image)).hexdigest()
        for image, i in zip(images, np.asarray(indices), strict=True)
    }


def reference_digests(arrays: tuple[np.ndarray, ...], seed: int) -> dict[int, str]:
    """Every sample's image digest as `tfdata_local`'s pipeline makes it here, unshuffled."""
    found: dict[int, str] = {}
    for images, _, indices in tf_pipeline(arrays, seed, shuffle=False).prefetch(2):
        found.update(digests(images, indices))
    return found


def run_peer(
    peer: str,
    arrays: tuple[np.ndarray, ...],
    addresses: dict[int, str],
    device: str,
    seed: int,
    epochs: int,
    local_batches: int,
    servers: Servers,
) -> dict:
    """One repetition of `peer`: start-up and the first epoch (untimed, its values checked),
    then `epochs` whole epochs timed back to back; `fp_local` takes `local_batches` batches
    after a few, the `distribute_repeat_*` streams as many samples as `epochs` epochs hold."""
    from feedpipe.core.sampler import Sampler

    length = len(arrays[0])
    local, stream = peer == "fp_local", peer.startswith("distribute_repeat")
    gc.collect()
    started = time.perf_counter()
    with open_peer(peer, arrays, addresses, device, seed) as (next_epoch, feeder):
        batches = next_epoch()
        images, indices = next(batches)
        first_batch_s = time.perf_counter() - started
        order = [np.asarray(indices)]
        values = digests(images, indices)
        taken = len(order[0])
        for images, indices in batches:
            order.append(np.asarray(indices))
            taken += len(order[-1])
            values.update(digests(images, indices))
            if (local and len(order) == LOCAL_WARMUP_BATCHES) or (stream and taken >= length):
                break
        del images
        seen = [np.concatenate(order)]  # each epoch's indices in delivery order
        starts, steady_rows, steady_s = [], 0, 0.0
        with OtherLoad() as other:
            cpu = time.process_time()
            dispatcher, worker = servers.cpu_s("dispatcher"), servers.cpu_s("worker")
            wall = time.perf_counter()
            if local or stream:
                goal, rows = (local_batches * GLOBAL_BATCH if local else epochs * length), 0
                while rows < goal:
                    indices = np.asarray(next(batches)[1])
                    seen.append(indices)
                    rows += len(indices)
                steady_rows, steady_s = rows, time.perf_counter() - wall
            else:
                for _ in range(epochs):
                    asked, arrivals, order = time.perf_counter(), [], []
                    for _, indices in next_epoch():
                        arrivals.append(time.perf_counter())
                        order.append(np.asarray(indices))
                    starts.append(arrivals[0] - asked)
                    steady_rows += sum(map(len, order[1:]))
                    steady_s += arrivals[-1] - arrivals[0]
                    seen.append(np.concatenate(order))
                rows = epochs * length
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            dispatcher = servers.cpu_s("dispatcher") - dispatcher
            worker = servers.cpu_s("worker") - worker
        jobs = getattr(feeder and feeder._assembly.producer, "jobs", None)
        batches.close()
    time.sleep(SETTLE_S)
    plan = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed)
    if stream:  # epochs mix in one shuffle buffer: no epoch to check
        exact = None
    elif local:  # the plan's first rows
        delivered = np.concatenate(seen)
        exact = np.array_equal(delivered, plan.order(0)[: len(delivered)])
    elif peer in FEEDERS:  # each epoch whole, in the plan's order
        exact = all(np.array_equal(ids, plan.order(e)) for e, ids in enumerate(seen))
    else:  # each index once per epoch, in any order
        exact = all(np.array_equal(np.sort(ids), np.arange(length)) for ids in seen)
    return {
        "samples_s": rows / wall,
        "steady_samples_s": steady_rows / steady_s,
        "first_batch_s": first_batch_s,
        "epoch_start_s": float(np.mean(starts)) if starts else None,
        "client_cpu_us": 1e6 * cpu / rows,
        "dispatcher_cpu_us": 1e6 * dispatcher / rows,
        "worker_cpu_us": 1e6 * worker / rows,
        "exact": None if exact is None else float(exact),
        "jobs": jobs,
        "other_cores": other.cores,
        "values": values,
    }


def rep_row(result: dict[str, dict], reference: dict[int, str]) -> dict:
    """One repetition's metrics, its ratios taken within it."""
    row: dict[str, Any] = {}
    for peer in PEERS:
        for key in METRICS:
            row[f"{peer}_{key}"] = result[peer][key]
        row[f"{peer}_total_cpu_us"] = sum(
            result[peer][key] for key in ("client_cpu_us", "dispatcher_cpu_us", "worker_cpu_us")
        )
        values = result[peer]["values"]
        row[f"{peer}_same_values"] = (
            sum(reference[i] == digest for i, digest in values.items()) / len(values)
            if values
            else None
        )
    for workers in WORKER_COUNTS:
        fp_peer, job_peer, ds_peer, stream_peer = (
            f"{kind}_{workers}w"
            for kind in ("fp_service", "fp_job", "distribute", "distribute_repeat")
        )
        for over, under in ((fp_peer, ds_peer), (job_peer, ds_peer), (fp_peer, job_peer)):
            row[f"{over}_over_{under}"] = row[f"{over}_samples_s"] / row[f"{under}_samples_s"]
        for key in ("steady_samples_s", "first_batch_s", "epoch_start_s", "total_cpu_us"):
            row[f"{fp_peer}_{key.rsplit('_', 1)[0]}_over_{ds_peer}"] = (
                row[f"{fp_peer}_{key}"] / row[f"{ds_peer}_{key}"]
            )
        # The steady state of each: feedpipe within its epochs, distribute's one endless job.
        row[f"{fp_peer}_steady_over_{stream_peer}"] = (
            row[f"{fp_peer}_steady_samples_s"] / row[f"{stream_peer}_samples_s"]
        )
        for key in ("client_cpu_us", "total_cpu_us"):
            row[f"{fp_peer}_{key.rsplit('_', 1)[0]}_over_{stream_peer}"] = (
                row[f"{fp_peer}_{key}"] / row[f"{stream_peer}_{key}"]
            )
    for peer in PEERS[1:]:
        row[f"{peer}_over_tfdata_local"] = (
            result[peer]["samples_s"] / result["tfdata_local"]["samples_s"]
        )
    for kind in ("fp_service", "fp_job", "distribute", "distribute_repeat"):
        row[f"{kind}_2w_over_1w"] = (
            result[f"{kind}_2w"]["samples_s"] / result[f"{kind}_1w"]["samples_s"]
        )
    row["other_cores"] = max(result[peer]["other_cores"] for peer in PEERS)
    return row


# ---- main ------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="times the 512 files are listed in an epoch (4: 2,048 samples; 2 quick)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs timed per peer (2; 1 quick)"
    )
    parser.add_argument(
        "--local-batches", type=int, default=None, help="batches timed of fp_local (8; 4 quick)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="hard deadline of the whole run, seconds (590; 300 quick)",
    )


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    args.repeat = args.repeat or settings.pick(2, 4)
    args.epochs = args.epochs or settings.pick(1, 2)
    args.local_batches = args.local_batches or settings.pick(4, 8)
    args.deadline_s = args.deadline_s or settings.pick(300.0, 590.0)
    length = CLASSES * PER_CLASS * args.repeat
    report = harness.Report(
        "data_service",
        "samples/s of a TensorFlow decode-and-augment transform locally and on 1 and 2 tf.data "
        "service workers on loopback: feedpipe over the service against "
        "tf.data.experimental.service.distribute alone, and whether feedpipe stays exact",
        settings,
        "kernels_bench.data_service",
    )
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="feedpipe-bench-ds-")))
        servers = Servers(root)
        stack.callback(servers.stop)
        stack.enter_context(deadline(args.deadline_s, servers))
        # The servers start before TensorFlow loads here: their imports and ours overlap.
        started = time.perf_counter()
        addresses = servers.clusters(WORKER_COUNTS)
        ready_s = time.perf_counter() - started
        (device,) = harness.configure_tf(1)
        sys.path.insert(0, str(EXAMPLES))
        import make_image_folder

        files = make_image_folder.make_image_folder(
            root / "images", CLASSES, PER_CLASS, SIZE_HINT, settings.seed
        )
        megabytes = sum(Path(path).stat().st_size for path, _ in files) / 1e6
        paths = np.array([path for path, _ in files] * args.repeat)
        labels = np.array([label for _, label in files] * args.repeat, np.int64)
        arrays = (paths, labels, np.arange(length, dtype=np.int64))
        reference = reference_digests(arrays, settings.seed)
        print(
            f"{len(files)} JPEGs ({megabytes:.1f} MB) listed {args.repeat} times: epochs of "
            f"{length} samples; service clusters {addresses} ready in {ready_s:.1f} s",
            flush=True,
        )
        rows, jobs = [], []
        for rep in range(settings.reps):
            result = {
                peer: run_peer(
                    peer,
                    arrays,
                    addresses,
                    device,
                    settings.seed,
                    args.epochs,
                    args.local_batches,
                    servers,
                )
                for peer in harness.rotate(PEERS, rep)
            }
            rows.append(rep_row(result, reference))
            jobs.append({peer: result[peer]["jobs"] for peer in FEEDERS})
            print(
                f"  rep {rep + 1}/{settings.reps}: "
                + "  ".join(f"{p} {result[p]['samples_s']:,.0f}/s" for p in PEERS)
                + "  exact "
                + "".join(
                    "-" if result[p]["exact"] is None else str(int(result[p]["exact"]))
                    for p in PEERS
                )
                + f"  (other processes: up to {rows[-1]['other_cores']:.2f} core)",
                flush=True,
            )
        servers.stop()
    context = {
        "files": len(files),
        "file_megabytes": round(megabytes, 2),
        "repeat": args.repeat,
        "samples_per_epoch": length,
        "timed_epochs": args.epochs,
        "fp_local_warmup_batches": LOCAL_WARMUP_BATCHES,
        "fp_local_timed_batches": args.local_batches,
        "servers_ready_s": ready_s,
        "feeder_jobs": jobs,
    }
    finish(report, context, rows)


def finish(report: harness.Report, context: dict, rows: list[dict]) -> None:
    case = "decode + augment"
    units = {f"{p}_{k}": "samples/s" for p in PEERS for k in ("samples_s", "steady_samples_s")}
    units |= {f"{p}_{k}": "s" for p in PEERS for k in ("first_batch_s", "epoch_start_s")}
    units |= {
        f"{p}_{k}": "CPU-µs per sample"
        for p in PEERS
        for k in ("client_cpu_us", "dispatcher_cpu_us", "worker_cpu_us")
    }
    from feedpipe.service.client import ROWS_PER_ELEMENT

    report.add_case(
        case,
        {
            "peers": PEER_NAMES,
            **context,
            "size_hint_px": SIZE_HINT,
            "global_batch": GLOBAL_BATCH,
            "output": {"image": [OUT_SIZE, OUT_SIZE, 3], "dtype": "float32"},
            "bytes_per_sample_out": OUT_SIZE * OUT_SIZE * 3 * 4 + 8 + 8,
            "transform": "read_file, decode_jpeg(channels=3), stateless_random_crop of a square "
            f"{CROP_RANGE[0]:g}-{CROP_RANGE[1]:g} of the short side, resize to {OUT_SIZE} "
            "(bilinear), stateless_random_flip_left_right, / 255",
            "service": "per worker count, a dispatcher and its workers (`python -m feedpipe "
            "service`), separate processes on 127.0.0.1",
            "feedpipe_rows_per_element": ROWS_PER_ELEMENT,
        },
        rows,
        units=units,
    )
    for workers in WORKER_COUNTS:
        fp_peer, ds_peer = f"fp_service_{workers}w", f"distribute_{workers}w"
        report.target(
            case,
            f"{fp_peer}_over_{ds_peer}",
            ">=",
            0.9,
            f"{fp_peer} / {ds_peer} (samples/s over whole epochs, a job each)",
        )
        report.target(
            case,
            f"{fp_peer}_steady_over_distribute_repeat_{workers}w",
            ">=",
            0.9,
            f"{fp_peer} within its epochs / distribute_repeat_{workers}w (steady samples/s)",
        )
        report.target(
            case, f"{fp_peer}_exact", ">=", 1.0, f"{fp_peer}: each sample once, in the plan's order"
        )
    report.note(
        "samples_s: whole epochs back to back after the first (the first: start-up, tracing, "
        "the first job, tf.data's autotuning, values checked), from asking each epoch to its "
        "last batch, so each epoch's start and end count; distribute_repeat_*: its one stream "
        "over as many samples, after one epoch's worth; fp_local over its batches after "
        f"{LOCAL_WARMUP_BATCHES} of its first epoch. steady_samples_s: the same epochs from "
        "their first batch to their last (with shuffle, distribute_* fetch the epoch's splits, "
        "one RPC per sample, to fill the shuffle buffer before their first batch, so that cost "
        "falls outside this window for them and inside it for fp_*; distribute_repeat_* pays "
        "it as it goes, like fp_*). Each peer fresh per repetition, peers in rotating order, "
        "ratios "
        "within each repetition. Producer alone: no step. client_cpu_us: this process's CPU "
        "(every thread) per sample over the timed epochs; dispatcher_cpu_us, worker_cpu_us: "
        "the service processes' (both clusters'; the idle one's heartbeats included); "
        "total_cpu_us: their sum. first_batch_s: from building the peer to its first batch; "
        "epoch_start_s: from asking a timed epoch to its first batch (mean). other_cores: the "
        "most CPU other processes used during one peer's timed window of the repetition."
    )
    report.note(
        "On 2 shared cores the service's processes and this one compete for the same CPUs: the "
        "figures show the plumbing's cost and correctness, not a speed-up."
    )
    report.finish(
        columns=[
            *(f"{p}_samples_s" for p in PEERS),
            *(f"{p}_steady_samples_s" for p in PEERS),
            *(f"fp_service_{w}w_over_distribute_{w}w" for w in WORKER_COUNTS),
            *(f"fp_service_{w}w_steady_samples_over_distribute_{w}w" for w in WORKER_COUNTS),
            *(f"fp_service_{w}w_steady_over_distribute_repeat_{w}w" for w in WORKER_COUNTS),
            *(f"fp_job_{w}w_over_distribute_{w}w" for w in WORKER_COUNTS),
            *(f"fp_service_{w}w_over_fp_job_{w}w" for w in WORKER_COUNTS),
            *(f"{p}_first_batch_s" for p in PEERS),
            *(f"{p}_epoch_start_s" for p in PEERS),
            *(
                f"{p}_{k}"
                for p in PEERS
                for k in ("client_cpu_us", "dispatcher_cpu_us", "worker_cpu_us", "total_cpu_us")
            ),
            *(f"{p}_exact" for p in PEERS),
            *(f"{p}_same_values" for p in PEERS),
            "other_cores",
        ]
    )


if __name__ == "__main__":
    main()
