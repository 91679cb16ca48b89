"""How long from building an input to its first batch, with N worker processes, against Keras's
PyDataset and Grain with the same N; how long for a second feeder in the same process; and how
much a source holding 1 GB of arrays adds?

Short jobs, notebooks and every `feedpipe diagnose` pay the start-up before any step runs. Each
peer is built fresh over the same map-style Python source (`kernels_bench.gil_source.GilSource`,
about `--sample-ms` of GIL-holding work per sample, global batch `--batch`) and timed from the
call that builds it to its first batch in hand:

* feedpipe: `fp.Feeder(source, B, devices=[jax cpu], workers=N)` then `next(iter(feeder))`,
  with no warm worker in the process (the first feeder); its construction (`build_s`:
  spawning the workers, which import numpy and feedpipe's core, unpickle the source and read
  sample 0 for the spec) is reported apart from the first batch.
* feedpipe_ahead: the same, after `fp.warm_workers(N)` was called a second before (as at the
  top of a script): the first feeder adopts interpreters that have already started.
* PyDataset: `keras.utils.PyDataset(workers=N, use_multiprocessing=True)` whose `__getitem__`
  stacks B samples, read as Keras's JAX trainer reads it (`PyDatasetAdapter(...)
  .get_jax_iterator()` after `on_epoch_begin()`); its pool is forked from this process.
* Grain: `grain.MapDataset.source(source).batch(B).to_iter_dataset().mp_prefetch(
  grain.MultiprocessingOptions(num_workers=N))`, its first `next(iter(...))` (spawned workers).
* floor (no target): N bare `python -c "import numpy"` processes started at once and waited
  for, the part of a spawned worker's start-up that no design of spawned workers avoids.

Second feeder: a feeder over the same source is built and closed (untimed), then a new one is
timed to its first batch: it adopts the first one's warm workers (`feedpipe.core.warm`). Beside
it, `work_s` (no target) is one batch made in this process over the workers: the least any
pool of N workers takes for the batch itself; `second_next_batch_s` is the feeder's second
batch, and `second_start_s` the first less the second: what starting costs beyond a batch.

Held arrays: the source wrapped to hold `--held-mb` MB of numpy arrays
(`kernels_bench.gil_source.Holding`), against the bare source, both as first feeders (no warm
worker) and both as second feeders, and, as a second feeder, the same arrays over immutable
`bytes` (`frozen_second`: memory no one can write, so the kept copy is handed over without a
comparison; read-only views of writable memory are compared as writable arrays are).
`fresh_pages_s` (no target) is the time to write that many bytes into new shared files, as
feedpipe splits them (one a core): what any design sharing the arrays with spawned workers
through memory pays once; a fork shares them without a copy. `copy_alone_over_bare_first` is
that time over the bare source's first batch: the least `held_over_bare_first` can be; so is
`held_cpu_floor_over_bare_first`, the CPU the held source's first batch takes (this process and
its workers) spread over every core, over the bare source's first batch.

Every peer runs once untimed first (the operating system's file cache, first imports in this
process), then in rotating order in each repetition; each peer is closed before the next starts
(not timed). Ratios within a repetition, then medians: `feedpipe_over_<peer>` is the peer's time
over feedpipe's (above 1: feedpipe delivers its first batch sooner). Targets: feedpipe no later
than PyDataset and Grain (`feedpipe_over_pydataset` and `feedpipe_over_grain` >= 1.0) with
`--workers` (2 here); on a 16-core machine with 8 workers, `feedpipe_first_batch_s` <= 0.3 s; a
second feeder's first batch <= 0.05 s; held arrays' first batch <= 1.2x the bare source's.

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

import numpy as np

from kernels_bench import harness
from kernels_bench.gil_source import GilSource, Holding, make_batch
from kernels_bench.harness.images import grain_dataset, have_grain

PEERS = ("feedpipe", "feedpipe_ahead", "pydataset", "grain", "floor")
HELD = ("bare_first", "held_first", "bare_second", "held_second", "frozen_second", "fresh_pages")
AHEAD_S = 1.0
"""How long before the feeder `fp.warm_workers` is called for feedpipe_ahead: the start of a
script, a model being built."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes of each peer")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--sample-ms", type=float, default=0.5, help="CPU per sample")
    parser.add_argument("--held-mb", type=int, default=1024, help="MB of arrays held")


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


def feedpipe_first_batch(source, batch: int, workers: int) -> dict:
    """Seconds from building a feeder to its first batch and to its construction's end, and
    from its first batch to its second (what a batch takes once the workers run)."""
    import jax

    import feedpipe as fp

    cpu = harness.tree_cpu_s()
    started = time.perf_counter()
    feeder = fp.Feeder(source, batch, devices=jax.devices()[:1], workers=workers)
    built = time.perf_counter()
    batches = iter(feeder)
    next(batches)
    done = time.perf_counter()
    cpu = harness.tree_cpu_s() - cpu  # the workers' too: they are alive until the close
    next(batches)
    following = time.perf_counter() - done
    feeder.close()
    return {
        "build_s": built - started,
        "first_batch_s": done - started,
        "next_batch_s": following,
        "first_batch_cpu_s": cpu,
    }


def first_feeder(source, batch: int, workers: int) -> dict:
    """A feeder in a process with no warm worker."""
    from feedpipe.core import warm

    warm.release()
    return feedpipe_first_batch(source, batch, workers)


def second_feeder(source, batch: int, workers: int) -> dict:
    """A feeder after another one over the same source was built, read and closed."""
    first_feeder(source, batch, workers)
    return feedpipe_first_batch(source, batch, workers)


def first_batch(peer: str, source, batch: int, workers: int) -> dict:
    """Seconds from building `peer` to its first batch (and feedpipe's construction apart)."""
    if peer == "feedpipe":
        return first_feeder(source, batch, workers)
    if peer == "feedpipe_ahead":
        import feedpipe as fp
        from feedpipe.core import warm

        warm.release()
        fp.warm_workers(workers)
        time.sleep(AHEAD_S)
        return feedpipe_first_batch(source, batch, workers)
    started = time.perf_counter()
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


def second_or_work(peer: str, source, args) -> dict:
    """A second feeder's first batch, or the floor of its work: one batch made in this
    process, over the workers (`work_s`; no target)."""
    if peer == "second":
        return second_feeder(source, args.batch, args.workers)
    started = time.perf_counter()
    make_batch(source, 0)
    return {"s": (time.perf_counter() - started) / args.workers}


def fresh_pages_s(nbytes: int) -> float:
    """Seconds to write `nbytes` into new shared files, as feedpipe splits them: the pages a
    shared copy must be given."""
    from feedpipe.core import _arrays

    data = np.zeros(nbytes, np.uint8)
    data[:: 1 << 12] = 1  # its own pages exist: only the shared files' are new
    started = time.perf_counter()
    shared = _arrays.share([memoryview(data)], keep_s=None)
    seconds = time.perf_counter() - started
    for fd in shared.fds:
        os.close(fd)
    return seconds


def frozen(held: Holding) -> Holding:
    """`held` with its arrays' values over immutable `bytes`, which no one can write."""
    frozen = Holding(held.source, 0)
    frozen.nbytes = held.nbytes
    frozen.arrays = [
        np.frombuffer(array.tobytes(), array.dtype).reshape(array.shape) for array in held.arrays
    ]
    return frozen


def held_arrays(peer: str, sources: dict, batch: int, workers: int) -> dict:
    """`peer`'s seconds to its first batch; `sources` by the first word of a peer's name."""
    if peer == "fresh_pages":
        return {"s": fresh_pages_s(sources["held"].nbytes)}
    source = sources[peer.split("_")[0]]
    run = first_feeder if peer.endswith("first") else second_feeder
    made = run(source, batch, workers)
    return {"s": made["first_batch_s"], "cpu_s": made["first_batch_cpu_s"]}


def repeat(settings, peers, measure) -> list[dict]:
    """Each repetition: every peer in rotating order, `measure(peer)` prefixed by its name."""
    reps = []
    for rep in range(settings.reps):
        values = {}
        with harness.OtherLoad() as other:
            for peer in harness.rotate(peers, rep):
                values.update({f"{peer}_{k}": v for k, v in measure(peer).items()})
                gc.collect()
        values["other_cores"] = other.cores
        reps.append(values)
    return reps


def main(argv=None) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    from feedpipe.core import warm
    from feedpipe.core.machine import cores

    source = GilSource(args.batch * 8, args.sample_ms / 1e3)
    peers = [p for p in PEERS if p != "grain" or have_grain()]
    name = "startup" if args.workers == 2 else f"startup_w{args.workers}"
    report = harness.Report(
        name,
        "time from building the input to its first batch, with N worker processes: feedpipe's "
        "first and second feeder against PyDataset and Grain, the spawn floor, and a source "
        "holding 1 GB of arrays",
        settings,
        "kernels_bench.startup",
    )
    for peer in peers:  # untimed: file cache, first imports
        first_batch(peer, source, args.batch, args.workers)
        gc.collect()
    reps = repeat(settings, peers, lambda p: first_batch(p, source, args.batch, args.workers))
    for values in reps:
        for peer in ("pydataset", "grain"):
            if peer in peers:
                values[f"feedpipe_over_{peer}"] = (
                    values[f"{peer}_first_batch_s"] / values["feedpipe_first_batch_s"]
                )
                values[f"feedpipe_ahead_over_{peer}"] = (
                    values[f"{peer}_first_batch_s"] / values["feedpipe_ahead_first_batch_s"]
                )
        values["feedpipe_over_floor"] = (
            values["feedpipe_first_batch_s"] / values["floor_first_batch_s"]
        )
        values["floor_over_pydataset"] = (
            values["floor_first_batch_s"] / values["pydataset_first_batch_s"]
        )
    case = f"first batch, {args.workers} workers"
    report.add_case(
        case,
        {
            "workers": args.workers,
            "global_batch": args.batch,
            "source": source.as_dict(),
            "cores": len(os.sched_getaffinity(0)),
            "ahead_s": AHEAD_S,
            "peers": {
                "feedpipe": "fp.Feeder(source, B, devices=[jax cpu], workers=N); next(iter(...)), "
                "no warm worker",
                "feedpipe_ahead": f"the same, {AHEAD_S} s after fp.warm_workers(N)",
                "pydataset": "PyDataset(workers=N, use_multiprocessing=True) via the JAX adapter",
                "grain": "MapDataset.source(...).batch(B).to_iter_dataset().mp_prefetch(N)",
                "floor": "N bare `python -c 'import numpy'` processes at once",
            },
        },
        reps,
        units={f"{p}_first_batch_s": "s" for p in peers}
        | {"feedpipe_build_s": "s", "feedpipe_ahead_build_s": "s"},
    )
    for peer in ("pydataset", "grain"):
        if peer in peers:
            report.target(
                case,
                f"feedpipe_over_{peer}",
                ">=",
                1.0,
                f"the first feeder's first batch no later than {peer}'s",
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

    second = f"second feeder, {args.workers} workers"
    reps = repeat(settings, ["second", "work"], lambda p: second_or_work(p, source, args))
    for values in reps:
        values["second_over_work"] = values["second_first_batch_s"] / values["work_s"]
        values["second_start_s"] = values["second_first_batch_s"] - values["second_next_batch_s"]
    report.add_case(
        second,
        {"workers": args.workers, "global_batch": args.batch, "source": source.as_dict()},
        reps,
        units={
            "second_first_batch_s": "s",
            "second_build_s": "s",
            "second_next_batch_s": "s",
            "second_start_s": "s",
            "work_s": "s",
        },
    )
    report.target(
        second,
        "second_first_batch_s",
        "<=",
        0.05,
        "a second feeder's first batch, seconds (it adopts the first one's workers)",
    )

    held = Holding(source, args.held_mb * 1_000_000)
    sources = {"bare": source, "held": held, "frozen": frozen(held)}
    for peer in HELD:  # untimed: the arrays' own pages, first imports
        held_arrays(peer, sources, args.batch, args.workers)
    reps = repeat(settings, list(HELD), lambda p: held_arrays(p, sources, args.batch, args.workers))
    for values in reps:
        values["held_over_bare_first"] = values["held_first_s"] / values["bare_first_s"]
        values["held_over_bare_second"] = values["held_second_s"] / values["bare_second_s"]
        values["frozen_over_bare_second"] = values["frozen_second_s"] / values["bare_second_s"]
        values["copy_in_series_over_bare_first"] = (
            values["bare_first_s"] + values["fresh_pages_s"]
        ) / values["bare_first_s"]
        # The least held_over_bare_first can be: the copy hidden wholly behind the workers'
        # start, its fresh pages alone still to be given.
        values["copy_alone_over_bare_first"] = values["fresh_pages_s"] / values["bare_first_s"]
        # Or, where the cores are the limit: the CPU the held source's first batch takes (this
        # process and its workers) spread over every core, over the bare source's first batch.
        values["held_cpu_floor_over_bare_first"] = (
            values["held_first_cpu_s"] / cores() / values["bare_first_s"]
        )
    held_case = f"{args.held_mb} MB of arrays held, {args.workers} workers"
    report.add_case(
        held_case,
        {
            "workers": args.workers,
            "global_batch": args.batch,
            "held_bytes": held.nbytes,
            "arrays": len(held.arrays),
            "peers": {
                "bare_first": "the bare source, first feeder (no warm worker)",
                "held_first": "the source holding the arrays, first feeder",
                "bare_second": "the bare source, second feeder (warm workers adopted)",
                "held_second": "the source holding the arrays, second feeder",
                "frozen_second": "the same arrays over immutable bytes, second feeder",
                "fresh_pages": "the held bytes written into a new memfd (no target)",
            },
        },
        reps,
        units={f"{p}_s": "s" for p in HELD},
    )
    report.target(
        held_case,
        "held_over_bare_first",
        "<=",
        1.2,
        "first batch of a source holding the arrays over the bare source's (first feeders)",
    )
    floor = max(
        report.median(held_case, "copy_alone_over_bare_first"),
        report.median(held_case, "held_cpu_floor_over_bare_first"),
    )
    if floor > 1.2:
        report.note(
            f"Held arrays: the held source's first batch needs {floor:.2f}x the bare source's "
            "whole first batch here at the least (copy_alone_over_bare_first: its copy into "
            "new shared pages alone; held_cpu_floor_over_bare_first: its CPU, this process's "
            "and the workers', spread over every core), so 1.2x is out of reach on this "
            "machine for any design that gives the arrays new shared pages for spawned workers "
            "(starting the interpreters and faulting in the pages both take the cores); only a "
            "fork shares them without a copy."
        )
    warm.release()
    report.finish(
        columns=[
            "feedpipe_first_batch_s",
            "feedpipe_ahead_first_batch_s",
            "pydataset_first_batch_s",
            "grain_first_batch_s",
            "floor_first_batch_s",
            "feedpipe_over_pydataset",
            "feedpipe_ahead_over_pydataset",
            "second_first_batch_s",
            "second_start_s",
            "work_s",
            "bare_first_s",
            "held_first_s",
            "held_over_bare_first",
            "held_over_bare_second",
            "frozen_over_bare_second",
            "fresh_pages_s",
            "copy_in_series_over_bare_first",
            "copy_alone_over_bare_first",
            "held_cpu_floor_over_bare_first",
        ]
    )


if __name__ == "__main__":
    main()
