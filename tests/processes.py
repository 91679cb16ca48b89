"""Runs test scripts in fresh interpreters at once, each under a hard deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_at_once(
    script: str,
    runs: dict[str, list[str]],
    out: Path,
    deadline_s: float,
    envs: dict[str, dict[str, str]] | None = None,
    until: set[str] | None = None,
) -> dict:
    """Runs `script` with each of `runs`' arguments at once; their exit codes, by name.

    Output goes to `out/<name>.log`, not pipes, so a child that hangs cannot hold a pipe open;
    a run past `deadline_s` fails the test, and every child still running is killed. `envs`
    adds variables to a run's environment; with `until`, the runs not named there are killed
    as soon as those named have ended (a run that hangs on purpose).
    """
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    processes = {}
    for name, args in runs.items():
        with open(out / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen(
                [sys.executable, script, *args],
                cwd=REPO_ROOT,
                env={**env, **(envs or {}).get(name, {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    codes = {}
    try:
        for name, process in processes.items():
            if until is not None and name not in until:
                continue
            try:
                codes[name] = process.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                pytest.fail(f"The {name} run did not finish within {deadline_s:.0f} s (a hang).")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes


def log_tail(out: Path, name: str) -> str:
    return (out / f"{name}.log").read_text()[-4000:]


def assert_demo_trained_alike(stdout: str) -> None:
    """`feedpipe demo`'s report has a row for each way of feeding, and both end at the same
    loss: the same training, fed two ways."""
    rows = {
        name: line.split()[-1]
        for line in stdout.splitlines()
        for name in ("synchronous feeding", "fp.Feeder")
        if line.startswith(name)
    }
    assert set(rows) == {"synchronous feeding", "fp.Feeder"}, stdout
    assert rows["synchronous feeding"] == rows["fp.Feeder"], stdout


def run_as_a_user(code: list[str] | str, *args: str) -> subprocess.CompletedProcess:
    """Runs `python -c code` (or `python *code`) in a fresh interpreter without
    `KERAS_BACKEND`, as a user who installed one framework's extra and set nothing runs it;
    asserts it succeeds, and returns it (stdout and stderr as text)."""
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    command = [sys.executable, *(["-c", code] if isinstance(code, str) else code), *args]
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
