"""How many tests pass, and how long does the suite take? (the README's figures of the suite)

Runs one pytest command in a subprocess of this interpreter, from the repository root, reads
pytest's closing summary line ("1176 passed, 45 skipped, 3 warnings in 153.21s (0:02:33)") and
records it under the run's name in `kernels_bench/results/suite.json`: the command, the counts
(passed, failed, skipped, errors, ...: 0 where pytest names none), pytest's own seconds, the
wall time (`wall_s`, and `wall_min` for the README), when it started, and the environment
(commit, versions, machine) as every benchmark records it. Other runs' entries are kept.

Run it with the interpreter of the environment the run names; each takes minutes, so it is not
in `run_all`. The names the README quotes, each in the environment of the README's install:

    .venv-light/bin/python -m kernels_bench.suite light  # [test-light]: -m "not slow"
    .venv/bin/python -m kernels_bench.suite fast         # [test]: -m "not slow"
    .venv/bin/python -m kernels_bench.suite full         # [test]: the whole suite
    .venv-jax/bin/python -m kernels_bench.suite jax      # [test-jax]: tests/{core,jax_layer}
    .venv-torch/bin/python -m kernels_bench.suite torch  # [test-torch]: tests/{core,torch_layer}
    python -m kernels_bench.suite NAME -- PYTEST_ARGS    # any other run

then `python -m kernels_bench.figures` writes them into the README. One run, no repetitions:
the figures say what a user waits for, not how fast feedpipe is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kernels_bench import harness

RUNS = {
    "light": ["-m", "not slow"],
    "fast": ["-m", "not slow"],
    "full": [],
    "jax": ["tests/core", "tests/jax_layer"],
    "torch": ["tests/core", "tests/torch_layer"],
}
"""The runs the README quotes: their pytest arguments (after `python -m pytest -q`)."""

COUNTS = ("passed", "failed", "skipped", "errors", "deselected", "xfailed", "xpassed", "warnings")

_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in (\d+(?:\.\d+)?)s\b")


def parse_summary(output: str) -> dict:
    """The counts and seconds of pytest's last summary line in `output`.

    Raises ValueError where there is none (pytest crashed, or was killed, before its summary).
    """
    for line in reversed(output.splitlines()):
        match = _SUMMARY.match(line.strip())
        if match:
            found = {
                {"error": "errors", "warning": "warnings"}.get(word, word): int(n)
                for n, word in re.findall(r"(\d+) (\w+)", match[1])
            }
            return {**{key: 0 for key in COUNTS}, **found, "pytest_s": float(match[2])}
    tail = "\n".join(output.splitlines()[-20:])
    raise ValueError(f"no pytest summary line in the output; it ended:\n{tail}")


def run(name: str, pytest_args: Sequence[str], out_dir: Path = harness.RESULTS_DIR) -> dict:
    """Runs `python -m pytest -q *pytest_args` from the repository root, echoing its output,
    and records the run as `name` in `<out_dir>/suite.json`; returns the record."""
    command = [sys.executable, "-m", "pytest", "-q", *pytest_args]
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load = list(os.getloadavg())
    started = time.perf_counter()
    lines = []
    with subprocess.Popen(
        command, cwd=harness.REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    wall_s = time.perf_counter() - started
    record = {
        "command": shlex.join(["python", *command[1:]]),
        "python": sys.executable,
        "returncode": process.returncode,
        **parse_summary("".join(lines)),
        "wall_s": round(wall_s, 1),
        "wall_min": round(wall_s / 60, 2),
        "started_at": started_at,
        "load_average_at_start": load,
        "environment": harness.environment(),
    }
    path = out_dir / "suite.json"
    results = json.loads(path.read_text()) if path.is_file() else {"name": "suite"}
    results["question"] = __doc__.split("\n\n")[0]
    results.setdefault("runs", {})[name] = record
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Runs: " + "; ".join(f"{k}: {shlex.join(v) or '(all)'}" for k, v in RUNS.items()),
    )
    parser.add_argument("name", help=f"the run's name in suite.json ({', '.join(RUNS)}, or any)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    if not args.pytest_args and args.name not in RUNS:
        parser.error(
            f"run {args.name!r} is none of {', '.join(RUNS)}; give its pytest arguments after --"
        )
    record = run(args.name, args.pytest_args or RUNS[args.name], args.out_dir)
    print(
        f"{args.name}: {record['passed']} passed, {record['skipped']} skipped, "
        f"{record['failed']} failed in {record['wall_s']:.0f} s; wrote "
        f"{args.out_dir / 'suite.json'}"
    )
    return record["returncode"]


if __name__ == "__main__":
    sys.exit(main())
