"""How long from building an input to its first batch, with N worker processes, against Keras's
PyDataset and Grain with the same N, and where feedpipe's start-up goes?

Short jobs, notebooks and every `feedpipe diagnose` pay the start-up before any step runs. Each
peer is built fresh over the same map-style Python source (`kernels_bench.gil_source.GilSource`,
about `--sample-ms` of GIL-holding work per sample, global batch `--batch`) and timed from the
call that builds it to its first batch in hand:

* feedpipe: `fp.Feeder(source, B, devices=[jax cpu], workers=N)` then `next(iter(feeder))`;
  its construction (`build_s`: spawning the workers, which import numpy and feedpipe's core,
  unpickle the source and read sample 0 for the spec) is reported apart from the first batch.
* PyDataset: `keras.utils.PyDataset(workers=N, use_multiprocessing=True)` whose `__getitem__`
  stacks B samples, read as Keras's JAX trainer reads it (`PyDatasetAdapter(...)
  .get_jax_iterator()` after `on_epoch_begin()`); its pool is forked from this process.
* Grain: `grain.MapDataset.source(source).batch(B).to_iter_dataset().mp_prefetch(
  grain.MultiprocessingOptions(num_workers=N))`, its first `next(iter(...))` (spawned workers).
* floor (no target): N bare `python -c "import numpy"` processes started at once and waited
  for, the part of a spawned worker's start-up that no design of spawned workers avoids.

Every peer runs once untimed first (the operating system's file cache, first imports in this
process), then in rotating order in each repetition; each peer is closed before the next starts
(not timed). Ratios within a repetition, then medians: `feedpipe_over_<peer>` is the peer's time
over feedpipe's (above 1: feedpipe delivers its first batch sooner). Targets: feedpipe no later
than PyDataset and Grain (`feedpipe_over_pydataset` and `feedpipe_over_grain` >= 1.0) with
`--workers` (2 here); on a 16-core machine with 8 workers, `feedpipe_first_batch_s` <= 0.3 s.

Run: `KERAS_BACKEND=jax python -m kernels_bench.startup [--quick] [--workers 8]`; writes
`kernels_bench/results/startup.json` (`startup_w8.json` with 8 workers).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time

from kernels_bench import harness
from kernels_bench.gil_source import GilSource, make_batch
from kernels_bench.gpu import grain_dataset, have_grain

PEERS = ("feedpipe", "pydataset", "grain", "floor")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes of each peer")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--sample-ms", type=float, default=0.5, help="CPU per sample")


def pydataset_class():
    import keras

    class StackedPyDataset(keras.utils.PyDataset):
        def __init__(self, source, batch: int, **kwargs):
            super().__init__(**kwargs)
            self.source = source
            self.batch = batch

        def __len__(self) -> int:
            return len(self.source) // self.batch

        def __getitem__(self, number: int):
            return make_batch(self.source, number)

    return StackedPyDataset


def first_batch(peer: str, source, batch: int, workers: int) -> dict:
    """Seconds from building `peer` to its first batch (and feedpipe's construction apart)."""
    started = time.perf_counter()
    if peer == "feedpipe":
        import jax

        import feedpipe as fp

        feeder = fp.Feeder(source, batch, devices=jax.devices()[:1], workers=workers)
        built = time.perf_counter()
        next(iter(feeder))
        done = time.perf_counter()
        feeder.close()
        return {"build_s": built - started, "first_batch_s": done - started}
    if peer == "pydataset":
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        dataset = pydataset_class()(source, batch, workers=workers, use_multiprocessing=True)
        adapter = PyDatasetAdapter(dataset, shuffle=False)
        adapter.on_epoch_begin()
        next(iter(adapter.get_jax_iterator()))
        done = time.perf_counter()
        adapter.on_epoch_end()
        return {"first_batch_s": done - started}
    if peer == "grain":
        iterator = iter(grain_dataset(source, batch, workers))
        next(iterator)
        done = time.perf_counter()
        iterator.close()
        return {"first_batch_s": done - started}
    if peer == "floor":
        bare = [subprocess.Popen([sys.executable, "-c", "import numpy"]) for _ in range(workers)]
        for process in bare:
            process.wait()
        return {"first_batch_s": time.perf_counter() - started}
    raise ValueError(peer)


def main(argv=None) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    source = GilSource(args.batch * 8, args.sample_ms / 1e3)
    peers = [p for p in PEERS if p != "grain" or have_grain()]
    name = "startup" if args.workers == 2 else f"startup_w{args.workers}"
    report = harness.Report(
        name,
        "time from building the input to its first batch, with N worker processes: feedpipe "
        "against PyDataset and Grain, and the spawn floor",
        settings,
        "kernels_bench.startup",
    )
    for peer in peers:  # untimed: file cache, first imports
        first_batch(peer, source, args.batch, args.workers)
        gc.collect()
    reps = []
    for rep in range(settings.reps):
        values = {}
        with harness.OtherLoad() as other:
            for peer in harness.rotate(peers, rep):
                measured = first_batch(peer, source, args.batch, args.workers)
                values.update({f"{peer}_{key}": value for key, value in measured.items()})
                gc.collect()
        for peer in peers:
            if peer not in ("feedpipe", "floor"):
                values[f"feedpipe_over_{peer}"] = (
                    values[f"{peer}_first_batch_s"] / values["feedpipe_first_batch_s"]
                )
        values["feedpipe_over_floor"] = (
            values["feedpipe_first_batch_s"] / values["floor_first_batch_s"]
        )
        values["other_cores"] = other.cores
        reps.append(values)
        print(
            f"  rep {rep + 1}/{settings.reps}: "
            + "  ".join(f"{p} {values[f'{p}_first_batch_s']:.3f} s" for p in peers)
            + f"  (feedpipe built in {values['feedpipe_build_s']:.3f} s; other processes "
            f"{other.cores:.2f} core)",
            flush=True,
        )
    case = f"first batch, {args.workers} workers"
    report.add_case(
        case,
        {
            "workers": args.workers,
            "global_batch": args.batch,
            "source": source.as_dict(),
            "cores": len(os.sched_getaffinity(0)),
            "peers": {
                "feedpipe": "fp.Feeder(source, B, devices=[jax cpu], workers=N); next(iter(...))",
                "pydataset": "PyDataset(workers=N, use_multiprocessing=True) via the JAX adapter",
                "grain": "MapDataset.source(...).batch(B).to_iter_dataset().mp_prefetch(N)",
                "floor": "N bare `python -c 'import numpy'` processes at once",
            },
        },
        reps,
        units={f"{p}_first_batch_s": "s" for p in peers} | {"feedpipe_build_s": "s"},
    )
    for peer in ("pydataset", "grain"):
        if peer in peers:
            report.target(
                case,
                f"feedpipe_over_{peer}",
                ">=",
                1.0,
                f"feedpipe's first batch no later than {peer}'s",
            )
    report.target(
        case,
        "feedpipe_first_batch_s",
        "<=",
        0.3,
        "feedpipe's first batch with 8 workers on a 16-core machine, seconds",
        applies=args.workers == 8 and len(os.sched_getaffinity(0)) >= 16,
        why_not="not 8 workers on 16 cores: reported only",
    )
    report.finish(
        columns=[
            "feedpipe_first_batch_s",
            "feedpipe_build_s",
            "pydataset_first_batch_s",
            "grain_first_batch_s",
            "floor_first_batch_s",
            "feedpipe_over_pydataset",
            "feedpipe_over_grain",
        ]
    )


if __name__ == "__main__":
    main()
