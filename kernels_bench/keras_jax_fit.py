"""On CPU JAX, does Keras 3's `model.fit(feeder)` train from a Python source at least as fast as
`fit` on a `PyDataset` with worker processes and on Grain?

The same comparison as `kernels_bench/gpu_fit.py` (`harness.keras_fit.run_fit_comparison`), on
this machine's CPU under `KERAS_BACKEND=jax`, with the workers scaled to the cores:

* the model: a convnet (4 stride-2 3x3 convolutions, 32-256 channels, global pooling, dense 10;
  SGD, sparse cross-entropy from logits) on `--batch` x `--shape` float32 images (64 x 32x32x3);
* the source: a map-style Python object (`harness.images.ImageSource`) whose `__getitem__`
  holds the GIL in a Python loop and builds the image, its cost calibrated, after the step's
  own time on arrays is measured, to `--source-over-step` (2) times that step per batch: run
  serially, the source, not the model, is the bottleneck;
* the peers, each one `fit` of `--epochs` (3) epochs of `--steps` (24) steps, on one model
  (compiled for each input structure before the repetitions), in rotating order in each of
  `--reps` rounds: `fit(x, y)` on the same images in memory (no source cost: the ceiling),
  `fit(feeder, callbacks=[feeder.fit_callback()])` over `fp.Feeder(source, B, workers=W)`,
  `fit(PyDataset)` with `workers=W, use_multiprocessing=True` (each `__getitem__` stacks B
  samples), and Grain (`MapDataset.source(source).batch(B).to_iter_dataset().mp_prefetch(
  MultiprocessingOptions(num_workers=W))`), W = the cores (`os.sched_getaffinity`, 2 here).

Each peer's input is built inside the timed call. Reported apart: the first epoch (from calling
`fit` to its end: the input's start-up included: spawning or forking workers, their first
batches; Grain's first epoch also learns the dataset's length) and the steady state (the epochs
after the first, each with its input's restart as `fit` does it: Keras makes a new Grain
iterator, and so new worker processes, every epoch). Ratios within each round, then medians:
`feedpipe_over_pydataset_<phase>`, `feedpipe_over_grain_<phase>`, `<peer>_over_arrays_<phase>`,
phase `steady` or `epoch1`. Targets (this script's own bar; the issue sets none on CPU):
feedpipe / PyDataset >= 1.0 and feedpipe / Grain >= 1.0 in the steady state. On 2 cores the
model's step and the workers share the CPU, so fit(x, y) is out of reach for every peer; each
round also records `other_cores` (CPU used by other processes on the machine meanwhile).

A second case, a fast source (`--fast-source-over-step`, 0.25 of the step per batch, which the
workers outrun), runs fit(x, y) and fit(feeder) alone, as `gpu_fit.py`'s fast source case does.
Every timed fit(feeder) is a second fit in the process (the warm-up fitted first); target: its
first epoch, start-up included, <= 1.2x fit(x, y)'s (`feedpipe_epoch1_s_over_arrays`, the
issue's target on a GPU). Every session counts the train step's compilations
(`<peer>_compiles`): 0 once the warm-up compiled the step, as on arrays.

Run: `KERAS_BACKEND=jax python -m kernels_bench.keras_jax_fit [--quick]`; writes
`kernels_bench/results/keras_jax_fit.json`. No TensorFlow is imported (checked at the end).
This module, like `gpu_fit.py`, imports only numpy and the standard library at the top:
feedpipe's worker processes unpickle the source from `kernels_bench.harness.images` and never
import a framework.
"""

from __future__ import annotations

import argparse
import os
import sys

from kernels_bench import harness
from kernels_bench.harness.jax_gpu import configure_environment
from kernels_bench.harness.keras_fit import run_fit_comparison, target_second_fit


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--shape", default="32,32,3", help="image shape")
    parser.add_argument("--steps", type=int, default=24, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per session")
    parser.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: the cores)"
    )
    parser.add_argument(
        "--source-over-step",
        type=float,
        default=2.0,
        help="the source's serial CPU per batch over the step's own time on arrays",
    )
    parser.add_argument(
        "--fast-source-over-step",
        type=float,
        default=0.25,
        help="second case (fit(x, y) and fit(feeder) alone): a source the workers outrun; 0: skip",
    )


def main(argv=None) -> None:
    configure_environment()
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = args.workers or cores
    shape = tuple(int(v) for v in args.shape.split(","))
    steps = settings.pick(max(8, args.steps // 2), args.steps)
    report = harness.Report(
        "keras_jax_fit",
        "Keras 3 on CPU JAX from a Python source: fit(feeder) / fit(PyDataset workers) and / "
        "Grain, first epoch and steady state, beside fit(x, y)",
        settings,
        "kernels_bench.keras_jax_fit",
    )
    report.command = "KERAS_BACKEND=jax " + report.command
    case = "keras jax fit, cpu"
    params = run_fit_comparison(
        report,
        settings,
        case=case,
        shape=shape,
        batch=args.batch,
        steps=steps,
        epochs=args.epochs,
        workers=workers,
        sample_s=lambda step_s: args.source_over_step * step_s / args.batch,
    )
    params["cores"] = cores
    for peer in ("pydataset", "grain"):
        if f"feedpipe_over_{peer}_steady" in report.cases[-1]["metrics"]:
            report.target(
                case, f"feedpipe_over_{peer}_steady", ">=", 1.0, f"fit(feeder) / {peer}, steady"
            )
    if args.fast_source_over_step:
        fast = "keras jax fit, fast source, cpu"
        run_fit_comparison(
            report,
            settings,
            case=fast,
            shape=shape,
            batch=args.batch,
            steps=steps,
            epochs=args.epochs,
            workers=workers,
            sample_s=lambda step_s: args.fast_source_over_step * step_s / args.batch,
            peers=["arrays", "feedpipe"],
        )
        target_second_fit(report, fast)
    report.note(
        "Each peer's input is built inside its timed fit call; epoch1 = from calling fit to the "
        "end of its first epoch (start-up included), steady = the epochs after the first. One "
        "model for every peer, compiled for each input structure before the rounds. Ratios "
        "within a round (peers in rotating order), medians over rounds. other_cores: CPU (in "
        "cores) used by other processes on the machine during the round."
    )
    report.note(f"TensorFlow imported during the run: {'tensorflow' in sys.modules}.")
    report.finish(
        columns=[
            "feedpipe_over_pydataset_steady",
            "feedpipe_over_grain_steady",
            "feedpipe_over_arrays_steady",
            "pydataset_over_arrays_steady",
            "grain_over_arrays_steady",
            "feedpipe_over_pydataset_epoch1",
            "feedpipe_over_grain_epoch1",
            "feedpipe_over_arrays_epoch1",
            "feedpipe_epoch1_s_over_arrays",
            "feedpipe_compiles",
            "other_cores",
        ]
    )


if __name__ == "__main__":
    main()
