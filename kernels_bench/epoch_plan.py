"""What does feedpipe's per-epoch plan cost every host, as datasets grow to 1e8 samples and
hosts to 64?

Case "epoch plan, N samples" (in the parent, after the cluster, TensorFlow not loaded): what
feedpipe's global plan costs every host every epoch, N = 1e5, 1e6, 1e7 and 1e8 (1e8 in a full
run only, where the machine has the memory, over 3 repetitions: one takes seconds):

* `order_*`: `Sampler(N, 64, shuffle=True).order(epoch)`, the full permutation: its time and
  peak memory in one pass (`tracemalloc`, which sees numpy's buffers; a few large allocations,
  which tracing does not slow), and that time spread over the epoch's steps. Where the sampler
  says it plans lazily (`Sampler.lazy`), the flag is turned off on that instance, so that the
  figure stays the full permutation the lazy plan replaces;
* `steps_*`: `Sampler(..., share=host 0 of 2).steps(epoch)`, as the feeder reads it, whatever
  the sampler does at that length: the time to its first step, per step after it, and (in a
  second pass: tracing slows each of its many small allocations) the peak memory. A sampler
  that materialises its order pays `order_s` before its first step, so at 1e8 the steps are
  timed only where the sampler is lazy;
* `lazy_*`, the hook for a lazy permutation (indices computed per batch, without the whole
  permutation): where `feedpipe.core.sampler` (or `feedpipe.permutation`) has a
  `LazyPermutation(length, key)` whose call maps positions to sample indices, its build time,
  time per step (one global batch of 64 positions) and peak memory, and `lazy_epoch_s`, that
  time per step over the epoch's steps, against `order_s` in `lazy_epoch_over_order` (what
  the lazy plan costs in CPU for the memory it saves); the case's `lazy_plan` param says which
  was found, or that none was.

Case "lazy plan per call" (where there is a lazy permutation): its time per call at the
largest N, by the number of positions asked for, 1 to 4096: a host computes only its own rows
of each step, B/H positions.

Case "hosts to 64" (on paper, from those figures): for 1 to 64 hosts, each host's rows per
step (`feedpipe.split.HostShare`: B/H, for this run's B = 64 with 1 replica per host and for
B = 4096 with 8), and what the plan costs per row the host makes, against the per-sample work
measured by `bare` (`*_over_sample_work`). The full permutation costs O(N) on every host
whatever H while a host makes N/H rows an epoch: order_s x H / N per own row. A lazy plan
costs a call on the host's B/H positions of several steps at once (up to 4,096 rows a call):
the metrics at 64 hosts time the host's `Sampler(..., share=).steps()` itself, per own row.
The metrics are those at 64 hosts of B = 64 (1 row per host per step) and the largest N; the
whole table is the case's `table`.

Run: as part of `python -m kernels_bench.multi_worker` (see its options `--max-length` and
`--reps`), in its parent after the cluster, with the per-sample work its `bare` peer measured;
the cases go to `kernels_bench/results/multi_worker.json`. This module imports neither
TensorFlow nor feedpipe at the top (the cluster's hosts import it with `multi_worker`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from kernels_bench import harness

HOSTS = 2
"""Worker processes of `multi_worker.py`'s cluster, 1 replica each (one CPU device per
worker): the plan is timed for host 0 of them."""
GLOBAL_BATCH = 64
"""The cluster's global batch: `multi_worker.py` takes it and `HOSTS` from here, so that the
plan timed is the one its cluster runs."""
PLAN_LENGTHS = (10**5, 10**6, 10**7, 10**8)
PLAN_STEPS_TIMED = 200
"""Steps of a plan timed after its first: enough to average out one slice's noise."""
LAZY_CALLS_TIMED = 50
"""Calls of a lazy permutation timed per size of the positions asked for."""
BIG_PLAN_REPS = harness.MIN_REPS
"""Repetitions at 1e8 samples, where one takes seconds."""
SCALE_HOSTS = (1, 2, 4, 8, 16, 32, 64)
SCALE_BATCHES = ((GLOBAL_BATCH, 1), (4096, 8))
"""(global batch, replicas per host) of the hosts-to-64 table: this run's, and a large one."""


def lazy_plan() -> tuple[Any, str]:
    """The hook for a lazy permutation: `LazyPermutation(length, key)` from `feedpipe.core.sampler`
    (or `feedpipe.permutation`), called with positions, returning sample indices; and where
    it was found (None and why not, where none is)."""
    import importlib

    for module in ("feedpipe.core.sampler", "feedpipe.permutation"):
        try:
            found = getattr(importlib.import_module(module), "LazyPermutation", None)
        except ImportError:
            continue
        if found is not None:
            return found, f"{module}.LazyPermutation"
    return None, (
        "none found: feedpipe.core.sampler (and feedpipe.permutation) has no LazyPermutation"
    )


def plan_rep(length: int, lazy: Any, with_steps: bool, seed: int) -> dict:
    """One repetition of the plan's cost at `length` samples (epoch 0 of `seed`)."""
    from feedpipe.core.sampler import Sampler
    from feedpipe.core.split import HostShare

    epoch = 0
    sampler = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed)
    if getattr(sampler, "lazy", False):
        # The full permutation that the lazy plan replaces at this length, for comparison.
        sampler.lazy = False
    row: dict[str, float | None] = {}
    with harness.traced() as memory:
        started = time.perf_counter()
        order = sampler.order(epoch)
        row["order_s"] = time.perf_counter() - started
    del order
    row["order_peak_bytes"] = memory["peak_bytes"]
    row["order_bytes_per_sample"] = memory["peak_bytes"] / length
    row["order_us_per_step"] = 1e6 * row["order_s"] / len(sampler)
    timed = min(PLAN_STEPS_TIMED, len(sampler) - 1)
    row["steps_first_s"] = row["steps_step_us"] = row["steps_peak_bytes"] = None
    if with_steps:
        share = HostShare(GLOBAL_BATCH, HOSTS, 0, 1).rows
        shared = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed, share=share)
        started = time.perf_counter()
        steps = shared.steps(epoch)
        next(steps)
        row["steps_first_s"] = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(timed):
            next(steps)
        row["steps_step_us"] = 1e6 * (time.perf_counter() - started) / timed
        steps.close()
        with harness.traced() as memory:  # apart: tracing slows each small allocation
            steps = shared.steps(epoch)
            for _ in range(timed + 1):
                next(steps)
            steps.close()
        row["steps_peak_bytes"] = memory["peak_bytes"]
    row["lazy_build_s"] = row["lazy_step_us"] = row["lazy_peak_bytes"] = None
    row["lazy_epoch_s"] = row["lazy_epoch_over_order"] = None
    if lazy is not None:

        def lazy_steps() -> tuple[float, float]:
            """Builds the permutation and plans `timed` steps: the seconds of each."""
            started = time.perf_counter()
            permutation = lazy(length, (seed, epoch))
            built = time.perf_counter()
            for step in range(timed):
                permutation(np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
            return built - started, time.perf_counter() - built

        build_s, steps_s = lazy_steps()
        row["lazy_build_s"], row["lazy_step_us"] = build_s, 1e6 * steps_s / timed
        with harness.traced() as memory:  # apart, as above
            lazy_steps()
        row["lazy_peak_bytes"] = memory["peak_bytes"]
        row["lazy_epoch_s"] = row["lazy_step_us"] * len(sampler) / 1e6
        row["lazy_epoch_over_order"] = row["lazy_epoch_s"] / row["order_s"]
    return row


PLAN_UNITS = {
    "order_s": "s",
    "order_peak_bytes": "bytes",
    "order_bytes_per_sample": "bytes",
    "order_us_per_step": "µs per step (amortised)",
    "steps_first_s": "s",
    "steps_step_us": "µs",
    "steps_peak_bytes": "bytes",
    "lazy_build_s": "s",
    "lazy_step_us": "µs",
    "lazy_peak_bytes": "bytes",
    "lazy_epoch_s": "s (its steps of one epoch, from lazy_step_us)",
}


def run_plan(report: harness.Report, settings: harness.Settings, sample_us: float) -> None:
    """The cases "epoch plan, N samples" and "hosts to 64"; `sample_us` is the CPU of one
    sample's work, as measured in case "input CPU"."""
    import psutil

    from feedpipe.core.sampler import Sampler

    lazy, lazy_where = lazy_plan()
    available = psutil.virtual_memory().available
    plans: dict[int, dict] = {}
    for length in (n for n in PLAN_LENGTHS if n <= settings.args.max_length):
        # The permutation, a copy, and room for everything else.
        if 3 * 16 * length > available:
            report.note(f"epoch plan at {length:.0e} samples skipped: {available} bytes free")
            continue
        sampler_is_lazy = bool(getattr(Sampler(length, GLOBAL_BATCH, shuffle=True), "lazy", False))
        # A sampler that materialises its order pays a full permutation before its first
        # step: at 1e8 that is seconds per repetition again, for the figure `order_s` gives.
        with_steps = length < 10**8 or sampler_is_lazy
        reps = settings.reps if length < 10**8 else min(settings.reps, BIG_PLAN_REPS)
        plan_rep(min(length, 10**5), lazy, with_steps, 99)  # warm-up: imports, first calls
        rows = [plan_rep(length, lazy, with_steps, settings.seed + rep) for rep in range(reps)]
        case = f"epoch plan, {length:.0e} samples"
        entry = report.add_case(
            case,
            {
                "length": length,
                "global_batch": GLOBAL_BATCH,
                "reps": reps,
                "sampler_is_lazy": sampler_is_lazy,
                "order": "Sampler(length, 64, shuffle=True).order(epoch): the full permutation"
                + (" (the instance's `lazy` flag turned off)" if sampler_is_lazy else ""),
                "steps": f"Sampler(..., share=HostShare(64, {HOSTS}, 0, 1).rows).steps(epoch), "
                "as the feeder reads it"
                if with_steps
                else "not timed: the sampler materialises its order (order_s) before its first",
                "lazy_plan": lazy_where,
                "steps_timed": min(PLAN_STEPS_TIMED, -(-length // GLOBAL_BATCH) - 1),
            },
            rows,
            units=PLAN_UNITS,
        )
        plans[length] = entry
        print(f"  {case}: order {entry['metrics']['order_s']['median']:.3g} s", flush=True)
    if plans:
        scale_model(report, settings, plans, lazy, lazy_where, sample_us)


def lazy_call_rep(lazy: Any, length: int, sizes: list[int], seed: int) -> dict:
    """One repetition of a lazy permutation's cost per call, by the positions asked for."""
    permutation = lazy(length, (seed, 0))
    row = {}
    for size in sizes:
        calls = LAZY_CALLS_TIMED
        starts = np.random.default_rng([seed, size]).integers(0, length - size, calls)
        started = time.perf_counter()
        for first in starts:
            permutation(np.arange(first, first + size))
        row[f"us_{size}_rows"] = 1e6 * (time.perf_counter() - started) / calls
    return row


def sampler_step_us(length: int, share: range, seed: int) -> float:
    """µs per step of the sampler a host with `share` runs, after its first step."""
    from feedpipe.core.sampler import Sampler

    steps = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed, share=share).steps(0)
    next(steps)
    started = time.perf_counter()
    for _ in range(PLAN_STEPS_TIMED):
        next(steps)
    return 1e6 * (time.perf_counter() - started) / PLAN_STEPS_TIMED


def scale_model(
    report: harness.Report,
    settings: harness.Settings,
    plans: dict[int, dict],
    lazy: Any,
    lazy_where: str,
    sample_us: float,
) -> None:
    """The case "hosts to 64" (and "lazy plan per call"): the plan's measured cost spread over
    the rows each host makes."""
    from feedpipe.core.split import HostShare

    largest = max(plans)
    shares = [
        (batch, local, hosts, HostShare(batch, hosts, 0, local))
        for batch, local in SCALE_BATCHES
        for hosts in SCALE_HOSTS
    ]
    lazy_us: dict[int, float] = {}
    if lazy is not None:
        # The host computes its own positions of each step: its share's size, timed as such.
        sizes = sorted({len(share.rows) for *_, share in shares})
        lazy_call_rep(lazy, largest, sizes, 99)  # warm-up
        entry = report.add_case(
            "lazy plan per call",
            {"length": largest, "lazy_plan": lazy_where, "calls_timed": LAZY_CALLS_TIMED},
            [lazy_call_rep(lazy, largest, sizes, settings.seed + r) for r in range(settings.reps)],
            units={f"us_{size}_rows": "µs per call" for size in sizes},
        )
        lazy_us = {size: entry["metrics"][f"us_{size}_rows"]["median"] for size in sizes}

    table = []
    for batch, local, hosts, share in shares:
        rows = len(share.rows)
        line: dict[str, Any] = {
            "global_batch": batch,
            "hosts": hosts,
            "replicas_per_host": local,
            "rows_per_host_per_step": rows,
            "rows_per_replica_per_step": share.local_split.per_replica,
        }
        for length, entry in plans.items():
            key = f"{length:.0e}"
            own_rows = math.ceil(length / batch) * rows
            full_us = 1e6 * entry["metrics"]["order_s"]["median"] / own_rows
            line[f"own_rows_per_epoch_{key}"] = own_rows
            line[f"full_plan_us_per_own_row_{key}"] = full_us
            line[f"full_plan_over_sample_work_{key}"] = full_us / sample_us
        if lazy_us:
            key = f"{largest:.0e}"
            line[f"lazy_plan_us_per_own_row_{key}"] = lazy_us[rows] / rows
            line[f"lazy_plan_over_sample_work_{key}"] = lazy_us[rows] / rows / sample_us
            line[f"lazy_over_full_plan_{key}"] = (
                lazy_us[rows] / rows / line[f"full_plan_us_per_own_row_{key}"]
            )
        table.append(line)

    metrics = plans[largest]["metrics"]
    one_row = HostShare(GLOBAL_BATCH, SCALE_HOSTS[-1], 0, 1)  # 64 rows over 64 hosts: 1 each
    own_rows = math.ceil(largest / GLOBAL_BATCH) * len(one_row.rows)
    reps = []
    for index, order_s in enumerate(metrics["order_s"]["reps"]):
        rep: dict[str, float | None] = {
            "full_plan_us_per_own_row_64_hosts": 1e6 * order_s / own_rows,
            "full_plan_over_sample_work_64_hosts": 1e6 * order_s / own_rows / sample_us,
            "full_plan_peak_bytes_per_host": metrics["order_peak_bytes"]["reps"][index],
            "lazy_plan_us_per_own_row_64_hosts": None,
            "lazy_plan_over_sample_work_64_hosts": None,
            "lazy_plan_peak_bytes_per_host": None,
        }
        if lazy_us:
            # As the feeder pays it: the host's sampler plans its one row of each step, several
            # steps per call of the lazy permutation.
            per_row = sampler_step_us(largest, one_row.rows, settings.seed + index)
            rep["lazy_plan_us_per_own_row_64_hosts"] = per_row
            rep["lazy_plan_over_sample_work_64_hosts"] = per_row / sample_us
            rep["lazy_plan_peak_bytes_per_host"] = metrics["lazy_peak_bytes"]["reps"][index]
        reps.append(rep)
    report.add_case(
        "hosts to 64",
        {
            "length": largest,
            "global_batch": GLOBAL_BATCH,
            "hosts": SCALE_HOSTS[-1],
            "sample_us": sample_us,
            "model": "Every host computes the plan of every epoch. The full permutation costs "
            "O(N) time and memory whatever H, and a host makes N/H rows of it: its cost per own "
            "row is order_s x H / N. A lazy plan computes each step's positions of the host "
            "alone: per own row, one call on B/H positions (case 'lazy plan per call') over "
            "B/H.",
            "lazy_plan": lazy_where,
        },
        reps,
        units={
            "full_plan_us_per_own_row_64_hosts": "µs",
            "full_plan_peak_bytes_per_host": "bytes",
            "lazy_plan_us_per_own_row_64_hosts": "µs",
            "lazy_plan_peak_bytes_per_host": "bytes",
        },
        extra={"table": table},
    )
