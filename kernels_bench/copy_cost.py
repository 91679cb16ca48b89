"""How much CPU and host memory does the feeder spend per global batch, against a plain memcpy?

* Copy amplification = the feeder's CPU-seconds per global batch ÷ (batch bytes / memcpy
  bandwidth), the bandwidth measured in the same repetition as the CPU time of `np.copyto` of
  one batch's bytes out of the same (larger than cache) dataset into `depth + 2` rotating
  buffers (the feeder writes into `depth + 2` rotating slots; one reused buffer would stay in
  cache). 1.0 means the feeder costs exactly one copy of the batch; the feeder's one copy is
  the gather into its host slot (staging onto a CPU device is zero-copy). The feeder's CPU is
  that of its background thread (its own CPU clock) plus the consumer thread's time inside
  `next()` and in freeing the batch it drops. Target: <= 2.0 for batches of 1 MB and more.
* Beside it, the bare numpy gather of the same rows (`np.take` into preallocated arrays, in
  order or random), the least any feeder must spend: `gather_amplification` is its CPU over
  memcpy's, and `over_gather_us` what the feeder spends per batch beyond it (its fixed cost).
* Beside them, a bare prefetch thread (`BarePrefetch`): the same gather into `depth + 2`
  rotating buffers, handed over through a `queue.Queue(depth)`, taken flat out, with no
  staging and no bookkeeping. `bare_amplification` is its two threads' CPU over memcpy's: the
  least a threaded prefetcher spends here, the gather plus one cross-thread wake-up per batch
  (a starving consumer sleeps, and waking it is a system call). `feeder_over_bare` is the
  feeder's CPU per batch over it.
* Peak host bytes held = peak RSS while iterating minus the RSS before the feeder was built,
  with the consumer holding each batch until it takes the next (as a training loop does).
  Target: <= (depth + 2) x batch bytes + 16 MB, reported as `held_over_bound` <= 1. The slot
  pool's own count (`SlotPool.allocated x layout.nbytes`) is reported beside it.

Samples are 1024 float32 features and an int32 label (4100 bytes), 2 logical CPU devices,
depth 2, global batches of 1, 4, 16 and 64 MB, each read in order (`shuffle=False`, the
feeder's default) and shuffled (`shuffle=True`: a gather of random rows, which costs more than
a memcpy by itself). The consumer takes batches as fast as it can: the feeder runs flat out.

To make RSS track frees, the script re-executes itself with `MALLOC_MMAP_THRESHOLD_=131072`
(glibc then maps every large buffer on its own and unmaps it when freed, instead of keeping
freed memory in its heap).

Run: `python -m kernels_bench.copy_cost [--quick]`; writes `kernels_bench/results/copy_cost.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

from kernels_bench import harness

FEATURES = 1024
ROW_BYTES = FEATURES * 4 + 4
DEPTH = 2
SLACK_BYTES = 16 * 2**20
MMAP_THRESHOLD = "131072"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slot_buffers(nbytes: int) -> list[np.ndarray]:
    """As many buffers of `nbytes` as the feeder has host slots (`DEPTH + 2`), each touched
    once: the destinations `memcpy_s` rotates over."""
    return [np.ones(nbytes, np.uint8) for _ in range(DEPTH + 2)]


def memcpy_s(flat: np.ndarray, dsts: list[np.ndarray], copies: int, start: int) -> float:
    """Median CPU seconds of `np.copyto` of one batch's bytes from rotating offsets of `flat`.

    The destinations rotate over as many buffers as the feeder has slots, as the feeder's
    writes do (one reused buffer would stay in cache and flatter the copy). CPU time
    (`time.thread_time`), like the feeder's figure, so that time spent descheduled by other
    work on the machine counts in neither.
    """
    n = dsts[0].nbytes
    span = len(flat) - n
    times = []
    for k in range(copies):
        offset = ((start + k) * n) % span
        offset -= offset % 64
        dst = dsts[k % len(dsts)]
        started = time.thread_time()
        np.copyto(dst, flat[offset : offset + n])
        times.append(time.thread_time() - started)
    return statistics.median(times)


def batch_rows(n: int, rows: int, shuffle: bool, seed: int) -> Iterator[np.ndarray]:
    """The rows of each batch in turn: random, or consecutive blocks (the feeder's order)."""
    rng = np.random.default_rng(seed)
    for k in itertools.count():
        if shuffle:
            yield rng.integers(0, n, rows)
        else:
            first = (k * rows) % (n - rows)
            yield np.arange(first, first + rows)


def gather(x: np.ndarray, y: np.ndarray, index: np.ndarray, out: tuple) -> None:
    """The rows `index` of both fields into `out`, one `np.take` each (as the feeder's)."""
    np.take(x, index, axis=0, out=out[0], mode="clip")
    np.take(y, index, axis=0, out=out[1], mode="clip")


def gather_s(
    x: np.ndarray,
    y: np.ndarray,
    outs: list[tuple[np.ndarray, np.ndarray]],
    copies: int,
    shuffle: bool,
    seed: int,
) -> float:
    """Median CPU seconds of the numpy gather one batch needs (`np.take` of its rows of both
    fields, in order or random, into rotating destinations): the least any feeder of this
    batch must spend."""
    indices = batch_rows(len(y), len(outs[0][1]), shuffle, seed)
    times = []
    for k, index in zip(range(copies), indices, strict=False):
        started = time.thread_time()
        gather(x, y, index, outs[k % len(outs)])
        times.append(time.thread_time() - started)
    return statistics.median(times)


class BarePrefetch:
    """A thread gathering each batch's rows (`np.take`, as `gather_s`) into `depth + 2`
    rotating buffers and putting them in a `queue.Queue(depth)`: the least a threaded
    prefetcher spends per batch."""

    def __init__(self, x, y, global_batch: int, shuffle: bool, seed: int):
        self.queue: queue.Queue = queue.Queue(DEPTH)
        self.stop = threading.Event()
        outs = [
            (np.ones((global_batch, x.shape[1]), x.dtype), np.ones(global_batch, y.dtype))
            for _ in range(DEPTH + 2)
        ]
        self.thread = threading.Thread(
            target=self._run, args=(x, y, outs, shuffle, seed), name="bare-prefetch", daemon=True
        )
        self.thread.start()

    def _run(self, x, y, outs, shuffle: bool, seed: int) -> None:
        indices = batch_rows(len(y), len(outs[0][1]), shuffle, seed)
        for k, index in enumerate(indices):
            out_x, out_y = outs[k % len(outs)]
            gather(x, y, index, (out_x, out_y))
            while not self.stop.is_set():
                with contextlib.suppress(queue.Full):
                    self.queue.put((out_x, out_y), timeout=0.05)
                    break
            if self.stop.is_set():
                return

    def batches(self):
        while True:
            yield self.queue.get()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def bare_prefetch_cpu(x, y, global_batch: int, shuffle: bool, seed: int, count: int) -> float:
    """CPU seconds per batch of `BarePrefetch`'s thread and its consumer, taken flat out."""
    bare = BarePrefetch(x, y, global_batch, shuffle, seed)
    try:
        cpu = feeder_cpu(bare.batches(), harness.cpu_clock(bare.thread.ident), count)
    finally:
        bare.close()
    return cpu["producer_s"] + cpu["consumer_s"]


def feeder_cpu(batches, producer_clock, count: int) -> dict:
    """CPU of the producer thread and of the consumer thread over `count` batches taken and
    dropped at once, with the wall time and the whole process's CPU for comparison.

    The batches staged while other peers ran are taken first, untimed: from then on the
    producer makes each batch just before it is taken, so the producer's clock between two
    takes `count` apart covers `count` batches of its work.
    """
    for _ in range(DEPTH + 3):
        batch = next(batches)
        del batch
    wall0, proc0 = time.perf_counter(), time.process_time()
    prod0, cons0 = producer_clock(), time.thread_time()
    for _ in range(count):
        batch = next(batches)
        del batch
    cons1, prod1 = time.thread_time(), producer_clock()
    wall1, proc1 = time.perf_counter(), time.process_time()
    return {
        "producer_s": (prod1 - prod0) / count,
        "consumer_s": (cons1 - cons0) / count,
        "process_s": (proc1 - proc0) / count,
        "wall_s": (wall1 - wall0) / count,
    }


def peak_rss(batches, count: int) -> int:
    """Peak RSS over `count` batches, each held until the next one has been taken."""
    peak = rss_bytes()
    batch = next(batches)
    for _ in range(count):
        new = next(batches)
        peak = max(peak, rss_bytes())
        batch = new
        del new
        peak = max(peak, rss_bytes())
    del batch
    return peak


def measure_size(
    report, settings, devices, x, y, size_mb: float, shuffle: bool, work_bytes: int
) -> None:
    """One case: a feeder of `size_mb` batches, against memcpy and the bare gather."""
    import feedpipe as fp

    flat = x.reshape(-1).view(np.uint8)
    global_batch = int(size_mb * 2**20) // (FEATURES * 4)
    global_batch -= global_batch % len(devices)
    batch_bytes = global_batch * ROW_BYTES
    count = int(min(max(work_bytes // batch_bytes, 20), 1000))
    copies = max(5, min(count, 200))
    dsts = slot_buffers(batch_bytes)
    outs = [
        (np.ones((global_batch, FEATURES), np.float32), np.ones(global_batch, np.int32))
        for _ in range(DEPTH + 2)
    ]
    gc.collect()
    baseline = rss_bytes()
    feeder = fp.Feeder(
        (x, y), global_batch, devices=devices, depth=DEPTH, shuffle=shuffle, seed=settings.seed
    )
    rows = []
    try:
        batches = harness.endless(feeder)
        for _ in range(DEPTH + 4):  # every slot allocated and touched once
            next(batches)
        producer_clock = harness.cpu_clock(feeder._assembly.pipeline.thread.ident)
        pool = feeder._assembly.pools[False]
        for rep in range(settings.reps):
            row: dict = {}
            for what in harness.rotate(["memcpy", "gather", "bare", "feeder", "memory"], rep):
                if what == "bare":
                    row["bare_s"] = bare_prefetch_cpu(
                        x, y, global_batch, shuffle, settings.seed + rep, count
                    )
                elif what == "memcpy":
                    row["memcpy_s"] = memcpy_s(flat, dsts, copies, rep)
                elif what == "gather":
                    row["gather_s"] = gather_s(x, y, outs, copies, shuffle, settings.seed + rep)
                elif what == "feeder":
                    cpu = feeder_cpu(batches, producer_clock, count)
                    row.update(
                        {
                            f"{k.removesuffix('_s')}_cpu_s": v
                            for k, v in cpu.items()
                            if k != "wall_s"
                        }
                    )
                    row["wall_s"] = cpu["wall_s"]
                else:
                    row["peak_held_bytes"] = peak_rss(batches, DEPTH + 6) - baseline
            feeder_s = row["producer_cpu_s"] + row["consumer_cpu_s"]
            bound = (DEPTH + 2) * batch_bytes + SLACK_BYTES
            row.update(
                copy_amplification=feeder_s / row["memcpy_s"],
                process_amplification=row["process_cpu_s"] / row["memcpy_s"],
                gather_amplification=row["gather_s"] / row["memcpy_s"],
                bare_amplification=row["bare_s"] / row["memcpy_s"],
                feeder_over_bare=feeder_s / row["bare_s"],
                over_gather_us=(feeder_s - row["gather_s"]) * 1e6,
                memcpy_gb_s=batch_bytes / row["memcpy_s"] / 1e9,
                feeder_gb_s=batch_bytes / row["wall_s"] / 1e9,
                held_over_bound=row["peak_held_bytes"] / bound,
                held_over_depth_batches=row["peak_held_bytes"] / (DEPTH * batch_bytes),
                pool_bytes=(pool.allocated + pool.overflow_allocations) * pool.layout.nbytes,
            )
            rows.append(row)
            print(
                f"  {size_mb:g} MB {'shuffled' if shuffle else 'in order'} rep "
                f"{rep + 1}/{settings.reps}: copy amplification "
                f"{row['copy_amplification']:.2f} (feeder {feeder_s * 1e3:.3f} ms, gather "
                f"{row['gather_s'] * 1e3:.3f} ms, bare prefetch {row['bare_s'] * 1e3:.3f} ms, "
                f"memcpy {row['memcpy_s'] * 1e3:.3f} ms of "
                f"CPU); held {row['peak_held_bytes'] / 2**20:.1f} MiB",
                flush=True,
            )
    finally:
        feeder.close()
    case = f"{size_mb:g} MB, {'shuffled' if shuffle else 'in order'}"
    report.add_case(
        case,
        {
            "batch_mb": size_mb,
            "shuffle": shuffle,
            "global_batch": global_batch,
            "batch_bytes": batch_bytes,
            "slot_bytes": pool.layout.nbytes,
            "slots": pool.capacity,
            "depth": DEPTH,
            "replicas": len(devices),
            "batches_per_rep": count,
            "copies_per_rep": copies,
            "dataset_rows": len(y),
            "bound_bytes": (DEPTH + 2) * batch_bytes + SLACK_BYTES,
        },
        rows,
        extra={"overflow_slots": pool.overflow_allocations},
    )
    report.target(case, "copy_amplification", "<=", 2.0, "copy amplification")
    report.target(case, "held_over_bound", "<=", 1.0, "peak held / ((depth + 2) x batch + 16 MB)")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-mb", default="1,4,16,64", help="global batch sizes in MiB")


def rerun_with_mmap_threshold(module: str, argv) -> None:
    """Re-executes `python -m module` with `MALLOC_MMAP_THRESHOLD_` set (once), so that freed
    buffers leave the RSS the script measures; returns where it is already set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        args = list(sys.argv[1:] if argv is None else argv)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


def main(argv=None) -> None:
    rerun_with_mmap_threshold("kernels_bench.copy_cost", argv)

    settings = harness.parse_settings(__doc__, add_args, argv)
    devices = harness.configure_tf(2)
    import feedpipe as fp

    report = harness.Report(
        "copy_cost",
        "feeder CPU per batch vs memcpy, and host bytes held",
        settings,
        "kernels_bench.copy_cost",
    )
    sizes_mb = [float(v) for v in settings.args.batch_mb.split(",")]
    work_bytes = settings.pick(512, 2048) * 2**20
    dataset_rows = 65536  # 256 MiB of features: larger than any cache, 4+ batches of 64 MB

    x = np.empty((dataset_rows, FEATURES), np.float32)
    x[:] = np.arange(FEATURES, dtype=np.float32)
    y = np.arange(dataset_rows, dtype=np.int32)

    # First use of TensorFlow's eager placement happens here, not inside a measured baseline.
    with fp.Feeder((x[:64], y[:64]), 16, devices=devices) as warm:
        for _ in warm:
            pass

    for size_mb in sizes_mb:
        for shuffle in (False, True):
            measure_size(report, settings, devices, x, y, size_mb, shuffle, work_bytes)
    report.note(
        "CPU clocks: the producer thread's own clock (pthread_getcpuclockid) and "
        "time.thread_time() in the consumer; process_amplification counts every thread "
        "of the process (TensorFlow's included) over the same batches."
    )
    report.finish(
        columns=[
            "copy_amplification",
            "gather_amplification",
            "bare_amplification",
            "feeder_over_bare",
            "over_gather_us",
            "memcpy_gb_s",
            "feeder_gb_s",
            "held_over_bound",
        ]
    )


if __name__ == "__main__":
    main()
