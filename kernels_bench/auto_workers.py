"""Does `workers="auto"` make samples as fast as the best fixed setting a sweep finds?

PyDataset, DataLoader and Grain make users guess the count and kind of their workers. A feeder
built with `workers="auto"` measures what a sample costs while it makes the first batches, and
tries the settings `feedpipe.core.cost` ranks first (`feedpipe.core.auto`).
Here it is held against every setting a user could guess, on the four kinds of source in
`kernels_bench.gil_source.KINDS` (waiting, GIL-bound Python, GIL-free numpy, mixed):

* the sweep: `workers=0`, and 1, 2, 4, 8 and 16 workers, as threads and as processes;
* `workers="auto"`, and the setting it picked.

Each is a feeder built fresh over the same source (`--length` samples of about `--sample-ms`,
global batch 64, JAX's first CPU device), read with no step (the producer is the bottleneck:
what a setting can make). The first epoch is timed from the call that builds the feeder, so its
start-up counts (spawning processes; for "auto", its trials). The steady state is the next
epoch once the setting is settled: a fixed one's second epoch; "auto" reads epochs until it has
picked (`auto_epochs_to_settle`, `auto_settle_s` from building it; at most 10), then one more.
Settings run in rotating order in each repetition. Ratios within a
repetition, then medians: `auto_over_best_steady` is auto's steady samples/s over the best of
the sweep's in that repetition (`_first` likewise for the first epoch), and
`auto_over_workers0_*` over `workers=0`'s.

Targets, for every kind: `auto_over_best_steady` >= 0.9, and auto never below `workers=0`
(`auto_over_workers0_steady` and `auto_over_workers0_first` >= 1.0).

Run: `KERAS_BACKEND=jax python -m kernels_bench.auto_workers [--quick]`; writes
`kernels_bench/results/auto_workers.json`.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

from kernels_bench import harness
from kernels_bench.gil_source import KINDS

SWEEP = [("thread", 0)] + [(mode, n) for mode in ("thread", "process") for n in (1, 2, 4, 8, 16)]
BATCH = 64
MAX_EPOCHS = 10
"""Epochs "auto" may take to settle before its steady state is timed anyway."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=4096, help="samples an epoch")
    parser.add_argument("--sample-ms", type=float, default=0.5, help="cost of a sample")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))


def label(mode: str, workers: int | str) -> str:
    return "auto" if workers == "auto" else ("workers0" if workers == 0 else f"{mode}{workers}")


def epochs(source, mode: str, workers: int | str) -> dict:
    """Samples/s of the first epoch (from building the feeder) and of the steady state: the
    next epoch once the setting is settled (a fixed one at once; "auto" once it has picked, at
    most `MAX_EPOCHS` in, and how long that took)."""
    import jax

    import feedpipe as fp

    started = time.perf_counter()
    with fp.Feeder(
        source, BATCH, devices=jax.devices()[:1], workers=workers, worker_mode=mode
    ) as feeder:
        built = time.perf_counter()
        read = 0
        while True:
            for _ in feeder:
                pass
            read += 1
            if read == 1:
                first = time.perf_counter()
            picked = feeder.stats().workers_picked
            if picked is None or "still measuring" not in picked or read == MAX_EPOCHS:
                break
        settled = time.perf_counter()
        for _ in feeder:
            pass
        steady = time.perf_counter() - settled
        described = feeder.describe()
    samples = len(source)
    return {
        "first": samples / (first - started),
        "steady": samples / steady,
        "build_s": built - started,
        "settle_s": settled - started,
        "epochs_to_settle": read,
        "picked": label(described.worker_mode, described.workers),
    }


def main(argv=None) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    report = harness.Report(
        "auto_workers",
        'samples/s of workers="auto" against every fixed setting of a sweep (0; 1 to 16 '
        "threads or processes), on four kinds of source, first epoch and steady state",
        settings,
        "kernels_bench.auto_workers",
    )
    runs = [*SWEEP, ("thread", "auto")]
    for kind in args.kinds:
        source = KINDS[kind](args.length, args.sample_ms / 1e3)
        epochs(source, "thread", 0)  # untimed: first imports, the file cache
        reps = []
        for rep in range(settings.reps):
            values, picked = {}, None
            with harness.OtherLoad() as other:
                for mode, workers in harness.rotate(runs, rep):
                    measured = epochs(source, mode, workers)
                    name = label(mode, workers)
                    values[f"{name}_steady"] = measured["steady"]
                    values[f"{name}_first"] = measured["first"]
                    if workers == "auto":
                        values["auto_build_s"] = measured["build_s"]
                        values["auto_settle_s"] = measured["settle_s"]
                        values["auto_epochs_to_settle"] = measured["epochs_to_settle"]
                        picked = measured["picked"]
                    gc.collect()
            for when in ("steady", "first"):
                best = max(values[f"{label(m, n)}_{when}"] for m, n in SWEEP)
                values[f"auto_over_best_{when}"] = values[f"auto_{when}"] / best
                values[f"auto_over_workers0_{when}"] = (
                    values[f"auto_{when}"] / values[f"workers0_{when}"]
                )
            values["other_cores"] = other.cores
            best_steady = max(SWEEP, key=lambda s: values[f"{label(*s)}_steady"])
            reps.append(values | {"picked": picked, "best_steady": label(*best_steady)})
            print(
                f"  {kind} rep {rep + 1}/{settings.reps}: auto picked {picked}, "
                f"{values['auto_steady']:,.0f} samples/s steady "
                f"({values['auto_over_best_steady']:.2f} of the best, {label(*best_steady)}), "
                "first epoch "
                f"{values['auto_over_best_first']:.2f} of the best; other processes "
                f"{other.cores:.2f} core",
                flush=True,
            )
        case = f"{kind}: {source.kind}"
        numeric = [{k: v for k, v in r.items() if not isinstance(v, str)} for r in reps]
        report.add_case(
            case,
            {
                "source": source.as_dict(),
                "global_batch": BATCH,
                "sweep": [label(*s) for s in SWEEP],
                "cores": len(os.sched_getaffinity(0)),
            },
            numeric,
            units={k: "samples/s" for k in numeric[0] if k.endswith(("_steady", "_first"))}
            | {"auto_build_s": "s", "auto_settle_s": "s"},
            extra={
                "picked": [r["picked"] for r in reps],
                "best_steady": [r["best_steady"] for r in reps],
            },
        )
        report.target(case, "auto_over_best_steady", ">=", 0.9, f"{kind}: auto / best, steady")
        for when in ("steady", "first"):
            report.target(
                case, f"auto_over_workers0_{when}", ">=", 1.0, f"{kind}: auto / workers=0, {when}"
            )
    report.finish(
        columns=[
            "auto_steady",
            "auto_over_best_steady",
            "auto_over_best_first",
            "auto_over_workers0_steady",
            "auto_over_workers0_first",
            "auto_settle_s",
            "auto_epochs_to_settle",
        ]
    )


if __name__ == "__main__":
    main()
