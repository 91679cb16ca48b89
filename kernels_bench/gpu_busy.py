"""On a GPU, does a batch's copy wait for the step the device runs?

The time from issuing one R/S batch's copy (`--rs-batch` 256 x 96x96x3 float32, 27 MiB,
page-locked) to its being ready, issued just after a jitted step of about `--step-ms` (the
first of them, 30) was dispatched, over the same on an idle GPU, for feedpipe's copy engine
(its own CUDA stream) and for `jax.device_put` (whose copy waits for the step: XLA's GPU client
orders it behind the compute queued before it). The step is `gpu_rs.py`'s. Target: engine
busy / idle <= 1.5.

Run on a CUDA machine with JAX, from the repository root: `KERAS_BACKEND=jax python3 -m
kernels_bench.gpu_busy`, which writes `kernels_bench/results/gpu_busy.json`; `bash
kernels_bench/gpu_run.sh` runs it with the other JAX GPU questions into `gpu.json` (`gpu.py`).
`--smoke` runs it shrunk on CPU JAX (`gpu_busy_smoke.json`), as a check that it works.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable

from kernels_bench import harness
from kernels_bench.harness import jax_gpu
from kernels_bench.harness.accelerator import add_rs_args, smoke_rs
from kernels_bench.harness.images import SAMPLE_SHAPE, ImageSource
from kernels_bench.harness.jax_staging import (
    EngineTransfer,
    calibrate_step,
    copy_engine,
    init_params,
    jax_transfer,
    slot_region,
)

PART = "busy"
QUESTION = "copy-ready time with a step running / idle, feedpipe's copy engine and jax.device_put"
NOTE = (
    "busy: the copy issued just after a step was dispatched, timed to its batch being ready, "
    "median of the tries per repetition."
)
COLUMNS = ["engine_busy_over_idle", "device_put_busy_over_idle"]
add_args = add_rs_args
smoke = smoke_rs


def _time_ready(transfer: Callable[[], None], before: Callable[[], object] | None) -> float:
    """Seconds from issuing `transfer` to its batch being ready; `before` dispatches a step
    first (without waiting) and is waited for after the clock stops."""
    import jax

    running = before() if before is not None else None
    started = time.perf_counter()
    transfer()
    elapsed = time.perf_counter() - started
    if running is not None:
        jax.block_until_ready(running)
    return elapsed


def run(report: harness.Report, settings: harness.Settings, device) -> None:
    """Does a batch's copy wait for the step the device runs? Copy-ready time of one R/S batch
    (27 MiB) issued just after a ~`--step-ms` jitted step was dispatched, over the same copy on
    an idle device, for feedpipe's copy engine and for `jax.device_put`."""
    import jax

    from feedpipe.core.pinned import page_locker

    args = settings.args
    batch = args.rs_batch
    x, y = ImageSource(batch, 0.0).arrays()
    features = math.prod(SAMPLE_SHAPE)
    step, repeat, step_s = calibrate_step(
        features, args.hidden, (x, y), device, settings.seed, args.step_ms[0] / 1e3
    )
    staged = jax.device_put((x, y), device)
    params = [init_params(features, args.hidden, device, settings.seed)]

    def run_step():
        params[0], loss = step(params[0], *staged)
        return loss

    owner, locked = slot_region(x.nbytes, page_locker())
    locked[...] = x.reshape(locked.shape)
    engine, engine_reason = copy_engine(locked, device)
    peers = {"device_put": jax_transfer(jax, locked, device)}
    if engine is not None:
        peers["engine"] = EngineTransfer(engine, locked, device)
    tries = settings.pick(5, 15)
    for transfer in peers.values():  # warm-up
        for before in (None, run_step):
            _time_ready(transfer, before)
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            for phase, before in (("idle", None), ("busy", run_step)):
                times = [_time_ready(peers[peer], before) for _ in range(tries)]
                values[f"{peer}_{phase}_ms"] = statistics.median(times) * 1e3
            values[f"{peer}_busy_over_idle"] = values[f"{peer}_busy_ms"] / values[f"{peer}_idle_ms"]
        reps.append(values)
    case = "copy ready while a step runs"
    report.add_case(
        case,
        {
            "platform": device.platform,
            "bytes": int(locked.nbytes),
            "calibrated_step_ms": step_s * 1e3,
            "repeat": repeat,
            "tries_per_rep": tries,
            "engine": engine is not None,
            "engine_reason": engine_reason,
            "page_locked": bool(owner[0].page_locked),
        },
        reps,
        units={f"{p}_{phase}_ms": "ms" for p in peers for phase in ("idle", "busy")},
    )
    report.target(
        case,
        "engine_busy_over_idle",
        "<=",
        1.5,
        "copy-ready time with a step running / on an idle GPU, feedpipe's copy engine",
        applies=engine is not None,
        why_not=f"no copy engine here: {engine_reason}",
    )
    if engine is not None:
        engine.close()
    del owner, locked, peers, engine
    gc.collect()


def main(argv=None) -> None:
    jax_gpu.main("gpu_busy", __doc__, QUESTION, [sys.modules[__name__]], argv)


if __name__ == "__main__":
    main()
