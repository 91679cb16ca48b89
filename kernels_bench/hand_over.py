"""What does `as_dataset()` cost where it hands the feeder's batches over to tf.data, and where
does that time go?

Sources TensorFlow cannot gather by itself (worker processes, generators, a `transform`) reach
`model.fit` through a dataset made of the feeder's own host batches (`feedpipe.tf.feeder`). Per
global batch of 1, 4 and 16 MB (rows of 1024 float32 features and an int32 label), read from
arrays by 2 worker processes (`workers=2`: the batches are built in slots shared with them) and
by one worker thread (`workers=1, worker_mode="thread"`: slots private to the process), three
ways of taking the same whole passes (8 batches each), flat out, in one repetition:

* `loop`: `for batch in feeder`, the feeder's own path (staged on the CPU device, zero-copy):
  what the source and the feeder cost without tf.data;
* `dataset`: `for batch in feeder.as_dataset()`, eager, each pass a new iterator;
* `floor`: `tf.data.Dataset.from_generator` over batches already made (the same arrays, fresh
  numpy arrays every batch, as a source without the feeder would hand them): what tf.data
  itself costs to take a numpy batch in;
* `bare`: the dataset `as_dataset()` builds (`feedpipe._internals.tf.generator_dataset`) over 8
  batches already made in 64-byte aligned memory and handed over again and again: what the
  hand-over's TensorFlow side costs (a `numpy_function` call and an eager `get_next` per
  batch), without the feeder.

Measured per batch: wall time and this process's CPU (`time.process_time`, every thread; the
worker processes' CPU is theirs and not counted). `hand_over_us` is the dataset's CPU per batch
beyond the loop's: the hand-over's own cost, and `hand_over_us_per_mb` the same per MB of
batch, which a copy would make grow with the batch. Of it, `bare_cpu_us` is TensorFlow's side,
and `feeder_side_us` (the hand-over less `bare`) the feeder's Python per batch on this path.
The figures per batch count the batches after each pass's first; the time from `iter()` to a
pass's first batch (a new iterator, a new pass) is `start_ms`, the median over passes. Beside them,
`overflow` counts the one-off slots the feeder had to allocate because tf.data still held
every pooled one.

Beside them, `memcpy_us_per_mb`: the CPU of one `np.copyto` of the batch's bytes (median of
8, `copy_cost.memcpy_s`: rotating offsets of the data into as many buffers as the feeder has
slots), measured in the same repetition: what one copy of the batch costs on this machine.

Target: `hand_over_us_per_mb` <= `memcpy_us_per_mb` for batches of 4 MB and more, reported as
`hand_over_over_memcpy` <= 1: the hand-over, everything included, costs less than one copy of
the batch would.

Run: `python -m kernels_bench.hand_over [--quick]`; writes `kernels_bench/results/hand_over.json`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from feedpipe._internals.tf import generator_dataset
from feedpipe.core.slots import aligned_buffer
from kernels_bench import harness
from kernels_bench.copy_cost import memcpy_s, slot_buffers

FEATURES = 1024
ROW_BYTES = FEATURES * 4 + 4
SOURCES = {
    "2 worker processes": {"workers": 2},
    "1 worker thread": {"workers": 1, "worker_mode": "thread"},
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-mb", default="1,4,16", help="global batch sizes in MB")


def timed(batches, passes: int) -> tuple[float, float, float]:
    """(median seconds from `iter()` to a pass's first batch; wall and CPU seconds per batch
    after it) over `passes` whole passes of `batches`, a callable that makes a fresh iterable
    (a pass)."""
    starts, wall, cpu, taken = [], 0.0, 0.0, 0
    for _ in range(passes):
        started = time.perf_counter()
        iterator = iter(batches())
        next(iterator)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        starts.append(wall0 - started)
        for _ in iterator:
            taken += 1
        wall += time.perf_counter() - wall0
        cpu += time.process_time() - cpu0
        del iterator
    return statistics.median(starts), wall / taken, cpu / taken


def repetition(fp, tf, x, y, rows: int, options: dict, passes: int, seed: int) -> dict:
    def made_batches():
        for start in range(0, len(x) - rows + 1, rows):
            yield x[start : start + rows].copy(), y[start : start + rows].copy()

    signature = (
        tf.TensorSpec((rows, FEATURES), tf.float32),
        tf.TensorSpec((rows,), tf.int32),
    )
    floor = tf.data.Dataset.from_generator(made_batches, output_signature=signature)
    aligned = []
    for start in range(0, len(x) - rows + 1, rows):
        fields = []
        for array in (x[start : start + rows], y[start : start + rows]):
            out = np.frombuffer(aligned_buffer(array.nbytes), array.dtype).reshape(array.shape)
            out[...] = array
            fields.append(out)
        aligned.append(tuple(fields))
    bare = generator_dataset(lambda: iter(aligned), signature)
    measured = {}
    with fp.Feeder((x, y), rows, shuffle=True, seed=seed, **options) as feeder:
        dataset = feeder.as_dataset()
        peers = {
            "loop": lambda: feeder,
            "dataset": lambda: dataset,
            "floor": lambda: floor,
            "bare": lambda: bare,
        }
        for name in harness.rotate(list(peers), seed):
            gc.collect()
            measured[name] = timed(peers[name], passes)
        overflow = feeder._assembly.pools[True].overflow_allocations
    mb = rows * ROW_BYTES / 2**20
    (_, loop_s, loop_cpu), (start_s, data_s, data_cpu), (floor_start, floor_s, floor_cpu) = (
        measured["loop"],
        measured["dataset"],
        measured["floor"],
    )
    _, _, bare_cpu = measured["bare"]
    # One copy of the batch's bytes, as copy_cost times it.
    buffers = slot_buffers(rows * ROW_BYTES)
    copy_us_per_mb = memcpy_s(x.reshape(-1).view(np.uint8), buffers, 8, seed) * 1e6 / mb
    hand_over_us_per_mb = (data_cpu - loop_cpu) * 1e6 / mb
    return {
        "loop_us": loop_s * 1e6,
        "loop_cpu_us": loop_cpu * 1e6,
        "dataset_us": data_s * 1e6,
        "dataset_cpu_us": data_cpu * 1e6,
        "floor_us": floor_s * 1e6,
        "floor_cpu_us": floor_cpu * 1e6,
        "bare_cpu_us": bare_cpu * 1e6,
        "feeder_side_us": (data_cpu - loop_cpu - bare_cpu) * 1e6,
        "dataset_over_loop": data_s / loop_s,
        "dataset_cpu_over_loop": data_cpu / loop_cpu,
        "hand_over_us": (data_cpu - loop_cpu) * 1e6,
        "hand_over_us_per_mb": hand_over_us_per_mb,
        "memcpy_us_per_mb": copy_us_per_mb,
        "hand_over_over_memcpy": hand_over_us_per_mb / copy_us_per_mb,
        "start_ms": start_s * 1e3,
        "floor_start_ms": floor_start * 1e3,
        "overflow": overflow,
    }


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    harness.configure_tf(1)
    import tensorflow as tf

    import feedpipe as fp

    report = harness.Report(
        "hand_over",
        "as_dataset()'s cost per handed-over batch, beside the feeder's loop and tf.data's own",
        settings,
        "kernels_bench.hand_over",
    )
    sizes_mb = [float(v) for v in settings.args.batch_mb.split(",")]
    passes = settings.pick(4, 12)
    for size_mb in sizes_mb:
        rows = max(1, int(size_mb * 2**20 / ROW_BYTES))
        length = rows * 8
        rng = np.random.default_rng(settings.seed)
        x = rng.random((length, FEATURES), dtype=np.float32)
        y = np.arange(length, dtype=np.int32)
        for source, options in SOURCES.items():
            case = f"{size_mb:g} MB, {source}"
            reps = []
            for rep in range(settings.reps):
                reps.append(repetition(fp, tf, x, y, rows, options, passes, settings.seed + rep))
                print(
                    f"  {case} rep {rep + 1}/{settings.reps}: "
                    + "  ".join(f"{k} {v:.3g}" for k, v in reps[-1].items())
                )
            report.add_case(case, {"batch_mb": size_mb, "rows": rows, **options}, reps)
            report.target(
                case,
                "hand_over_over_memcpy",
                "<=",
                1.0,
                "hand-over CPU per MB / one memcpy's",
                applies=size_mb >= 4,
                why_not="below 4 MB the fixed per-batch costs dominate; reported",
            )
    report.note(
        "CPU: time.process_time of this process (every thread, TensorFlow's included); the "
        "worker processes' own CPU is not counted. Each pass of `dataset` is a new iterator; "
        "its first batch is timed apart (start_ms)."
    )
    report.finish(
        columns=[
            "dataset_cpu_over_loop",
            "hand_over_us",
            "bare_cpu_us",
            "feeder_side_us",
            "hand_over_us_per_mb",
            "memcpy_us_per_mb",
            "floor_cpu_us",
            "loop_cpu_us",
            "start_ms",
            "floor_start_ms",
            "overflow",
        ]
    )


if __name__ == "__main__":
    main()
