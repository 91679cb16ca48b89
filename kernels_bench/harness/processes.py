"""The processes a benchmark starts on loopback and ends by PID: a free port, the environment a
child runs in, the tf.data service's servers (`data_service.py`, `dispatcher.py`), a deadline
over them, a cluster's hosts (`multi_worker.py`): a process tree killed, a host's log relayed,
a host that ends with its parent."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kernels_bench import harness

READY_DEADLINE_S = 120.0
"""How long the servers may take to say they serve: 5 TensorFlow imports at once on 2 cores."""
STOP_GRACE_S = 10.0
"""How long the servers have to exit on SIGTERM before they are killed."""
POLL_S = 0.1

_DISPATCHER_READY = re.compile(r"serving the tf\.data service at grpc://localhost:(\d+)")
_WORKER_READY = re.compile(r"serving tf\.data service work at localhost:\d+ \(port (\d+)\)")


def free_loopback_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env() -> dict[str, str]:
    """The environment of a process a benchmark starts: TensorFlow quiet, no GPU, and this
    checkout first on `PYTHONPATH`."""
    return {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(harness.REPO_DIR), os.environ.get("PYTHONPATH")])
        ),
    }


class Servers:
    """The tf.data service processes this script starts: dispatchers and workers on loopback,
    each a `python -m feedpipe service` process whose output goes to a log file (never a pipe a
    hung server could hold). `stop()` ends every one of them by PID."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._env = child_env()

    def start(self, role: str, args: list[str]) -> subprocess.Popen:
        """Starts `python -m feedpipe service ROLE ARGS`; `wait_serving` waits for it."""
        with self._lock:
            log = self.logs / f"{role}-{len(self.processes)}.log"
            with open(log, "w") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "feedpipe", "service", role, *args],
                    cwd=harness.REPO_DIR,
                    env=self._env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            process.log = log  # type: ignore[attr-defined]
            process.role = role  # type: ignore[attr-defined]
            self.processes.append(process)
            return process

    def clusters(self, worker_counts: tuple[int, ...]) -> dict[int, str]:
        """Starts one dispatcher per entry with that many workers, all at once, and waits until
        every one serves; returns each cluster's `grpc://localhost:PORT` by worker count."""
        addresses, started = {}, []
        for count in worker_counts:
            port = free_loopback_port()
            addresses[count] = f"grpc://localhost:{port}"
            started.append(self.start("dispatcher", ["--port", str(port)]))
            worker_args = ["--dispatcher", f"localhost:{port}", "--port", "0"]
            worker_args += ["--worker-address", "localhost:%port%"]
            started += [self.start("worker", worker_args) for _ in range(count)]
        self.wait_serving(started)
        return addresses

    def wait_serving(self, started: list[subprocess.Popen]) -> None:
        """Waits until each of `started` says it serves, up to `READY_DEADLINE_S`."""
        ready = {"dispatcher": _DISPATCHER_READY, "worker": _WORKER_READY}
        deadline = time.monotonic() + READY_DEADLINE_S
        waiting = list(started)
        while waiting:
            for process in list(waiting):
                if ready[process.role].search(process.log.read_text(errors="replace")):
                    waiting.remove(process)
                elif process.poll() is not None:
                    raise RuntimeError(
                        f"`feedpipe service` (pid {process.pid}) exited with "
                        f"{process.returncode} before serving:\n{_tail(process)}"
                    )
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(
                    f"`feedpipe service` did not serve within {READY_DEADLINE_S:.0f} s:\n"
                    + "\n".join(_tail(p) for p in waiting)
                )
            time.sleep(POLL_S)

    def pids(self, role: str) -> list[int]:
        """The process ids of the servers of `role`, in the order they were started."""
        return [p.pid for p in self.processes if p.role == role]  # type: ignore[attr-defined]

    def cpu_s(self, role: str) -> float:
        """CPU-seconds the servers of `role` ("dispatcher" or "worker") have used."""
        import psutil

        total = 0.0
        for process in self.processes:
            if process.role != role:  # type: ignore[attr-defined]
                continue
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(process.pid).cpu_times()
                total += times.user + times.system
        return total

    def stop(self) -> None:
        """SIGTERM to every server still running, SIGKILL to any left after the grace; waits
        for each. Idempotent."""
        with self._lock:
            running = [p for p in self.processes if p.poll() is None]
            for process in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGKILL)
                    process.wait()


def _tail(process: subprocess.Popen) -> str:
    return process.log.read_text(errors="replace")[-2000:]  # type: ignore[attr-defined]


@contextlib.contextmanager
def deadline(seconds: float, servers: Servers) -> Iterator[None]:
    """Past `seconds`, stops every server and ends this process (exit 2): a read blocked inside
    TensorFlow cannot be interrupted otherwise."""

    def expire() -> None:
        print(
            f"data_service: the run passed --deadline-s={seconds:.0f}; stopping every server "
            "started and exiting.",
            file=sys.stderr,
            flush=True,
        )
        servers.stop()
        os._exit(2)

    timer = threading.Timer(seconds, expire)
    timer.name = "data-service-deadline"
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def exit_with_parent(parent: int) -> None:
    """Ends this host once the process that started it is gone (however it ended)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def kill_tree(process: subprocess.Popen) -> None:
    """Kills `process` and every process it started, each by its PID (psutil checks that a
    PID still names the process it listed before signalling it)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    if process.poll() is None:
        process.kill()
    process.wait()
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


class Relay:
    """Prints the new lines of a host's log that start with `prefix` (its progress)."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix, self.offset = path, prefix, 0

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                text = log.read()
        except OSError:
            return
        complete = text[: text.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(self.prefix):
                print(f"  {line}", flush=True)
