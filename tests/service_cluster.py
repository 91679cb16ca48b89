"""A tf.data service on loopback for tests: one dispatcher and workers, each a `feedpipe service`
process, on free ports, every process killed by PID when the block ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_DEADLINE_S = 60.0
"""How long a server may take to say it serves: TensorFlow's import takes a few seconds, several
at once on two cores take longer; past this the start is a hang."""
STOP_GRACE_S = 3.0
"""How long the servers have to exit on SIGTERM before they are killed: an idle one exits in
about 1 s, but a worker that has served a job can take 5-20 s in TensorFlow's shutdown (more on a
loaded machine), which tells most tests nothing."""
SERVED_STOP_GRACE_S = 90.0
"""The grace of a test that checks that servers which served a job exit 0 on SIGTERM: long
enough for TensorFlow's shutdown on a loaded machine (the suite's other processes share the
cores); past it the exit is a hang."""
POLL_S = 0.05

_DISPATCHER_PORT = re.compile(r"serving the tf\.data service at grpc://localhost:(\d+)")
_WORKER_PORT = re.compile(r"serving tf\.data service work at localhost:\d+ \(port (\d+)\)")


class ServiceCluster:
    """A running dispatcher and its workers, with the means to break them.

    `processes` holds every process started, in order, killed or not; `workers` the workers not
    killed through this object; `ports` each process's port, by PID.
    """

    def __init__(self, logs: Path, env: dict[str, str], work_dir: Path | None = None):
        self.logs = logs
        self.work_dir = work_dir
        """Where a fault-tolerant dispatcher keeps its journal (None: not fault-tolerant)."""
        self.address = ""
        """The dispatcher's `grpc://localhost:PORT`, what `distribute` and trainers take."""
        self.dispatcher: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.processes: list[subprocess.Popen] = []
        self.ports: dict[int, int] = {}
        self._env = env
        self._log_paths: dict[int, Path] = {}

    def add_worker(self, port: int = 0) -> subprocess.Popen:
        """Starts one more worker (on `port`, e.g. a killed worker's, or a free one) and waits
        until it serves."""
        (worker,) = self._add_workers(1, port)
        return worker

    def kill_worker(self, pid: int) -> None:
        """Kills the worker `pid` (SIGKILL: no goodbye to the dispatcher) and waits for it."""
        worker = next(w for w in self.workers if w.pid == pid)
        _kill(worker)
        self.workers.remove(worker)

    def kill_dispatcher(self) -> None:
        """Kills the dispatcher (SIGKILL) and waits for it."""
        _kill(self.dispatcher)

    def restart_dispatcher(self) -> None:
        """Starts the dispatcher again at its address (and journal), and waits until it serves."""
        self.dispatcher = self._start("dispatcher", self._dispatcher_args())
        self._wait_ready([self.dispatcher], _DISPATCHER_PORT)

    def log(self, process: subprocess.Popen) -> str:
        """The end of `process`'s output."""
        return self._log_paths[process.pid].read_text(errors="replace")[-4000:]

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        path = self.logs / f"{name}-{len(self.processes)}.log"
        with open(path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "feedpipe", "service", *args],
                cwd=REPO_ROOT,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        self._log_paths[process.pid] = path
        return process

    def _start_all(self, workers: int) -> None:
        """Starts the dispatcher and the workers at once (the workers wait for the dispatcher),
        then waits until each serves."""
        self.address = f"grpc://localhost:{_free_loopback_port()}"
        self.dispatcher = self._start("dispatcher", self._dispatcher_args())
        started = [self._start("worker", self._worker_args(0)) for _ in range(workers)]
        self._wait_ready([self.dispatcher], _DISPATCHER_PORT)
        self._wait_ready(started, _WORKER_PORT)
        self.workers += started

    def _add_workers(self, count: int, port: int = 0) -> list[subprocess.Popen]:
        workers = [self._start("worker", self._worker_args(port)) for _ in range(count)]
        self._wait_ready(workers, _WORKER_PORT)
        self.workers += workers
        return workers

    def _dispatcher_args(self) -> list[str]:
        port = self.address.rsplit(":", 1)[1]
        if self.work_dir is None:
            return ["dispatcher", "--port", port]
        return ["dispatcher", "--port", port, "--work-dir", str(self.work_dir), "--fault-tolerant"]

    def _worker_args(self, port: int) -> list[str]:
        dispatcher = self.address.removeprefix("grpc://")
        port_args = ["--port", str(port), "--worker-address", "localhost:%port%"]
        return ["worker", "--dispatcher", dispatcher, *port_args]

    def _wait_ready(self, processes: list[subprocess.Popen], line: re.Pattern) -> list[int]:
        """The ports `processes` say they serve on, once all have said it; fails the test if
        one exits first or they are not all ready within `READY_DEADLINE_S`."""
        deadline = time.monotonic() + READY_DEADLINE_S
        ports: dict[int, int] = {}
        while len(ports) < len(processes):
            for process in processes:
                if process.pid in ports:
                    continue
                if found := line.search(self._log_paths[process.pid].read_text(errors="replace")):
                    ports[process.pid] = self.ports[process.pid] = int(found[1])
                elif process.poll() is not None:
                    pytest.fail(
                        f"`feedpipe service` (pid {process.pid}) exited with "
                        f"{process.returncode} before serving:\n{self.log(process)}"
                    )
            if time.monotonic() > deadline:
                late = [p for p in processes if p.pid not in ports]
                pytest.fail(
                    f"`feedpipe service` did not serve within {READY_DEADLINE_S:.0f} s (a hang):\n"
                    + "\n".join(self.log(p) for p in late)
                )
            time.sleep(POLL_S)
        return [ports[p.pid] for p in processes]

    def _stop_all(self, grace_s: float) -> None:
        """SIGTERM to every process still running, SIGKILL to any left after `grace_s`."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(process)


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def service_cluster(
    workers: int, logs: Path, work_dir: Path | None = None, stop_grace_s: float = STOP_GRACE_S
) -> Iterator[ServiceCluster]:
    """Starts a dispatcher (fault-tolerant, journaling to `work_dir`, where given) and `workers`
    workers on free loopback ports, waits until each serves (hard deadline), yields them, and at
    the end stops every process started, by PID (SIGTERM, SIGKILL after `stop_grace_s`), and
    waits for it, whatever the block raised.

    Output goes to `logs/<role>-<i>.log`, not pipes, so a server that hangs cannot hold a pipe
    open.
    """
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    cluster = ServiceCluster(logs, env, work_dir)
    try:
        cluster._start_all(workers)
        yield cluster
    finally:
        cluster._stop_all(stop_grace_s)
