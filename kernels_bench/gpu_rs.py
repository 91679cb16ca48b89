"""On a GPU, does `fp.Feeder` at depth 2 keep a real jitted training step as busy as batches
already on the device (R/S, DESIGN.md)?

A real jitted training step (an MLP: the flattened 96x96x3 image into `--hidden` units, a
weight-tied hidden layer applied `repeat` times in a `lax.scan`, softmax cross-entropy, SGD,
parameters donated), `repeat` calibrated so that the step alone takes about each of
`--step-ms` (30 and 5 on a GPU), fed by `fp.Feeder((x, y), B, devices=[gpu], depth=2,
shuffle=True)` from arrays in host memory, against the same step on batches already on the
device (pre-staged, reused). Steps are dispatched without waiting, as a training loop does;
the clock stops when the last step's parameters are ready. Targets: R/S >= 0.98 with the 30 ms
step and with the 5 ms step (the feeder's `stats().stage_ms` says where each batch's staging
time went).

Run on a CUDA machine with JAX, from the repository root: `KERAS_BACKEND=jax python3 -m
kernels_bench.gpu_rs`, which writes `kernels_bench/results/gpu_rs.json`; `bash
kernels_bench/gpu_run.sh` runs it with the other JAX GPU questions into `gpu.json` (`gpu.py`).
`--smoke` runs it shrunk on CPU JAX (`gpu_rs_smoke.json`), where the step and the feeder share
the CPU and no target is taken.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator

from kernels_bench import harness
from kernels_bench.harness import jax_gpu
from kernels_bench.harness.accelerator import add_rs_args, smoke_rs
from kernels_bench.harness.images import SAMPLE_SHAPE, ImageSource
from kernels_bench.harness.jax_staging import calibrate_step, init_params, run_steps
from kernels_bench.harness.parts import add_rs_case, rs_reps

PART = "rs"
QUESTION = "R/S of a jitted step at depth 2 (30 and 5 ms), on one accelerator"
NOTE = (
    "R/S: steps dispatched without waiting, the clock stopped when the last parameters are "
    "ready; the feeder's stats are over the timed steps."
)
COLUMNS = ["real_over_synthetic", "synthetic_step_ms"]
add_args = add_rs_args
smoke = smoke_rs


def run(report: harness.Report, settings: harness.Settings, device) -> None:
    """One R/S case per `--step-ms`."""
    for step_ms in settings.args.step_ms:
        run_rs(report, settings, device, step_ms)


def run_rs(report: harness.Report, settings: harness.Settings, device, step_ms: float) -> None:
    import jax

    import feedpipe as fp

    args = settings.args
    batch = args.rs_batch
    x, y = ImageSource(batch * args.rs_batches, 0.0).arrays()
    features = math.prod(SAMPLE_SHAPE)
    step, repeat, step_s = calibrate_step(
        features, args.hidden, (x[:batch], y[:batch]), device, settings.seed, step_ms / 1e3
    )
    print(
        f"R/S: step of {repeat} hidden layers ({args.hidden} units) takes {step_s * 1e3:.1f} ms "
        f"alone on {batch} x {SAMPLE_SHAPE} ({x[:batch].nbytes / 2**20:.1f} MiB a batch)",
        flush=True,
    )
    staged = [
        tuple(jax.device_put((x[i : i + batch], y[i : i + batch]), device))
        for i in range(0, 4 * batch, batch)
    ]
    feeder = fp.Feeder((x, y), batch, devices=[device], depth=2, shuffle=True, seed=settings.seed)
    fed = (b.replicas[0] for b in harness.endless(feeder))
    peers = {"real": fed, "synthetic": itertools.cycle(staged)}
    params = [init_params(features, args.hidden, device, settings.seed)]

    def run(batches: Iterator, count: int) -> float:
        params[0], elapsed = run_steps(step, params[0], batches, count)
        return elapsed

    for batches in peers.values():
        run(batches, 3)
    steps = settings.pick(args.rs_steps // 4, args.rs_steps)
    before = feeder.stats()
    reps = rs_reps(settings, peers, run, steps)
    add_rs_case(
        report,
        step_ms,
        {"platform": device.platform},
        batch=batch,
        batch_bytes=x[:batch].nbytes + y[:batch].nbytes,
        hidden=args.hidden,
        repeat=repeat,
        step_s=step_s,
        steps=steps,
        reps=reps,
        feeder=feeder,
        before=before,
        applies=device.platform == "gpu",
        why_not=f"platform {device.platform}: the step and the feeder share the CPU",
        more_stats=lambda stats, before: {
            "device_blocks": stats.device_blocks,
            "fence_wait_s": stats.fence_wait_s - before.fence_wait_s,
        },
    )
    feeder.close()


def main(argv=None) -> None:
    jax_gpu.main("gpu_rs", __doc__, QUESTION, [sys.modules[__name__]], argv)


if __name__ == "__main__":
    main()
