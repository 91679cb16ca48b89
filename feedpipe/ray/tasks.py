"""Tasks: what a feeder runs in Ray's worker processes; no framework is imported here.

The work (the source, `transform`, seed) and the plan (the sample spec, axes and the epochs'
`Sampler`) reach a task as object refs boxed in a list, so Ray does not resolve them per task:
each worker process reads them from its node's object store once and keeps them. A task is
named by (epoch, step, lo, hi) alone: it works out the step's sample indices from the
`Sampler` itself, so the order is the feeder's whatever runs it and no index list travels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import ray

from feedpipe.core._worker import TaskRunner, pack_skip
from feedpipe.core.sampler import Sampler
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.split import ReplicaSplit

RETRIES = 8
"""Times Ray runs a task again whose worker or node died (not one whose code raised): a lost
node costs each of its tasks one try."""


@dataclasses.dataclass(frozen=True, slots=True)
class Work:
    """What every task of a feeder starts from, put in the object store once."""

    source: Any
    transform: Any
    seed: int
    skips: bool


@dataclasses.dataclass(frozen=True, slots=True)
class TaskPlan:
    """What the rows' tasks also need once the feeder is planned."""

    spec: Any
    axes: list
    measured: Any
    sampler: Sampler


_runners: dict[str, TaskRunner] = {}
"""This worker process's runner of each work it has served, by the work's object id."""
_plans: dict[str, tuple[TaskPlan, dict[int, SlotLayout]]] = {}


def _runner(work: list) -> TaskRunner:
    key = work[0].hex()
    if key not in _runners:
        served = ray.get(work[0])
        _runners[key] = TaskRunner(served.source, served.transform, served.seed, None, served.skips)
    return _runners[key]


def first_spec(work: list, policy: Any) -> tuple[Any, Any]:
    """The spec of the first sample (see `feedpipe.core.writer.first_look`) and what was
    measured of the source, as a worker process reads them."""
    spec, _, measured = _runner(work).run(("spec", 0, policy))
    return spec, measured


def make_rows(work: list, plan: list, epoch: int, step: int, lo: int, hi: int) -> tuple:
    """Rows `lo:hi` of this host's share of `step` of `epoch`, made into a buffer laid out as
    one replica of `hi - lo` rows (`SlotLayout`), and the rows `errors="skip"` left out
    (counted from `lo`, each error pickled with its traceback)."""
    runner = _runner(work)
    key = plan[0].hex()
    if key not in _plans:
        served = ray.get(plan[0])
        runner.configure(served.spec, served.axes, {}, served.measured)
        _plans[key] = (served, {})
    served, layouts = _plans[key]
    rows = next(served.sampler.steps(epoch, step)).rows[lo:hi]
    if len(rows) not in layouts:
        layouts[len(rows)] = task_layout(runner.writer.out_spec, len(rows))
    slot = HostSlot(layouts[len(rows)])
    skipped = runner.writer.fill_rows(slot, epoch, 0, np.asarray(rows))
    return slot.buffer, [pack_skip(*skip) for skip in skipped]


def task_layout(spec: Any, rows: int) -> SlotLayout:
    """How a task's answer of `rows` rows is laid out: one replica, each field contiguous."""
    return SlotLayout(spec, ReplicaSplit(rows, 1), contiguous=True)
