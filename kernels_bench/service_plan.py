"""How long, and how much memory, does the tf.data service path take to plan the first batch of
an epoch, or of a restore, on one host of H?

Before its first job can start, a host's service producer must know the sample indices of the
rows that job asks for. It takes the epoch's steps from the sampler only as far as those rows
reach (`feedpipe.service.producer._Rows`); it used to list every step of the epoch first. Each
measurement drives the real `ServiceProducer` from `slots(Position(epoch, step), supply)` up to
its first `_start` call, which is replaced by a recorder that stops there: no tf.data service
runs. The sampler is `Sampler(N, B, shuffle=True, share=...)` with host 0's rows of each global
batch of B = 4096 (its share of H hosts; above 1e7 samples the order is lazy), the source N
paths of 100 characters and their labels (the service's kind of source: `ServiceWork` asks
JOB_BYTES of them, 38,836 rows, of one job).

* `start_ms`, `start_mb`: from the start of epoch 1 to the first job's rows, in milliseconds
  (`time.perf_counter`) and megabytes (10**6) at the peak of `tracemalloc`, in a second run (it
  slows allocations).
* `restore_ms`, `restore_mb`: the same from a restore at the epoch's middle step.
* `listed_start_ms`, `listed_start_mb` (no target): the same for the former way: the epoch's
  steps listed, their rows concatenated and the epoch-wide bookkeeping built, then the first
  job's rows, up to 1e8 samples where it fits this machine (a host's rows of an epoch at most
  2e7, 160 MB of indices); at 1e9 samples on 512 hosts once (`--listed-reps`): it takes
  seconds.
* `job_rows`, `steps_planned`: the first job's rows and the steps taken from the plan for them.

Targets: at N = 1e9 and B = 4096, on H = 1, 64, 256 and 512 hosts, the first batch of an epoch
and of a restore planned in <= 20 ms and <= 16 MB. `first_plan(length, global_batch, hosts)` is the
measurement alone, for other benchmarks (`kernels_bench.many_hosts`).

Run: `python -m kernels_bench.service_plan [--quick]`; writes
`kernels_bench/results/service_plan.json`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable

import numpy as np

from kernels_bench import harness

LENGTHS = (10**6, 10**8, 10**9)
HOSTS = (1, 64, 256, 512)
GLOBAL_BATCH = 4096
PATH_CHARACTERS = 100
"""Characters of each path of the source: the rows one job asks for follow from its bytes."""
LISTED_ROWS = 2 * 10**7
"""Most rows of a host's epoch the former way is measured at: its list holds 8 bytes a row."""
TARGET_MS = 20.0
TARGET_MB = 16.0


class _FirstJob(Exception):
    """Raised by the recorder in place of the first job's start: the plan is known."""


class _NoSlots:
    """The slot supply of a producer stopped before its first row arrives: no slot is taken."""

    def try_acquire(self) -> None:
        return None

    def acquire(self):
        raise AssertionError("no slot is taken before the first job starts")

    def give_back(self, slot) -> None:
        raise AssertionError("no slot is taken before the first job starts")

    def check_stop(self) -> None:
        pass

    def service_waited(self, seconds: float, lagging: bool = False) -> None:
        pass

    def take_dropped(self) -> list[int]:
        return []


@functools.cache
def _work():
    """The real `ServiceWork` over paths and labels. It is built over one row: what a plan
    takes from it (the rows of a job, `JOB_BYTES` of the source's; the rows held, `HELD_BYTES`
    of the transform's) depends on a row's bytes alone, not on the source's length."""
    import tensorflow as tf

    from feedpipe.core.sources import ArraySource
    from feedpipe.service.client import ServiceWork

    paths = np.array(["/" + "x" * (PATH_CHARACTERS - 1)], dtype=f"<U{PATH_CHARACTERS}")
    labels = np.zeros(1, np.int64)

    def length_of(sample):
        path, label = sample
        return tf.strings.length(path), label

    return ServiceWork(ArraySource((paths, labels), text=True), length_of, seed=0)


def _sampler(length: int, global_batch: int, hosts: int):
    """Host 0's plan among `hosts`, shuffled."""
    from feedpipe.core.sampler import Sampler

    if global_batch % hosts:
        raise ValueError(
            f"`global_batch`={global_batch} is not divisible by `hosts`={hosts}; use a "
            "multiple of the host count."
        )
    share = range(0, global_batch // hosts)
    return Sampler(length, global_batch, shuffle=True, seed=0, share=share)


def _streamed(length: int, global_batch: int, hosts: int, step: int) -> Callable[[], dict]:
    """The producer's first plan, from `Position(1, step)` (the middle step where `step` is
    None) to its first `_start` call."""
    from feedpipe.core.state import Position
    from feedpipe.service.producer import ServiceProducer

    work = _work()

    def plan() -> dict:
        sampler = _sampler(length, global_batch, hosts)
        producer = ServiceProducer(work, "grpc://localhost:0", sampler)
        planned = []

        def record(indices, epoch, positions):
            planned.append(len(indices))
            raise _FirstJob

        producer._start = record
        first = len(sampler) // 2 if step is None else step
        with contextlib.suppress(_FirstJob):
            next(producer.slots(Position(1, first), _NoSlots()))
        return {"job_rows": planned[0]}

    return plan


def _listed(length: int, global_batch: int, hosts: int) -> Callable[[], dict]:
    """The former first plan: every step of epoch 1 listed, their rows concatenated and the
    epoch-wide bookkeeping (row ends, each row's step, whether each row arrived) built, then
    the first job's rows, as `ServiceProducer._epoch` did before steps were streamed."""
    work = _work()

    def plan() -> dict:
        sampler = _sampler(length, global_batch, hosts)
        steps = list(sampler.steps(1, 0))
        sizes = [len(step.rows) for step in steps]
        ends = np.cumsum(sizes)
        step_of = np.repeat(np.arange(len(steps)), sizes)
        got = np.zeros(int(ends[-1]), bool)
        indices = np.concatenate([step.rows for step in steps])
        missing = np.flatnonzero(~got)[: work.rows_per_job]
        del step_of
        return {"job_rows": len(indices[missing])}

    return plan


def _measured(plan: Callable[[], dict]) -> dict:
    """`plan()` timed, then run again under `tracemalloc` for its peak bytes."""
    made, seconds, peak = harness.timed_then_traced(plan)
    return {**made, "ms": seconds * 1e3, "mb": peak / 1e6}


def first_plan(length: int, global_batch: int, hosts: int) -> dict:
    """Milliseconds and peak megabytes (tracemalloc) host 0 of `hosts` takes to plan its first
    service job, from the start of an epoch (`start_ms`, `start_mb`) and from a restore at the
    epoch's middle step (`restore_ms`, `restore_mb`), shuffled; and the job's rows (`job_rows`).
    """
    start = _measured(_streamed(length, global_batch, hosts, step=0))
    restore = _measured(_streamed(length, global_batch, hosts, step=None))
    return {
        "start_ms": start["ms"],
        "start_mb": start["mb"],
        "restore_ms": restore["ms"],
        "restore_mb": restore["mb"],
        "job_rows": start["job_rows"],
    }


def listed_plan(length: int, global_batch: int, hosts: int) -> dict:
    """The same as `first_plan`'s epoch start, the former way (every step listed first)."""
    listed = _measured(_listed(length, global_batch, hosts))
    return {"listed_start_ms": listed["ms"], "listed_start_mb": listed["mb"]}


def _counted_steps(length: int, global_batch: int, hosts: int) -> int:
    """Steps the producer takes from the plan before its first job."""
    from feedpipe.core import sampler as sampler_module

    taken = [0]
    steps = sampler_module.Sampler.steps

    def counting(self, epoch, start=0):
        for step in steps(self, epoch, start):
            taken[0] += 1
            yield step

    sampler_module.Sampler.steps = counting
    try:
        _streamed(length, global_batch, hosts, step=0)()
    finally:
        sampler_module.Sampler.steps = steps
    return taken[0]


def add_args(parser) -> None:
    parser.add_argument(
        "--listed-reps",
        type=int,
        default=1,
        help="repetitions of the former way at 1e9 samples on 512 hosts (0: not measured)",
    )


def main(argv=None) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = harness.parse_settings(__doc__, add_args, argv)
    harness.configure_tf(1)
    report = harness.Report(
        "service_plan",
        "time and memory of one host's first plan of an epoch or a restore on the tf.data "
        "service path, steps streamed, against the former list of every step",
        settings,
        "kernels_bench.service_plan",
    )
    _work()
    for length in LENGTHS:  # untimed: imports, first allocations
        first_plan(length, GLOBAL_BATCH, HOSTS[0])
    units = {
        "start_ms": "ms",
        "restore_ms": "ms",
        "listed_start_ms": "ms",
        "start_mb": "MB",
        "restore_mb": "MB",
        "listed_start_mb": "MB",
    }
    for length in LENGTHS:
        for hosts in HOSTS:
            rows = length // hosts
            listed = rows <= LISTED_ROWS and length < LENGTHS[-1]
            once = not listed and (length, hosts) == (LENGTHS[-1], HOSTS[-1])
            reps = []
            for rep in range(settings.reps):
                values = first_plan(length, GLOBAL_BATCH, hosts)
                if listed or (once and rep < settings.args.listed_reps):
                    values.update(listed_plan(length, GLOBAL_BATCH, hosts))
                reps.append(values)
            steps_planned = _counted_steps(length, GLOBAL_BATCH, hosts)
            for values in reps:
                values["steps_planned"] = steps_planned
            case = f"N=1e{round(math.log10(length))}, H={hosts}"
            report.add_case(
                case,
                {
                    "length": length,
                    "global_batch": GLOBAL_BATCH,
                    "hosts": hosts,
                    "host_rows_per_step": GLOBAL_BATCH // hosts,
                    "lazy_order": _sampler(length, GLOBAL_BATCH, hosts).lazy,
                    "source": f"paths of {PATH_CHARACTERS} characters and int64 labels",
                    "listed_reps": (
                        settings.reps if listed else settings.args.listed_reps if once else 0
                    ),
                },
                reps,
                units=units,
            )
            if length == LENGTHS[-1]:
                for start, what in (("start", "an epoch's start"), ("restore", "a restore")):
                    for unit, threshold in (("ms", TARGET_MS), ("mb", TARGET_MB)):
                        report.target(
                            case,
                            f"{start}_{unit}",
                            "<=",
                            threshold,
                            f"the first plan of {what} at {case}, {units[f'{start}_{unit}']}",
                        )
    report.finish(
        columns=[
            "start_ms",
            "start_mb",
            "restore_ms",
            "restore_mb",
            "listed_start_ms",
            "listed_start_mb",
            "job_rows",
            "steps_planned",
        ]
    )


if __name__ == "__main__":
    main()
