"""On a GPU, does Keras 3's `model.fit(feeder)` on JAX, from a Python source, train as fast as
in-memory arrays or its own producers allow, and faster than PyDataset and Grain?

Keras 3 on JAX, a convnet (4 stride-2 3x3 convolutions, 32-256 channels, global pooling, dense
10; SGD, sparse cross-entropy from logits) on 256 x 96x96x3 float32 batches, fed from a Python
map-style source whose `__getitem__` costs about `--batch-ms` / 256 of CPU (34 ms per batch: a
GIL-holding loop plus building the image, calibrated when the source is built). Peers, one
`fit` each of `--epochs` epochs of `--steps` steps, in rotating order per repetition, one model
(compiled once per input structure, before the repetitions): `fit(x, y)` on the same images in
memory (the reference: no source cost at all), `fit(feeder, callbacks=[feeder.fit_callback()])`
over `fp.Feeder(source, 256, workers=8)`, `fit(PyDataset)` (`keras.utils.PyDataset(workers=8,
use_multiprocessing=True)`, each `__getitem__` stacking 256 samples), and Grain
(`grain.MapDataset.source(source).batch(256).to_iter_dataset().mp_prefetch(
grain.MultiprocessingOptions(num_workers=8))`, which `fit` takes through Keras's Grain
adapter); beside them the producers' own ceiling, the same feeder iterated with no model. Each
peer's input is built inside the timed call; the first epoch (start-up included) and the steady
state (the epochs after the first, each with its input's restart) are reported apart. Target:
fit(feeder) >= 0.9 x min(fit(x, y), the ceiling) in the steady state. A second case,
`--fast-batch-ms` (10) of CPU per batch, which the workers outrun, runs fit(x, y) and
fit(feeder) alone: targets >= 0.95 in the steady state, and a fit(feeder) after the first in
the process (every timed one: the warm-up fitted first) takes <= 1.2x fit(x, y)'s time over its
first epoch, its input's start-up included. Each session also counts the train step's
compilations (`<peer>_compiles`). Grain is optional; without it its peer is left out. The
comparison itself is `harness.keras_fit.run_fit_comparison`, which `keras_jax_fit.py` runs on
CPU JAX.

What runs where: feedpipe's worker processes unpickle `ImageSource` from
`kernels_bench.harness.images`, which imports only numpy and the standard library at the top,
so they never import a framework. PyDataset's workers are forked from this process (they
inherit what it loaded, as Keras does); Grain's are spawned, and Grain itself imports JAX.

Run on a CUDA machine with JAX and Keras 3 (see `gpu.py` for the wheels to carry), from the
repository root: `KERAS_BACKEND=jax python3 -m kernels_bench.gpu_fit`, which writes
`kernels_bench/results/gpu_fit.json`; `bash kernels_bench/gpu_run.sh` runs it with the other
JAX GPU questions into `gpu.json`. `--smoke` runs it shrunk on CPU JAX (`gpu_fit_smoke.json`:
small batches, 2 workers, the first case alone), as a check that it works.
"""

from __future__ import annotations

import argparse
import sys

from kernels_bench import harness
from kernels_bench.harness import jax_gpu
from kernels_bench.harness.images import SAMPLE_SHAPE
from kernels_bench.harness.keras_fit import FIT_PEERS, run_fit_comparison, target_second_fit

PART = "fit"
QUESTION = (
    "Keras 3 JAX fit(feeder) / min(fit(arrays), the feeder alone) beside PyDataset and Grain, "
    "on one accelerator"
)
NOTE = (
    "fit: one model, compiled for each input structure before the repetitions; each peer's "
    "input built inside the timed call; epoch 1 includes its start-up; steady = the epochs "
    "after the first."
)
COLUMNS = [
    "feedpipe_over_bound_steady",
    "feedpipe_over_arrays_steady",
    "feedpipe_over_pydataset_steady",
    "feedpipe_over_grain_steady",
    "feedpipe_over_arrays_epoch1",
    "feedpipe_over_pydataset_epoch1",
    "feedpipe_over_grain_epoch1",
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=256, help="fit: global batch")
    parser.add_argument("--steps", type=int, default=48, help="fit: steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="fit: epochs per session")
    parser.add_argument("--workers", type=int, default=8, help="fit: worker processes")
    parser.add_argument(
        "--fit-peers", default=",".join(FIT_PEERS), help="fit: the peers beside fit(x, y)"
    )
    parser.add_argument(
        "--batch-ms", type=float, default=34.0, help="fit: the source's CPU per batch"
    )
    parser.add_argument(
        "--fast-batch-ms",
        type=float,
        default=10.0,
        help="fit, second case (arrays and feedpipe): a source the workers outrun; 0: skip",
    )


def smoke(args: argparse.Namespace) -> None:
    args.fast_batch_ms = 0.0
    args.batch = 32
    args.steps = 6
    args.epochs = 2
    args.workers = 2


def fit_peers(text: str) -> list[str]:
    """The peers named in `text` ("arrays,feedpipe,..."), checked; `arrays` always runs."""
    named = [p.strip() for p in text.split(",") if p.strip()]
    unknown = set(named) - set(FIT_PEERS)
    if unknown:
        raise SystemExit(f"--fit-peers={text}: unknown {sorted(unknown)}; use {FIT_PEERS}.")
    return [p for p in FIT_PEERS if p in named or p == "arrays"]


def run(report: harness.Report, settings: harness.Settings, device) -> None:
    """The fit cases and their targets (`device` is JAX's first: Keras fits on it)."""
    import jax

    args = settings.args
    platform = jax.devices()[0].platform
    applies = platform == "gpu" and not args.smoke
    why_not = f"platform {platform}{' (--smoke)' if args.smoke else ''}: reported only"
    cases = [
        # (case, CPU per batch ms, peers, the metric, its threshold, what it says)
        (
            "keras jax fit",
            args.batch_ms,
            fit_peers(args.fit_peers),
            "feedpipe_over_bound_steady",
            0.9,
            "fit(feeder) / min(fit(x, y), the feeder alone), steady state",
        ),
        (
            "keras jax fit, fast source",
            args.fast_batch_ms,
            ["arrays", "feedpipe"],
            "feedpipe_over_arrays_steady",
            0.95,
            "fit(feeder) / fit(x, y), steady state, a source its workers can run ahead of",
        ),
    ]
    for case, batch_ms, peers, metric, threshold, label in cases:
        if not batch_ms:
            continue
        run_fit_comparison(
            report,
            settings,
            case=case,
            shape=SAMPLE_SHAPE,
            batch=args.batch,
            steps=args.steps,
            epochs=args.epochs,
            workers=args.workers,
            sample_s=batch_ms / 1e3 / args.batch,
            peers=peers,
        )
        report.target(case, metric, ">=", threshold, label, applies=applies, why_not=why_not)
        if case == "keras jax fit, fast source":
            target_second_fit(report, case, applies=applies, why_not=why_not)


def main(argv=None) -> None:
    jax_gpu.main("gpu_fit", __doc__, QUESTION, [sys.modules[__name__]], argv)


if __name__ == "__main__":
    main()
