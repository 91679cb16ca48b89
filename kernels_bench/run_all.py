"""Runs every benchmark, each in a fresh process, then lists every target and whether it is met.

Each script configures TensorFlow's logical devices before TensorFlow starts, so each runs in
its own process. The options are passed on to every script.

Run: `python -m kernels_bench.run_all [--quick] [--reps N] [--only overlap,mirrored]`;
each script writes `kernels_bench/results/<name>.json`. Exits 1 if a script fails to run
(a missed target is a result, not a failure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kernels_bench import harness

SCRIPTS = (
    "overlap",
    "get_latency",
    "mirrored",
    "train_loop",
    "fit_paths",
    "copy_cost",
    "gather",
    "hand_over",
    "workers",
    "monitor_overhead",
    "images",
    "multi_worker",
    "gathered_plan",
    "data_service",
    "dispatcher",
    "jax_parity",
    "demo",
    "skip_state",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per script")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(harness.RESULTS_DIR))
    parser.add_argument(
        "--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {', '.join(SCRIPTS)}"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCRIPTS))
    if unknown:
        parser.error(f"--only names {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")

    passed = ["--seed", str(args.seed), "--out-dir", args.out_dir]
    if args.quick:
        passed.append("--quick")
    if args.reps is not None:
        passed += ["--reps", str(args.reps)]

    outcomes = {}
    for name in names:
        print(f"\n=== kernels_bench.{name} {' '.join(passed)}", flush=True)
        started = time.perf_counter()
        rc = subprocess.run(
            [sys.executable, "-m", f"kernels_bench.{name}", *passed], cwd=harness.REPO_DIR
        ).returncode
        outcomes[name] = (rc, time.perf_counter() - started)

    print("\n=== summary")
    for name in names:
        rc, seconds = outcomes[name]
        path = Path(args.out_dir) / f"{name}.json"
        if rc != 0 or not path.exists():
            print(f"{name}: FAILED (exit code {rc}) after {seconds:.0f} s")
            continue
        result = json.loads(path.read_text())
        print(
            f"{name} ({seconds:.0f} s, {'quick' if result['quick'] else 'full'}): "
            f"{result['question']}"
        )
        for t in result["targets"]:
            status = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
            print(
                f"  [{status:^6}] {t['case']}: {t['label']} = {t['value']:.4g} "
                f"(target {t['op']} {t['threshold']:g})"
            )
    return 1 if any(rc != 0 for rc, _ in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
