"""The bookkeeping of an accelerator run's parts, whatever the framework: copies timed and
their rates, a step calibrated to a time, real over synthetic, and training sessions' epochs
(`gpu_*.py` on JAX, `torch_gpu.py` on PyTorch)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator

from kernels_bench import harness
from kernels_bench.harness.images import ImageSource


def median_time_s(transfer: Callable[[], None], count: int) -> float:
    """The median time of one `transfer()` over `count`, each timed alone."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        transfer()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copies_per_rep(settings: harness.Settings, nbytes: int) -> int:
    """How many copies of `nbytes` each peer makes per repetition: about 1 GiB, 10 to 60."""
    return settings.pick(8, max(10, min(60, (1024 * 2**20) // nbytes)))


def copy_reps(
    settings: harness.Settings, peers: dict[str, Callable[[], None]], nbytes: int, copies: int
) -> list[dict]:
    """Each peer's copy of `nbytes` warmed up (3 copies: the first allocations, the driver's
    first use), then per repetition, peers in rotating order, its GB/s from the median of
    `copies` copies, and each peer's rate over `torch_pinned` where that peer ran."""
    for transfer in peers.values():
        for _ in range(3):
            transfer()
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            values[f"{peer}_gb_s"] = nbytes / median_time_s(peers[peer], copies) / 1e9
        for peer in peers:
            if peer != "torch_pinned" and "torch_pinned_gb_s" in values:
                values[f"{peer}_over_torch_pinned"] = (
                    values[f"{peer}_gb_s"] / values["torch_pinned_gb_s"]
                )
        reps.append(values)
    return reps


def calibrate_repeat(
    build: Callable[[int], object],
    run: Callable[[object, int], float],
    target_s: float,
    tries: int,
) -> tuple[object, int, float]:
    """The step `build(repeat)` whose `repeat` makes it take about `target_s` alone, where
    `run(step, count)` warms the step up and returns the seconds `count` more steps took: a
    probe at 4, then up to `tries - 1` refinements at about the target. Returns the step, its
    `repeat` and its time per step."""
    repeat = 4
    for _ in range(tries):
        step = build(repeat)
        count = max(3, min(20, round(0.5 / max(target_s, 1e-3))))
        step_s = run(step, count) / count
        wanted = max(1, round(repeat * target_s / step_s))
        if abs(wanted - repeat) <= max(1, 0.1 * repeat):
            return step, repeat, step_s
        repeat = wanted
    return build(repeat), repeat, step_s


def rs_reps(
    settings: harness.Settings,
    peers: dict[str, Iterator],
    run: Callable[[Iterator, int], float],
    steps: int,
) -> list[dict]:
    """Per repetition, peers in rotating order, `steps` steps on each peer's batches (`run`
    returns the seconds they took): steps/s, real / synthetic and the synthetic step's ms."""
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            values[f"{peer}_steps_s"] = steps / run(peers[peer], steps)
        values["real_over_synthetic"] = values["real_steps_s"] / values["synthetic_steps_s"]
        values["synthetic_step_ms"] = 1e3 / values["synthetic_steps_s"]
        reps.append(values)
    return reps


RS_TARGETS = {30.0: 0.98, 5.0: 0.98}
"""R/S target by the step's own time, ms: a 5 ms step leaves gathering and copying 27 MiB a
fifth of the time a 30 ms step leaves them, with the same fixed costs per batch."""


def add_rs_case(
    report: harness.Report,
    step_ms: float,
    where: dict,
    *,
    batch: int,
    batch_bytes: int,
    hidden: int,
    repeat: int,
    step_s: float,
    steps: int,
    reps: list[dict],
    feeder,
    before,
    applies: bool,
    why_not: str,
    more_stats: Callable[[object, object], dict] | None = None,
) -> None:
    """Adds the R/S case of a `step_ms` step and its target to `report`, before `feeder`
    closes: `where` names the device, `before` is the feeder's stats before the timed steps,
    and `more_stats(stats, before)` adds what this framework's feeder reports beyond that."""
    stats = feeder.stats()
    copies = stats.copies - before.copies
    copy_s = stats.copy_s - before.copy_s
    staged = max(stats.staged_batches - before.staged_batches, 1)
    stage_ms = {
        stage: (seconds - before.stage_s.get(stage, 0.0)) * 1e3 / staged
        for stage, seconds in stats.stage_s.items()
    }
    description = feeder.describe()
    case = f"real over synthetic, {step_ms:g} ms step"
    report.add_case(
        case,
        {
            **where,
            "global_batch": batch,
            "batch_bytes": batch_bytes,
            "depth": 2,
            "hidden": hidden,
            "repeat": repeat,
            "calibrated_step_ms": step_s * 1e3,
            "steps_per_peer": steps,
            "page_locked": stats.page_locked,
            "page_lock_reason": stats.page_lock_reason,
            "copy_path": description.copy_path,
            "copy_path_reason": description.copy_path_reason,
        },
        reps,
        units={"real_steps_s": "steps/s", "synthetic_steps_s": "steps/s"},
        extra={
            "feeder_stats": {
                "copy_gb_per_s": (
                    (stats.copied_bytes - before.copied_bytes) / copy_s / 1e9 if copy_s else None
                ),
                "copy_ms_per_step": copy_s / copies * 1e3 if copies else None,
                "copies": copies,
                "input_bound_fraction": stats.input_bound_fraction,
                "mean_occupancy": stats.mean_occupancy,
                "stage_ms_per_batch": stage_ms,
                "fences_per_batch": (stats.fences - before.fences) / copies if copies else None,
                **(more_stats(stats, before) if more_stats else {}),
                "summary": str(stats),
            }
        },
    )
    report.target(
        case,
        "real_over_synthetic",
        ">=",
        RS_TARGETS.get(step_ms, 0.95),
        f"R/S at depth 2, {step_ms:g} ms step",
        applies=applies,
        why_not=why_not,
    )


def epoch_metrics(
    peer: str, started: float, ends: list[float], seen: list[int], steps: int, epochs: int
) -> dict:
    """A session's first epoch (from `started`, its input's start-up included) and its steady
    state (the epochs after the first), checked to have run `epochs` epochs of `steps` steps:
    `ends` are the epochs' end times, `seen` their step counts."""
    if len(ends) != epochs or seen != [steps] * epochs:
        raise RuntimeError(f"{peer}: expected {epochs} epochs of {steps} steps, saw steps {seen}")
    return {
        f"{peer}_epoch1_s": ends[0] - started,
        f"{peer}_epoch1_steps_s": steps / (ends[0] - started),
        f"{peer}_steady_steps_s": steps * (epochs - 1) / (ends[-1] - ends[0]),
    }


def session_reps(
    settings: harness.Settings,
    peers: list[str],
    session: Callable[[str], dict],
    ratios: Callable[[dict, list[str]], None],
) -> list[dict]:
    """Per repetition, peers in rotating order, one `session(peer)` each (its `epoch_metrics`),
    then `ratios`, and the cores other processes used meanwhile."""
    reps = []
    for rep in range(settings.reps):
        values: dict = {}
        with harness.OtherLoad() as other:
            for peer in harness.rotate(peers, rep):
                values.update(session(peer))
                print(
                    f"  rep {rep} {peer}: epoch 1 {values[f'{peer}_epoch1_s']:.2f} s, steady "
                    f"{values[f'{peer}_steady_steps_s']:.1f} steps/s",
                    flush=True,
                )
        ratios(values, peers)
        values["other_cores"] = other.cores
        reps.append(values)
    return reps


def session_units(peers: list[str]) -> dict:
    """The units of each peer's `epoch_metrics`."""
    return {
        **{f"{p}_epoch1_s": "s" for p in peers},
        **{f"{p}_{m}_steps_s": "steps/s" for p in peers for m in ("epoch1", "steady")},
    }


def session_params(
    source: ImageSource, batch: int, shape: tuple[int, ...], steps: int, epochs: int, workers: int
) -> dict:
    """What every session of the fit (or train) part ran on."""
    return {
        "global_batch": batch,
        "sample_shape": list(shape),
        "batch_bytes": batch * math.prod(shape) * 4,
        "steps_per_epoch": steps,
        "epochs_per_session": epochs,
        "workers": workers,
        "source": source.as_dict(),
        "source_batch_ms": source.calibrated_s * batch * 1e3,
    }


def feeder_params(stats) -> dict:
    """What the feeder's last session said of its copies and of waiting for input."""
    return {
        "feeder_copy_path": None if stats is None else stats.copy_path,
        "feeder_page_locked": None if stats is None else stats.page_locked,
        "feeder_page_lock_reason": None if stats is None else stats.page_lock_reason,
        "feeder_input_bound_fraction": None if stats is None else stats.input_bound_fraction,
    }
