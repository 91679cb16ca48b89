"""How much faster does `feedpipe demo` train through the feeder than fed synchronously, on
TensorFlow, JAX and PyTorch, and is each figure larger than the machine's noise?

The README quotes the demo's figures; this records them. Each repetition runs `python -m
feedpipe demo --framework F --steps N --json FILE` once per framework, each in a fresh
interpreter of that framework's environment (`--python-tf`, `--python-jax`, `--python-torch`;
default: `.venv`, `.venv-jax` and `.venv-torch` at the repository root where present, else this
interpreter) with this checkout's feedpipe first on its path, the frameworks in rotating order
so that other work on the machine weighs on each alike. A run still going after `--deadline-s`
is killed and recorded as failed; `other_cores` is what other processes kept busy beside it.

Writes `kernels_bench/results/demo.json`: `runs`, by framework, with the median `speedup` and
its range (`speedup_min`, `speedup_max`), the median `input_bound_sync_pct`,
`input_bound_feeder_pct` and `step_alone_ms` (the step alone as the demo calibrated it; each
run's own in `step_alone_sync_ms` and `step_alone_feeder_ms`), `loss_equal` (every repetition
ended both runs at the same loss), `noise_warning` (some repetition warned that its step alone
moved more than its speedup) and `noise_warnings` (how many did), and every repetition's
figures in `repetitions`; beside it the harness's cases (median, min and max of each figure)
and environment. No target: the demo's figures are reported.

Run: `python -m kernels_bench.demo [--quick] [--reps N] [--steps 150] [--frameworks
tensorflow,jax,torch] [--python-tf PATH] [--python-jax PATH] [--python-torch PATH]
[--deadline-s 300]`; about 2 minutes a repetition on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels_bench import harness

ENVIRONMENTS = {
    "tensorflow": ("--python-tf", ".venv"),
    "jax": ("--python-jax", ".venv-jax"),
    "torch": ("--python-torch", ".venv-torch"),
}
"""Each framework's interpreter option and the environment it defaults to."""
MEDIANS = (
    "input_bound_sync_pct",
    "input_bound_feeder_pct",
    "step_alone_ms",
    "step_alone_sync_ms",
    "step_alone_feeder_ms",
    "steps_per_s_sync",
    "steps_per_s_feeder",
    "other_cores",
)
"""The figures whose median over the repetitions `runs` records, beside the speedup's."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (150; 40 quick)"
    )
    parser.add_argument(
        "--frameworks", default=",".join(ENVIRONMENTS), help="any of " + ",".join(ENVIRONMENTS)
    )
    for framework, (flag, venv) in ENVIRONMENTS.items():
        parser.add_argument(
            flag,
            default=None,
            metavar="PATH",
            help=f"the {framework} runs' interpreter (default: {venv}/bin/python in the "
            "repository root where present, else this one)",
        )
    parser.add_argument(
        "--deadline-s", type=float, default=300.0, help="a run is killed past this (300)"
    )


def interpreter(args: argparse.Namespace, framework: str) -> str:
    """The interpreter `framework`'s runs use: the one given, else its environment's."""
    flag, venv = ENVIRONMENTS[framework]
    given = getattr(args, flag.removeprefix("--").replace("-", "_"))
    if given:
        return given
    default = harness.REPO_DIR / venv / "bin" / "python"
    return str(default) if default.exists() else sys.executable


def run_demo(python: str, framework: str, steps: int, deadline_s: float) -> dict:
    """One demo run in a fresh interpreter: its `--json` figures and `other_cores`.

    Raises RuntimeError (with the end of its output) where it fails, and
    `subprocess.TimeoutExpired` once it is killed past `deadline_s`.
    """
    env = harness.framework_env()
    with tempfile.TemporaryDirectory(prefix="feedpipe-demo-") as tmp:
        path = Path(tmp) / "demo.json"
        command = [python, "-m", "feedpipe", "demo", "--framework", framework]
        command += ["--steps", str(steps), "--json", str(path)]
        with harness.OtherLoad() as other:
            done = subprocess.run(
                command,
                cwd=harness.REPO_DIR,
                env=env,
                capture_output=True,
                text=True,
                timeout=deadline_s,
            )
        if done.returncode != 0 or not path.exists():
            output = (done.stdout + done.stderr)[-1500:]
            raise RuntimeError(f"{framework} demo exited with {done.returncode}: {output}")
        figures = json.loads(path.read_text())
    figures["other_cores"] = other.cores
    return figures


def summary(python: str, done: list[dict], failures: list[str]) -> dict:
    """One framework's entry in `runs`: medians and range over its repetitions, whether each
    ended both runs at the same loss, and how many warned of noise."""
    entry: dict = {"python": python}
    if done:
        speedups = [figures["speedup"] for figures in done]
        entry |= {
            "speedup": statistics.median(speedups),
            "speedup_min": min(speedups),
            "speedup_max": max(speedups),
            **{key: statistics.median(figures[key] for figures in done) for key in MEDIANS},
            "loss_equal": all(figures["loss_equal"] for figures in done),
            "noise_warning": any(figures["noise_warning"] for figures in done),
            "noise_warnings": sum(figures["noise_warning"] for figures in done),
        }
        entry |= {key: done[-1][key] for key in ("framework_version", "devices", "on", "steps")}
    return entry | {"reps": len(done), "failures": failures, "repetitions": done}


class Report(harness.Report):
    """The harness's report with `runs`, by framework: the record the docs read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runs: dict[str, dict] = {}

    def as_dict(self) -> dict:
        return {"runs": self.runs, **super().as_dict()}


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    steps = args.steps or settings.pick(40, 150)
    frameworks = [name.strip() for name in args.frameworks.split(",") if name.strip()]
    unknown = sorted(set(frameworks) - set(ENVIRONMENTS))
    if unknown:
        raise SystemExit(
            f"--frameworks names {', '.join(unknown)}; choose from {', '.join(ENVIRONMENTS)}."
        )
    pythons = {framework: interpreter(args, framework) for framework in frameworks}
    report = Report(
        "demo",
        "the speedup of `feedpipe demo` (the feeder over synchronous feeding) on TensorFlow, "
        "JAX and PyTorch, its input-bound fractions, and whether the machine's noise exceeded it",
        settings,
        "kernels_bench.demo",
    )
    done: dict[str, list[dict]] = {framework: [] for framework in frameworks}
    failures: dict[str, list[str]] = {framework: [] for framework in frameworks}
    for rep in range(settings.reps):
        for framework in harness.rotate(frameworks, rep):
            try:
                figures = run_demo(pythons[framework], framework, steps, args.deadline_s)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failures[framework].append(str(error))
                print(f"  rep {rep + 1}/{settings.reps} {framework}: FAILED: {error}", flush=True)
                continue
            done[framework].append(figures)
            print(
                f"  rep {rep + 1}/{settings.reps} {framework}: {figures['speedup']:.2f}x, "
                f"input-bound {figures['input_bound_sync_pct']:.1f} % -> "
                f"{figures['input_bound_feeder_pct']:.1f} %, step alone "
                f"{figures['step_alone_ms']:.1f} ms (runs: {figures['step_alone_sync_ms']:.1f}, "
                f"{figures['step_alone_feeder_ms']:.1f})"
                + (", NOISE WARNING" if figures["noise_warning"] else "")
                + f"; other processes {figures['other_cores']:.2f} core",
                flush=True,
            )
    for framework in frameworks:
        report.runs[framework] = summary(pythons[framework], done[framework], failures[framework])
        if done[framework]:
            metrics = [
                {key: figures[key] for key in ("speedup", *MEDIANS)} for figures in done[framework]
            ]
            report.add_case(framework, {"python": pythons[framework], "steps": steps}, metrics)
    busy = [figures["other_cores"] for runs in done.values() for figures in runs]
    if busy:
        report.note(
            f"other processes kept {statistics.median(busy):.2f} cores busy beside the runs "
            f"(median; {max(busy):.2f} at most) on this machine of {os.cpu_count()} cores"
        )
    report.finish()
    if any(failures.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
