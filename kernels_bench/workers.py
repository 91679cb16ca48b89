"""How much faster do worker processes turn GIL-bound Python data code into batches than the
serial loop and the usual peers?

The source (`kernels_bench.gil_source.GilSource`) is a map-style object whose `__getitem__(i)`
runs about 1 ms of pure-Python integer arithmetic (calibrated once, when it is built; the
GIL is held throughout) and returns `(x, y)`: float32 (32, 32, 3) filled from `i`, an int64
label. Global batch 64, one CPU device. Each peer starts at sample 0, is warmed up (worker
start-up and the first batches untimed), then takes the same number of batches as fast as it
can; samples/s, and the ratios of peers measured in the same repetition (order rotated).

Peers:

* serial: the same code in the main process, `source[i]` 64 times and `np.stack`.
* bare (the machine's ceiling, no target): the serial loop in 2 spawned processes at once,
  each timing its own half of the batches, nothing passed back. On a 2-vCPU machine two busy
  cores may each run Python slower than one does alone; `bare_over_serial` says by how much,
  and `process_over_bare` how much of that ceiling feedpipe's workers reach.
* feedpipe, 2 worker processes: `fp.Feeder(source, 64, devices=[cpu], workers=2,
  worker_mode="process")`, iterated across epochs (`harness.endless`). The mode is named so
  that this peer stays the processes whichever mode is the default.
* feedpipe, 2 worker threads (`worker_mode="thread"`): GIL-bound code cannot scale there; it
  is measured to show by how much it does not.
* feedpipe, `workers=0`: the one background thread, for reference.
* Keras: a `keras.utils.PyDataset` (`workers=2, use_multiprocessing=True`) whose
  `__getitem__(batch)` stacks 64 samples, iterated as `model.fit` does with the TensorFlow
  backend: `PyDatasetAdapter.get_tf_dataset()` (a `from_generator` over its `OrderedEnqueuer`,
  a `multiprocessing.Pool` forked from this process, so the dataset is inherited, not
  pickled), after `on_epoch_begin()`.
* tf.data: `Dataset.from_generator(gen, output_signature=...).batch(64).prefetch(AUTOTUNE)`
  over the same samples.
* Grain: `grain.MapDataset.source(source).batch(64).to_iter_dataset().mp_prefetch(
  grain.MultiprocessingOptions(num_workers=2))`, iterated with Grain's own iterator (2 spawned
  worker processes, each making whole batches and handing them over in shared memory; its
  default buffer of 1 batch per worker). The source's `__getitem__` holds the per-sample code,
  as for every other peer; a `.map(fn)` holding it instead runs in the same worker processes.
  `model.fit` on such a dataset wraps Grain's iterator in Keras's `from_generator`, as it
  wraps the others.

Targets (case "GIL-bound"): feedpipe processes >= 1.8x serial (DESIGN.md's generator
speedup), >= 1.3x Keras, >= 2.5x tf.data; Grain is reported beside them (no target). Case
"GIL-releasing" repeats serial, bare, processes and threads over `GilFreeSource` (about 1 ms
of `hashlib.sha256` per sample, GIL released), and the row "thread vs process" sets
process/thread of both sources side by side: the measurement that chooses the default
`worker_mode` (no target).

Case "whole epochs": serial, feedpipe's processes, Keras, tf.data and Grain, timed over whole
epochs with their start-up, as a training run meets them. Each peer is built fresh over the
first `--epoch-batches` batches of the GIL-bound source (default 60; 30 with --quick), then reads
2 epochs back to back, each the way `model.fit` starts an epoch: the same feeder iterated
again, `on_epoch_begin()`/`on_epoch_end()` around a pass of the Keras adapter's dataset, a new
iterator of the tf.data dataset, a new iterator of the Grain dataset (which starts its worker
processes again). `<peer>_first_batch_s` is the time from building the peer to its first batch,
`<peer>_epoch1_s` the first epoch with that start-up, `<peer>_epoch2_s` the second;
`process_over_<peer>_epoch1` and `_epoch2` are the ratios of the peer's epoch time to feedpipe's
(above 1: feedpipe's processes finish the epoch sooner). Closing each peer is not timed.

Case "interference": the duration of an emulated accelerator's step (`harness.EmulatedStep`,
a GIL-free `time.sleep` of `--step-ms`, default 20) timed alone, then while 2 worker
processes produce (one batch taken before each step; only the step call is timed). Target:
mean step with workers / mean step alone <= 1.03.

Case "steady-state memory": 2 worker processes, the consumer holding each batch until it takes
the next. After warm-up, host slots allocated during the measured window
(`stats().slots_allocated`, overflow included): target 0 (on the median; the worst repetition
is noted). Host bytes held by the slots (`slots_allocated` x slot bytes) and the peak RSS
growth of the main process (as in `copy_cost.py`; the workers' own interpreters are not
counted), each against slots x batch bytes + 16 MB, slots being the pool's fixed capacity
(depth + 1 + the slots filled at once): target <= 1. Like `copy_cost.py`, the script
re-executes itself with `MALLOC_MMAP_THRESHOLD_=131072` so that freed buffers leave the RSS.

Each repetition also records `other_cores`: the CPU that other processes on the machine used
during its timed windows (`/proc/stat` less this process tree). On 2 cores a repetition with
more than ~0.1 core of other work does not measure the peers alone; look at it before trusting
a ratio.

The sources live in `kernels_bench.gil_source`, which imports only numpy and the standard
library: feedpipe's worker processes are fresh interpreters that unpickle the source by module
reference, and must never import TensorFlow. This module, too, imports neither TensorFlow nor
feedpipe at the top.

Run: `python -m kernels_bench.workers [--quick] [--step-ms 20] [--sample-ms 1]
[--epoch-batches 60]`; writes `kernels_bench/results/workers.json`. The Grain peer needs
`pip install grain` (in `feedpipe[bench]`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import gc
import itertools
import multiprocessing
import statistics
import time
from collections.abc import Iterator

import numpy as np

from kernels_bench import harness
from kernels_bench.copy_cost import SLACK_BYTES, rerun_with_mmap_threshold, rss_bytes
from kernels_bench.gil_source import (
    BATCH,
    SAMPLE_SHAPE,
    GilFreeSource,
    GilSource,
    make_batch,
    timed_batches,
)

GLOBAL_BATCH = BATCH
WORKERS = 2
LENGTH = GLOBAL_BATCH * 1000
"""More batches than any measurement takes from a fresh peer (at most ~170): no epoch boundary
falls inside one. No more: the feeder holds each epoch's order, 8 bytes per sample."""
BATCH_BYTES = GLOBAL_BATCH * (int(np.prod(SAMPLE_SHAPE)) * 4 + 8)

GIL_PEERS = ("serial", "bare", "process", "thread", "w0", "pydataset", "tfdata", "grain")
EPOCH_PEERS = ("serial", "process", "pydataset", "tfdata", "grain")
EPOCHS = 2
GIL_FREE_PEERS = ("serial", "bare", "process", "thread")
PEER_NAMES = {
    "serial": "serial loop in the main process (source[i] x 64, np.stack)",
    "bare": (
        f"the machine's ceiling: the serial loop in {WORKERS} bare spawned processes at once, "
        "no pipeline, batches dropped"
    ),
    "process": f'fp.Feeder(workers={WORKERS}, worker_mode="process")',
    "thread": f'fp.Feeder(workers={WORKERS}, worker_mode="thread")',
    "w0": "fp.Feeder(workers=0): one background thread",
    "pydataset": (
        f"keras.utils.PyDataset(workers={WORKERS}, use_multiprocessing=True) via "
        "PyDatasetAdapter.get_tf_dataset(), as model.fit on TensorFlow"
    ),
    "tfdata": "tf.data.Dataset.from_generator(...).batch(64).prefetch(AUTOTUNE)",
    "grain": (
        "grain.MapDataset.source(source).batch(64).to_iter_dataset().mp_prefetch("
        f"MultiprocessingOptions(num_workers={WORKERS}))"
    ),
}


# ---- the peers -------------------------------------------------------------------------------


def serial_batches(source) -> Iterator:
    for number in itertools.count():
        yield make_batch(source, number)


@contextlib.contextmanager
def feedpipe_batches(source, device: str, workers: int, mode: str | None) -> Iterator[Iterator]:
    import feedpipe as fp

    options = {} if mode is None else {"worker_mode": mode}
    with fp.Feeder(
        source, global_batch_size=GLOBAL_BATCH, devices=[device], workers=workers, **options
    ) as feeder:
        yield harness.endless(feeder)


def pydataset_class():
    """The Keras peer's `PyDataset` (built on first use: Keras imports TensorFlow)."""
    import keras

    class GilPyDataset(keras.utils.PyDataset):
        def __init__(self, source, **kwargs):
            super().__init__(**kwargs)
            self.source = source

        def __len__(self) -> int:
            return len(self.source) // GLOBAL_BATCH

        def __getitem__(self, number: int):
            return make_batch(self.source, number)

    return GilPyDataset


@contextlib.contextmanager
def pydataset_batches(source) -> Iterator[Iterator]:
    """Batches as Keras' `TFEpochIterator` takes them (one epoch, left early), less the
    default strategy's `experimental_distribute_dataset` wrapper."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    dataset = pydataset_class()(source, workers=WORKERS, use_multiprocessing=True)
    adapter = PyDatasetAdapter(dataset, shuffle=False)
    tf_dataset = adapter.get_tf_dataset()  # reads 2 batches here, for the signature
    adapter.on_epoch_begin()  # starts the enqueuer's pool
    try:
        yield iter(tf_dataset)
    finally:
        adapter.on_epoch_end()  # stops the enqueuer: its pending batches are drained


@contextlib.contextmanager
def tfdata_batches(source) -> Iterator[Iterator]:
    import tensorflow as tf

    def samples():
        for index in itertools.count():
            yield source[index % len(source)]

    dataset = (
        tf.data.Dataset.from_generator(
            samples,
            output_signature=(
                tf.TensorSpec(SAMPLE_SHAPE, tf.float32),
                tf.TensorSpec((), tf.int64),
            ),
        )
        .batch(GLOBAL_BATCH)
        .prefetch(tf.data.AUTOTUNE)
    )
    yield iter(dataset)


def grain_dataset(source):
    """The Grain peer's dataset: whole batches made in `WORKERS` spawned processes."""
    import grain

    return (
        grain.MapDataset.source(source)
        .batch(GLOBAL_BATCH)
        .to_iter_dataset()
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS))
    )


@contextlib.contextmanager
def grain_batches(source) -> Iterator[Iterator]:
    iterator = iter(grain_dataset(source))
    try:
        yield iterator
    finally:
        iterator.close()  # stops its processes and frees its shared memory


def open_peer(peer: str, source, device: str):
    if peer == "serial":
        return contextlib.nullcontext(serial_batches(source))
    if peer == "process":
        return feedpipe_batches(source, device, WORKERS, "process")
    if peer == "thread":
        return feedpipe_batches(source, device, WORKERS, "thread")
    if peer == "w0":
        return feedpipe_batches(source, device, 0, None)
    if peer == "pydataset":
        return pydataset_batches(source)
    if peer == "tfdata":
        return tfdata_batches(source)
    if peer == "grain":
        return grain_batches(source)
    raise ValueError(peer)


def bare_samples_per_s(source, warmup: int, count: int) -> tuple[float, float]:
    """Samples/s of `WORKERS` bare processes each making `count / WORKERS` batches at once
    (timed inside each; the slowest sets the wall time), after `warmup` batches each, and the
    cores other processes used meanwhile."""
    context = multiprocessing.get_context("spawn")
    share = -(-count // WORKERS)
    with concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
        for future in [pool.submit(timed_batches, source, 0, warmup) for _ in range(WORKERS)]:
            future.result()
        with harness.OtherLoad() as other:
            futures = [pool.submit(timed_batches, source, k * share, share) for k in range(WORKERS)]
            done = [future.result() for future in futures]
    return sum(samples for samples, _ in done) / max(seconds for _, seconds in done), other.cores


def samples_per_s(peer: str, source, device: str, warmup: int, count: int) -> tuple[float, float]:
    """Samples/s of a fresh `peer` over `count` batches taken back to back, after `warmup`
    untimed ones, and the cores other processes used meanwhile. Everything the peer made is
    freed on return (a tf.data iterator keeps prefetching until it is freed: not beside the
    next peer)."""
    if peer == "bare":
        return bare_samples_per_s(source, warmup, count)
    with open_peer(peer, source, device) as batches:
        for _ in range(warmup):
            next(batches)
        with harness.OtherLoad() as other:
            started = time.perf_counter()
            for _ in range(count):
                next(batches)
            elapsed = time.perf_counter() - started
        return count * GLOBAL_BATCH / elapsed, other.cores


# ---- case 1: throughput ----------------------------------------------------------------------


def throughput_case(report, settings, name, source, peers, device, warmup, count) -> list[dict]:
    rows = []
    for rep in range(settings.reps):
        rates, other_cores = {}, []
        for peer in harness.rotate(peers, rep):
            rates[peer], other = samples_per_s(peer, source, device, warmup, count)
            other_cores.append(other)
            gc.collect()
        row = {f"{peer}_samples_s": rates[peer] for peer in peers}
        for peer in peers:
            if peer != "process":
                row[f"process_over_{peer}"] = rates["process"] / rates[peer]
        for peer in peers:
            if peer not in ("serial", "process"):
                row[f"{peer}_over_serial"] = rates[peer] / rates["serial"]
        row["other_cores"] = max(other_cores)
        rows.append(row)
        print(
            f"  {name} rep {rep + 1}/{settings.reps}: "
            + "  ".join(f"{peer} {rates[peer]:,.0f}/s" for peer in peers)
            + f"  (other processes: up to {row['other_cores']:.2f} core)",
            flush=True,
        )
    report.add_case(
        name,
        {
            "source": source.as_dict(),
            "peers": {peer: PEER_NAMES[peer] for peer in peers},
            "global_batch": GLOBAL_BATCH,
            "workers": WORKERS,
            "warmup_batches": warmup,
            "batches": count,
        },
        rows,
        units={f"{peer}_samples_s": "samples/s" for peer in peers},
    )
    return rows


# ---- case 2: whole epochs, start-up included -------------------------------------------------


@contextlib.contextmanager
def epoch_peer(peer: str, source, device: str) -> Iterator:
    """`peer` built over `source`: yields a function that returns the batches of its next
    epoch, started as `model.fit` starts an epoch. Everything is freed on return."""
    import tensorflow as tf

    batches = len(source) // GLOBAL_BATCH
    if peer == "serial":
        yield lambda: (make_batch(source, number) for number in range(batches))
    elif peer == "process":
        with process_feeder(source, device) as feeder:
            yield lambda: iter(feeder)
    elif peer == "pydataset":
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        dataset = pydataset_class()(source, workers=WORKERS, use_multiprocessing=True)
        adapter = PyDatasetAdapter(dataset, shuffle=False)
        tf_dataset = adapter.get_tf_dataset()

        def pydataset_epoch():
            adapter.on_epoch_begin()
            try:
                yield from tf_dataset
            finally:
                adapter.on_epoch_end()

        yield pydataset_epoch
    elif peer == "tfdata":
        dataset = (
            tf.data.Dataset.from_generator(
                lambda: (source[index] for index in range(len(source))),
                output_signature=(
                    tf.TensorSpec(SAMPLE_SHAPE, tf.float32),
                    tf.TensorSpec((), tf.int64),
                ),
            )
            .batch(GLOBAL_BATCH)
            .prefetch(tf.data.AUTOTUNE)
        )
        yield lambda: iter(dataset)
    elif peer == "grain":
        dataset = grain_dataset(source)

        def grain_epoch():
            iterator = iter(dataset)
            try:
                yield from iterator
            finally:
                iterator.close()

        yield grain_epoch
    else:
        raise ValueError(peer)


def epoch_times(peer: str, source, device: str) -> tuple[dict, float]:
    """`EPOCHS` whole epochs of a fresh `peer`, back to back: the seconds from building it to
    its first batch and to the end of each epoch (each from the end of the one before), and
    the cores other processes used meanwhile."""
    expected = len(source) // GLOBAL_BATCH
    with harness.OtherLoad() as other:
        started = time.perf_counter()
        with epoch_peer(peer, source, device) as next_epoch:
            times, first, mark = {}, None, started
            for epoch in range(1, EPOCHS + 1):
                taken = 0
                for batch in next_epoch():
                    if first is None:
                        first = time.perf_counter() - started
                    taken += 1
                    del batch
                now = time.perf_counter()
                if taken != expected:
                    raise RuntimeError(f"{peer}: epoch {epoch} gave {taken}, not {expected}")
                times[f"epoch{epoch}_s"] = now - mark
                mark = now
    return {"first_batch_s": first, **times}, other.cores


def epoch_case(report, settings, source, device, batches: int) -> None:
    epoch_source = copy.copy(source)  # the same calibrated work per sample, fewer samples
    epoch_source.length = batches * GLOBAL_BATCH
    rows = []
    for rep in range(settings.reps):
        measured, other_cores = {}, []
        for peer in harness.rotate(EPOCH_PEERS, rep):
            measured[peer], other = epoch_times(peer, epoch_source, device)
            other_cores.append(other)
            gc.collect()
        row = {}
        for peer in EPOCH_PEERS:
            row.update({f"{peer}_{key}": value for key, value in measured[peer].items()})
        for peer in EPOCH_PEERS:
            if peer != "process":
                for epoch in range(1, EPOCHS + 1):
                    key = f"epoch{epoch}_s"
                    row[f"process_over_{peer}_epoch{epoch}"] = (
                        measured[peer][key] / measured["process"][key]
                    )
        row["other_cores"] = max(other_cores)
        rows.append(row)
        print(
            f"  whole epochs rep {rep + 1}/{settings.reps}: "
            + "  ".join(
                f"{peer} {measured[peer]['first_batch_s']:.2f} + "
                + "/".join(f"{measured[peer][f'epoch{e}_s']:.2f}" for e in range(1, EPOCHS + 1))
                + " s"
                for peer in EPOCH_PEERS
            )
            + f"  (other processes: up to {row['other_cores']:.2f} core)",
            flush=True,
        )
    report.add_case(
        "whole epochs",
        {
            "source": epoch_source.as_dict(),
            "peers": {peer: PEER_NAMES[peer] for peer in EPOCH_PEERS},
            "global_batch": GLOBAL_BATCH,
            "workers": WORKERS,
            "batches_per_epoch": batches,
            "epochs": EPOCHS,
        },
        rows,
        units={key: "s" for key in rows[0] if key.endswith("_s")},
    )


# ---- case 3: interference --------------------------------------------------------------------


def step_durations(step, count: int, batches: Iterator | None = None) -> list[float]:
    """The durations of `count` step calls; with `batches`, one batch is taken before each
    step (and held through it, as a training step holds its input), outside the timing."""
    durations = []
    batch = None
    for _ in range(count):
        if batches is not None:
            batch = next(batches)
        started = time.perf_counter()
        step()
        durations.append(time.perf_counter() - started)
    del batch
    return durations


def process_feeder(source, device: str):
    """A feeder over `source` with `WORKERS` worker processes, one global batch per step."""
    import feedpipe as fp

    return fp.Feeder(
        source,
        global_batch_size=GLOBAL_BATCH,
        devices=[device],
        workers=WORKERS,
        worker_mode="process",
    )


def fed_step_durations(step, source, device: str, warmup: int, count: int) -> tuple:
    """Step durations while 2 worker processes produce, the input-bound fraction, and the
    cores other processes used meanwhile."""

    with process_feeder(source, device) as feeder:
        batches = harness.endless(feeder)
        step_durations(step, warmup, batches)
        before = feeder.stats()
        with harness.OtherLoad() as other:
            durations = step_durations(step, count, batches)
        after = feeder.stats()
    wall = after.wall_s - before.wall_s
    waited = after.consumer_wait_s - before.consumer_wait_s
    return durations, waited / wall if wall > 0 else 0.0, other.cores


def interference_case(report, settings, source, device, step_s, warmup, count) -> None:
    step = harness.EmulatedStep(step_s)
    rows = []
    for rep in range(settings.reps):
        measured: dict = {}
        for peer in harness.rotate(["alone", "fed"], rep):
            step.reset()
            if peer == "alone":
                step_durations(step, warmup)
                with harness.OtherLoad() as other:
                    measured["alone"] = step_durations(step, count)
                measured["alone_other"] = other.cores
            else:
                measured["fed"], measured["input_bound"], measured["fed_other"] = (
                    fed_step_durations(step, source, device, warmup, count)
                )
            gc.collect()
        alone, fed = measured["alone"], measured["fed"]
        row = {
            "step_ratio": statistics.fmean(fed) / statistics.fmean(alone),
            "p50_ratio": harness.percentile(fed, 50) / harness.percentile(alone, 50),
            "p99_ratio": harness.percentile(fed, 99) / harness.percentile(alone, 99),
            "alone_step_ms": statistics.fmean(alone) * 1e3,
            "fed_step_ms": statistics.fmean(fed) * 1e3,
            "alone_p99_ms": harness.percentile(alone, 99) * 1e3,
            "fed_p99_ms": harness.percentile(fed, 99) * 1e3,
            "fed_input_bound": measured["input_bound"],
            "other_cores": max(measured["alone_other"], measured["fed_other"]),
        }
        rows.append(row)
        print(
            f"  interference rep {rep + 1}/{settings.reps}: step alone "
            f"{row['alone_step_ms']:.3f} ms, with workers {row['fed_step_ms']:.3f} ms "
            f"(ratio {row['step_ratio']:.4f}; other processes: up to "
            f"{row['other_cores']:.2f} core)",
            flush=True,
        )
    name = "interference"
    report.add_case(
        name,
        {
            "source": source.as_dict(),
            "step": step.as_dict(),
            "workers": WORKERS,
            "worker_mode": "process",
            "warmup_steps": warmup,
            "steps": count,
        },
        rows,
        units={k: "ms" for k in rows[0] if k.endswith("_ms")},
    )
    report.target(name, "step_ratio", "<=", 1.03, "mean step with workers / alone")


# ---- case 4: steady-state memory -------------------------------------------------------------


def held_memory(source, device: str, warmup: int, count: int) -> dict:
    """A fresh feeder with 2 worker processes, each batch held until the next is taken: the
    stats before and after the measured window, the pool's size, and the peak RSS."""

    with process_feeder(source, device) as feeder:
        batches = harness.endless(feeder)
        batch = None
        for _ in range(warmup):
            batch = next(batches)
        before = feeder.stats()
        peak = rss_bytes()
        for _ in range(count):
            new = next(batches)
            peak = max(peak, rss_bytes())
            batch = new
            del new
            peak = max(peak, rss_bytes())
        after = feeder.stats()
        del batch
        pool = feeder._assembly.pools[False]
        return {
            "before": before,
            "after": after,
            "slot_bytes": pool.layout.nbytes,
            "slots": pool.capacity,
            "peak_rss": peak,
        }


def memory_case(report, settings, source, device, warmup, count) -> None:
    rows = []
    slot_bytes = slots = bound = None
    for rep in range(settings.reps):
        gc.collect()
        baseline = rss_bytes()
        seen = held_memory(source, device, warmup, count)
        before, after, peak = seen["before"], seen["after"], seen["peak_rss"]
        slot_bytes, slots = seen["slot_bytes"], seen["slots"]
        bound = slots * BATCH_BYTES + SLACK_BYTES
        held = after.slots_allocated * slot_bytes
        row = {
            "allocations": after.slots_allocated - before.slots_allocated,
            "overflow_in_window": after.overflow_slots - before.overflow_slots,
            "slots_allocated": after.slots_allocated,
            "overflow_slots": after.overflow_slots,
            "slot_held_bytes": held,
            "peak_rss_growth_bytes": peak - baseline,
            "slot_held_over_bound": held / bound,
            "rss_over_bound": (peak - baseline) / bound,
        }
        rows.append(row)
        print(
            f"  memory rep {rep + 1}/{settings.reps}: {row['allocations']} slots allocated in "
            f"the window, {after.slots_allocated} in all ({after.overflow_slots} overflow) of "
            f"{slots} ({held / 2**20:.1f} MiB); peak RSS growth "
            f"{row['peak_rss_growth_bytes'] / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB",
            flush=True,
        )
    name = "steady-state memory"
    report.add_case(
        name,
        {
            "workers": WORKERS,
            "worker_mode": "process",
            "batch_bytes": BATCH_BYTES,
            "slot_bytes": slot_bytes,
            "slots": slots,
            "bound_bytes": bound,
            "bound": "slots x batch bytes + 16 MB",
            "warmup_batches": warmup,
            "batches": count,
        },
        rows,
        units={k: "bytes" for k in rows[0] if k.endswith("_bytes")},
    )
    report.target(name, "allocations", "<=", 0, "slots allocated in steady state")
    report.target(name, "slot_held_over_bound", "<=", 1.0, "slot bytes held / bound")
    report.target(name, "rss_over_bound", "<=", 1.0, "peak RSS growth / bound")
    worst = max(row["allocations"] for row in rows)
    report.note(
        f"steady-state memory: at most {worst} slot(s) allocated in one repetition's window "
        "(the target is on the median). The slots are shared memory that the workers write: "
        "the main process's RSS counts only the pages it touches itself."
    )


# ---- main ------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sample-ms", type=float, default=1.0, help="Python work per sample (default 1)"
    )
    parser.add_argument(
        "--step-ms", type=float, default=20.0, help="interference: emulated step (default 20)"
    )
    parser.add_argument(
        "--epoch-batches",
        type=int,
        default=None,
        help="whole epochs: batches per epoch (default 60; 30 with --quick)",
    )


def main(argv=None) -> None:
    rerun_with_mmap_threshold("kernels_bench.workers", argv)

    settings = harness.parse_settings(__doc__, add_args, argv)
    (device,) = harness.configure_tf(1)
    import feedpipe as fp

    report = harness.Report(
        "workers",
        "samples/s of GIL-bound Python code: feedpipe worker processes vs serial and peers",
        settings,
        "kernels_bench.workers",
    )
    sample_s = settings.args.sample_ms / 1000
    warmup, count = settings.pick((6, 20), (8, 48))
    gil = GilSource(LENGTH, sample_s)
    gil_free = GilFreeSource(LENGTH, sample_s)
    print(
        f"per sample: GIL-bound {gil.calibrated_s * 1e3:.3f} ms ({gil.iterations} iterations), "
        f"GIL-releasing {gil_free.calibrated_s * 1e3:.3f} ms (sha256 of {gil_free.nbytes:,} "
        "bytes)",
        flush=True,
    )

    # First use of TensorFlow's eager placement happens here, not inside a measurement.
    with fp.Feeder(make_batch(gil, 0), 16, devices=[device]) as warm:
        for _ in warm:
            pass

    case = "GIL-bound"
    bound_rows = throughput_case(report, settings, case, gil, GIL_PEERS, device, warmup, count)
    report.target(case, "process_over_serial", ">=", 1.8, "processes / serial")
    report.target(case, "process_over_pydataset", ">=", 1.3, "processes / Keras PyDataset")
    report.target(case, "process_over_tfdata", ">=", 2.5, "processes / tf.data from_generator")

    free_rows = throughput_case(
        report, settings, "GIL-releasing", gil_free, GIL_FREE_PEERS, device, warmup, count
    )
    report.add_case(
        "thread vs process",
        {"ratio": "process samples/s / thread samples/s, same repetition", "workers": WORKERS},
        [
            {
                "gil_bound_process_over_thread": bound["process_over_thread"],
                "gil_releasing_process_over_thread": free["process_over_thread"],
            }
            for bound, free in zip(bound_rows, free_rows, strict=True)
        ],
    )
    report.note(
        "thread vs process (no target): process/thread = "
        f"{report.median('thread vs process', 'gil_bound_process_over_thread'):.2f} on the "
        "GIL-bound source, "
        f"{report.median('thread vs process', 'gil_releasing_process_over_thread'):.2f} on the "
        "GIL-releasing one; above 1, processes produce faster."
    )

    epoch_case(report, settings, gil, device, settings.args.epoch_batches or settings.pick(30, 60))
    interference_case(
        report,
        settings,
        gil,
        device,
        settings.args.step_ms / 1000,
        10,
        settings.pick(60, 150),
    )
    memory_case(report, settings, gil, device, warmup, settings.pick(24, 40))

    report.note(
        "samples/s: batches taken back to back after warm-up (worker start-up untimed), each "
        "peer from sample 0; ratios within each repetition, peers in rotating order. "
        "other_cores: the most CPU (in cores) that other processes on the machine used during "
        "one of the repetition's timed windows; a repetition with more than ~0.1 did not "
        "measure the peers alone."
    )
    report.finish(
        columns=[
            "process_over_serial",
            "process_over_bare",
            "bare_over_serial",
            "process_over_pydataset",
            "process_over_tfdata",
            "process_over_grain",
            "grain_over_serial",
            "process_over_thread",
            "thread_over_serial",
            "gil_bound_process_over_thread",
            "gil_releasing_process_over_thread",
            "process_first_batch_s",
            "grain_first_batch_s",
            "process_over_serial_epoch1",
            "process_over_pydataset_epoch1",
            "process_over_tfdata_epoch1",
            "process_over_grain_epoch1",
            "process_over_grain_epoch2",
            "step_ratio",
            "p99_ratio",
            "allocations",
            "slot_held_over_bound",
            "rss_over_bound",
            "other_cores",
        ]
    )


if __name__ == "__main__":
    main()
