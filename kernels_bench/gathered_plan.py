"""What does TensorFlow's gathered `as_dataset()` pass spend planning its first batch, as the
epoch grows to 1e9 samples, against planning the whole epoch as it did before?

Over arrays in memory, `as_dataset()` lets tf.data gather each batch's rows; its pass plans
those rows a chunk of steps at a time as tf.data reads them (`Sampler.padded_chunks`, about
`PADDED_CHUNK_ROWS` rows a chunk), so its first batch, at an epoch's start or after a restore,
waits for one chunk. This measures that chunk where the pass computes it, without TensorFlow:
the first chunk of a shuffled epoch of N samples at global batch B (the epoch's order set up
included: a full permutation up to `LAZY_SHUFFLE_ABOVE` samples, the lazy one above it), and a
later chunk of the same epoch alone (the cost of each further chunk). Beside it, the whole
epoch's rows planned at once (`Sampler.padded_rows` to the epoch's end), what each pass
planned before its first batch until now, at 1e6 and 1e7 samples (at 1e9 it would take 8 GB).

Time is `time.perf_counter` around the call; memory is the peak `tracemalloc` sees (numpy's
buffers included) in a second call, so that tracing does not slow the timed one. The label
weights a pass of `(x, y)` adds come on top: 4 bytes a row per label field.

Targets (the issue's): the first chunk at 1e9 samples, B = 4096, in <= 20 ms and <= 16 MB.

Run: `python -m kernels_bench.gathered_plan [--quick] [--batch 4096]`; writes
`kernels_bench/results/gathered_plan.json`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kernels_bench import harness

FIRST_CHUNK_LENGTHS = (10**6, 10**7, 10**8, 10**9)
"""Epoch lengths whose first chunk is measured: both sides of `LAZY_SHUFFLE_ABOVE` (1e7)."""
WHOLE_EPOCH_LENGTHS = (10**6, 10**7)
"""Epoch lengths whose whole plan is measured too; at 1e8 it takes 0.8 GB, at 1e9 8 GB."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4096, help="global batch")


def measured(plan: Callable[[], object]) -> dict:
    """Seconds of one call of `plan`, then the peak bytes of another, traced."""
    _, seconds, peak = harness.timed_then_traced(plan)
    return {"ms": seconds * 1e3, "mb": peak / 1e6}


def first_chunk(length: int, global_batch: int, seed: int = 0) -> dict:
    """The first chunk of a gathered pass over a shuffled epoch of `length` samples: its time
    and peak memory, the epoch's order set up included, and its steps and rows."""
    from feedpipe.core.sampler import Sampler

    sampler = Sampler(length, global_batch, shuffle=True, seed=seed)
    chunk: dict = {}

    def plan() -> None:
        chunk["first"], chunk["rows"], _ = next(sampler.padded_chunks(0, 0))

    cost = measured(plan)
    return {
        "first_chunk_ms": cost["ms"],
        "first_chunk_mb": cost["mb"],
        "chunk_steps": len(chunk["rows"]),
        "chunk_rows": chunk["rows"].size,
        "lazy": sampler.lazy,
    }


def later_chunk(length: int, global_batch: int, seed: int = 0) -> dict:
    """A chunk in the middle of the same epoch, its order already set up: what each chunk
    after the first costs."""
    from feedpipe.core.sampler import PADDED_CHUNK_ROWS, Sampler

    sampler = Sampler(length, global_batch, shuffle=True, seed=seed)
    locate = sampler.locator(0)
    start = len(sampler) // 2
    stop = start + max(1, PADDED_CHUNK_ROWS // global_batch)
    cost = measured(lambda: sampler.padded_rows(0, start, stop, locate=locate))
    return {"later_chunk_ms": cost["ms"], "later_chunk_mb": cost["mb"]}


def whole_epoch(length: int, global_batch: int, seed: int = 0) -> dict:
    """The whole epoch's rows planned at once, as a pass did before its first batch."""
    from feedpipe.core.sampler import Sampler

    sampler = Sampler(length, global_batch, shuffle=True, seed=seed)
    cost = measured(lambda: sampler.padded_rows(0, 0))
    return {"whole_epoch_ms": cost["ms"], "whole_epoch_mb": cost["mb"]}


def case_name(length: int) -> str:
    """ "N=1e9" for a power of ten, else the length."""
    digits = str(length)
    return f"N=1e{len(digits) - 1}" if digits.strip("0") == "1" else f"N={length}"


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    batch = settings.args.batch
    report = harness.Report(
        "gathered_plan",
        "time and memory a gathered as_dataset() pass spends planning its first batch, by epoch "
        "length, against planning the whole epoch at once",
        settings,
        "kernels_bench.gathered_plan",
    )
    first_chunk(FIRST_CHUNK_LENGTHS[0], batch)  # untimed: first imports, numpy's first calls
    for length in FIRST_CHUNK_LENGTHS:
        reps = []
        for rep in range(settings.reps):
            seed = settings.seed + rep
            values = first_chunk(length, batch, seed)
            lazy, rows = values.pop("lazy"), values["chunk_rows"]
            values.update(later_chunk(length, batch, seed))
            if length in WHOLE_EPOCH_LENGTHS:
                values.update(whole_epoch(length, batch, seed))
                values["whole_over_first_ms"] = values["whole_epoch_ms"] / values["first_chunk_ms"]
                values["whole_over_first_mb"] = values["whole_epoch_mb"] / values["first_chunk_mb"]
            reps.append(values)
        params = {"length": length, "global_batch": batch, "lazy": lazy, "chunk_rows": rows}
        units = {key: "ms" for key in reps[0] if key.endswith("_ms")}
        units |= {key: "MB" for key in reps[0] if key.endswith("_mb")}
        units |= {"whole_over_first_ms": "x", "whole_over_first_mb": "x"}
        report.add_case(case_name(length), params, reps, units)
    largest = case_name(FIRST_CHUNK_LENGTHS[-1])
    report.target(largest, "first_chunk_ms", "<=", 20.0, f"first batch planned (ms), B={batch}")
    report.target(largest, "first_chunk_mb", "<=", 16.0, f"first batch planned (MB), B={batch}")
    report.note(
        "At and below LAZY_SHUFFLE_ABOVE (1e7) a shuffled epoch's order is a full permutation, "
        "built at the first chunk of each pass, as the feeder's own path builds it at each "
        "epoch: that, not the chunk, is the first chunk's cost at 1e7 (no target there)."
    )
    report.finish()


if __name__ == "__main__":
    main()
