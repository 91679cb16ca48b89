"""Does `fp.diagnose` give advice that holds, for every kind of source, on every framework?

A diagnosis that sizes every remedy in cores gives advice 4x off for a source that waits rather
than computes. Here each of the four kinds of source in `kernels_bench.gil_source.KINDS`
(waiting, GIL-bound Python, GIL-free numpy, mixed; `--length` samples of about `--sample-ms`)
feeds an emulated accelerator step (a GIL-free sleep of `--step-ms`, global batch 64) through
a feeder with `workers=0`, on TensorFlow, JAX and PyTorch, each in a fresh interpreter of its
own environment (`--python-tf`, `--python-jax`, `--python-torch`; default `.venv`, `.venv-jax`,
`.venv-torch` at the repository root where present). In each repetition:

1. `fp.diagnose(feeder, step)` ranks its remedies (and tries the first, as it does);
2. every setting of the sweep (`workers=0`; 1, 2, 4, 8 and 16 workers as threads and as
   processes) and each of the first two remedies that is a setting feeds the same step: steps/s
   over `--steps` steps after 5 untimed ones, each feeder built fresh.

Per framework and kind: `first_over_predicted`, the first remedy's measured steps/s over the
rate the diagnosis predicted for it; `first_two_over_best`, the better of the first two
remedies' measured rates over the sweep's best; `elsewhere_first` (1 where a remedy that needs
more cores than this machine has ranks above one that works here, else 0).

Targets, for every framework and kind: `first_over_predicted` >= 0.8; `elsewhere_first` = 0;
`first_two_over_best` >= 0.95 (the best fixed setting, within the noise of one measurement,
is among the first two remedies).

Run: `python -m kernels_bench.diagnosis_matrix [--quick] [--frameworks tensorflow,jax,torch]`;
writes `kernels_bench/results/diagnosis_matrix.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from kernels_bench import harness
from kernels_bench.demo import ENVIRONMENTS, interpreter
from kernels_bench.gil_source import KINDS

SWEEP = [(0, "thread")] + [(n, mode) for mode in ("thread", "process") for n in (1, 2, 4, 8, 16)]
BATCH = 64
WARMUP = 5


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=4096, help="samples in the source")
    parser.add_argument("--sample-ms", type=float, default=0.5, help="cost of a sample")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the emulated step")
    parser.add_argument("--steps", type=int, default=30, help="steps timed per setting")
    parser.add_argument("--kinds", default=",".join(KINDS), help="any of " + ",".join(KINDS))
    parser.add_argument(
        "--frameworks", default=",".join(ENVIRONMENTS), help="any of " + ",".join(ENVIRONMENTS)
    )
    for framework, (flag, _venv) in ENVIRONMENTS.items():
        parser.add_argument(flag, default=None, metavar="PATH", help=f"{framework}'s python")
    parser.add_argument("--deadline-s", type=float, default=1200.0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


# ---- in one framework's interpreter --------------------------------------------------------


def feeder_options(framework: str) -> dict:
    """The feeder's device: one CPU device of `framework`."""
    if framework == "tensorflow":
        return {"devices": ["/cpu:0"]}
    if framework == "jax":
        import jax

        return {"devices": jax.devices()[:1]}
    return {"framework": "torch"}


def steps_per_s(source, framework: str, step, steps: int, **options) -> float:
    """Steps/s of `step` fed by a fresh feeder with `options`, after `WARMUP` untimed steps."""
    import feedpipe as fp

    with fp.Feeder(source, BATCH, **feeder_options(framework), **options) as feeder:
        batches = harness.endless(feeder)
        for _ in range(WARMUP):
            step(next(batches))
        began = time.perf_counter()
        for _ in range(steps):
            step(next(batches))
        return steps / (time.perf_counter() - began)


def one_kind(framework: str, kind: str, args: argparse.Namespace) -> dict:
    """A diagnosis of one kind of source and the measured rates of its remedies and the sweep."""
    import feedpipe as fp

    source = KINDS[kind](args.length, args.sample_ms / 1e3)

    def step(batch) -> None:
        time.sleep(args.step_ms / 1e3)

    with fp.Feeder(source, BATCH, **feeder_options(framework)) as feeder:
        diagnosis = fp.diagnose(feeder, step, steps=args.steps, warmup=WARMUP, progress=False)
    remedies = [
        {
            "action": r.action,
            "expected_steps_per_s": r.expected_steps_per_s,
            "options": r.options,
            "tried_steps_per_s": r.tried_steps_per_s,
            "elsewhere": r.elsewhere,
        }
        for r in diagnosis.remedies
    ]
    measured = {}
    for workers, mode in SWEEP:
        options = {"workers": workers, "worker_mode": mode}
        measured[label(options)] = steps_per_s(source, framework, step, args.steps, **options)
    for remedy in remedies[:2]:
        if remedy["options"] and label(remedy["options"]) not in measured:
            rate = steps_per_s(source, framework, step, args.steps, **remedy["options"])
            measured[label(remedy["options"])] = rate
    return {
        "source": source.as_dict(),
        "sample_cost": None if diagnosis.sample_cost is None else diagnosis.sample_cost.describe(),
        "verdict": diagnosis.verdict,
        "producer_steps_per_s": diagnosis.producer_steps_per_s,
        "consumer_steps_per_s": diagnosis.consumer_steps_per_s,
        "remedies": remedies,
        "measured": measured,
    }


def label(options: dict) -> str:
    workers = options.get("workers", 0)
    mode = options.get("worker_mode", "process")
    if "depth" in options:
        return f"depth{options['depth']}"
    return "workers0" if workers == 0 else f"{mode}{workers}"


def child(args: argparse.Namespace) -> None:
    framework, out = args.child.split(":", 1)
    results = {kind: one_kind(framework, kind, args) for kind in args.kinds.split(",")}
    Path(out).write_text(json.dumps(results))


# ---- the driver ------------------------------------------------------------------------------


def figures(result: dict) -> dict:
    """The case's figures of one repetition."""
    remedies, measured = result["remedies"], result["measured"]
    best = max(measured[label({"workers": n, "worker_mode": m})] for n, m in SWEEP)
    values: dict = {"best_sweep_steps_per_s": best}
    first = remedies[0]
    if first["options"]:
        rate = measured[label(first["options"])]
        values["first_steps_per_s"] = rate
        values["first_predicted_steps_per_s"] = first["expected_steps_per_s"]
        values["first_over_predicted"] = rate / first["expected_steps_per_s"]
        if first["tried_steps_per_s"] is not None:
            values["first_tried_alone_steps_per_s"] = first["tried_steps_per_s"]
    settings = [r for r in remedies[:2] if r["options"]]
    if settings:
        values["first_two_over_best"] = max(measured[label(r["options"])] for r in settings) / best
    here_after = [i for i, r in enumerate(remedies) if not r["elsewhere"]]
    elsewhere = [i for i, r in enumerate(remedies) if r["elsewhere"]]
    values["elsewhere_first"] = float(
        bool(here_after and elsewhere and min(elsewhere) < max(here_after))
    )
    return values


def run_child(python: str, framework: str, args: argparse.Namespace) -> dict:
    env = harness.framework_env()
    with tempfile.TemporaryDirectory(prefix="feedpipe-diagnosis-") as tmp:
        out = Path(tmp) / "out.json"
        command = [python, "-m", "kernels_bench.diagnosis_matrix", "--child", f"{framework}:{out}"]
        for name in ("length", "sample_ms", "step_ms", "steps", "kinds"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        done = subprocess.run(
            command,
            cwd=harness.REPO_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.deadline_s,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{framework}: exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
            )
        return json.loads(out.read_text())


def main(argv=None) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    if args.child:
        child(args)
        return
    report = harness.Report(
        "diagnosis_matrix",
        "does the diagnosis's advice hold for waiting, GIL-bound, GIL-free and mixed sources on "
        "TensorFlow, JAX and PyTorch: its first remedy's measured rate over its prediction, the "
        "sweep's best among its first two remedies, nothing needing other machines ranked first",
        settings,
        "kernels_bench.diagnosis_matrix",
    )
    frameworks = args.frameworks.split(",")
    kinds = args.kinds.split(",")
    reps: dict[tuple[str, str], list[dict]] = {(f, k): [] for f in frameworks for k in kinds}
    raw: dict[str, list] = {f"{f}/{k}": [] for f in frameworks for k in kinds}
    for rep in range(settings.reps):
        for framework in harness.rotate(frameworks, rep):
            with harness.OtherLoad() as other:
                results = run_child(interpreter(args, framework), framework, args)
            for kind, result in results.items():
                values = figures(result) | {"other_cores": other.cores}
                reps[(framework, kind)].append(values)
                raw[f"{framework}/{kind}"].append(result)
                first = result["remedies"][0]["action"]
                print(
                    f"  rep {rep + 1} {framework} {kind}: first remedy {first!r}, "
                    + ", ".join(f"{k} {v:.2f}" for k, v in values.items() if "over" in k),
                    flush=True,
                )
    for (framework, kind), values in reps.items():
        case = f"{framework}, {kind}"
        keys = sorted({key for rep in values for key in rep})
        report.add_case(
            case,
            {"framework": framework, "kind": kind, "step_ms": args.step_ms, "global_batch": BATCH},
            [{key: rep.get(key) for key in keys} for rep in values],
            units={key: "steps/s" for key in keys if key.endswith("steps_per_s")},
            extra={"repetitions": raw[f"{framework}/{kind}"]},
        )
        report.target(case, "first_over_predicted", ">=", 0.8, f"{case}: first remedy / predicted")
        report.target(case, "elsewhere_first", "<=", 0.0, f"{case}: nothing elsewhere ranked first")
        report.target(case, "first_two_over_best", ">=", 0.95, f"{case}: first two / sweep's best")
    report.finish(
        columns=[
            "first_over_predicted",
            "first_two_over_best",
            "elsewhere_first",
            "best_sweep_steps_per_s",
        ]
    )


if __name__ == "__main__":
    main()
