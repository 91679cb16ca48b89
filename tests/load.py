"""A CPU load that keeps every core busy: for tests that check a reading holds under load, and
for CI, which runs the tests that read clocks (`pytest -m clock`) under it (`.ci/run`).

    python tests/load.py python -m pytest -q -m clock

runs the command beside one busy process per core and ends them when it ends, whatever its exit
status. Each busy process also ends by itself after its deadline or once its parent is gone, so
no load outlives a run that was killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

DEADLINE_S = 600.0
"""A busy process ends by itself after this long: past any one test, within CI's time."""


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _busy(deadline_s: float) -> str:
    """One core's worth of pure Python, until `deadline_s` or until its parent is gone."""
    return (
        "import os, time\n"
        f"end, parent = time.monotonic() + {deadline_s}, os.getppid()\n"
        "while time.monotonic() < end and os.getppid() == parent:\n"
        "    sum(range(10_000))\n"
    )


@contextlib.contextmanager
def busy_cores(per_core: int = 1, deadline_s: float = DEADLINE_S) -> Iterator[None]:
    """`per_core` busy processes per core, started here and ended by PID on exit."""
    code = _busy(deadline_s)
    load = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(per_core * cores())]
    try:
        yield
    finally:
        for busy in load:
            busy.kill()
        for busy in load:
            busy.wait(timeout=10)


def run_loaded(command: list[str]) -> int:
    """`command`'s exit status, run with one busy process per core beside it."""
    # A CI job stopped with SIGTERM still ends the load (through the `finally` of busy_cores).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with busy_cores():
        return subprocess.call(command)


if __name__ == "__main__":
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("usage: python tests/load.py COMMAND [ARGS...] runs COMMAND under CPU load")
    sys.exit(run_loaded(command))
