"""`feedpipe service`: TensorFlow's tf.data service servers as processes on loopback, serving a
job exactly once, surviving a lost worker, refusing what cannot work, and leaving nothing."""

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

import psutil
import pytest
import tensorflow as tf

from tests.service_cluster import REPO_ROOT, SERVED_STOP_GRACE_S, service_cluster

pytestmark = pytest.mark.slow  # tf.data service servers and `feedpipe service` processes

EXPECTED = list(range(0, 200, 2))
READ_DEADLINE_S = 30.0
"""How long a job of 100 elements may take on loopback (it takes well under a second)."""
LAUNCH_DEADLINE_S = 60.0
"""How long a launch that fails may take: TensorFlow's import, several at once on two cores."""


def served(address: str) -> tf.data.Dataset:
    """The test job: `range(100).map(x * 2)`, split among the workers as they ask for work."""
    dataset = tf.data.Dataset.range(100).map(lambda x: x * 2)
    return dataset.apply(tf.data.experimental.service.distribute("distributed_epoch", address))


class Reader:
    """Reads a dataset in a thread, so that a test waits for it under a deadline, not forever."""

    def __init__(self, dataset: tf.data.Dataset):
        self.elements: list[int] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(
            target=self._read, args=(dataset,), name="service-reader", daemon=True
        ).start()

    def _read(self, dataset: tf.data.Dataset) -> None:
        try:
            for element in dataset.as_numpy_iterator():
                self.elements.append(int(element))
        except Exception as error:
            self.error = error
        finally:
            self.ended.set()

    def wait_for(self, count: int, deadline_s: float = READ_DEADLINE_S) -> list[int]:
        """The elements read once there are `count`, the job ended, or `deadline_s` passed."""
        deadline = time.monotonic() + deadline_s
        while len(self.elements) < count and not self.ended.is_set():
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return list(self.elements)


def test_two_workers_serve_each_element_exactly_once(tmp_path):
    with service_cluster(2, tmp_path, stop_grace_s=SERVED_STOP_GRACE_S) as cluster:
        reader = Reader(served(cluster.address))
        assert reader.ended.wait(READ_DEADLINE_S), f"the job did not end: {reader.elements}"
    assert reader.error is None
    assert sorted(reader.elements) == EXPECTED
    # The helper stopped them with SIGTERM, which a server answers by exiting 0.
    assert [p.returncode for p in cluster.processes] == [0, 0, 0]


def test_a_killed_worker_leaves_the_others_serving_a_new_job_exactly_once(tmp_path):
    with service_cluster(2, tmp_path) as cluster:
        lost = cluster.workers[0]
        interrupted = Reader(served(cluster.address))
        assert len(interrupted.wait_for(10)) >= 10
        cluster.kill_worker(lost.pid)
        reader = Reader(served(cluster.address))
        elements = reader.wait_for(len(EXPECTED))
        assert sorted(elements) == EXPECTED, f"error: {reader.error}"
        # TensorFlow's dispatcher keeps the lost worker's task in every job until a worker
        # serves at its address again: only then can the jobs end.
        cluster.add_worker(port=cluster.ports[lost.pid])
        assert reader.ended.wait(READ_DEADLINE_S) and interrupted.ended.wait(READ_DEADLINE_S)
    assert reader.error is None
    assert sorted(reader.elements) == EXPECTED


@contextlib.contextmanager
def listening_socket():
    """A port on loopback that something listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def closed_port() -> int:
    """A loopback port that nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_launch_errors_exit_2_naming_the_argument_and_the_fix(tmp_path):
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    dispatcher_port = int(dispatcher.target.rsplit(":", 1)[1])
    unreachable = closed_port()
    with listening_socket() as held:
        launches = {
            "a port held by a socket": (
                ["dispatcher", "--port", str(held)],
                rf"`--port`={held}: the port is in use here; use another port",
            ),
            # gRPC shares a port with a server that set SO_REUSEPORT: without the check a
            # second dispatcher would start on it without a word.
            "a running dispatcher's port": (
                ["dispatcher", "--port", str(dispatcher_port)],
                rf"`--port`={dispatcher_port}: the port is in use here",
            ),
            "a dispatcher address without a port": (
                ["worker", "--dispatcher", "localhost"],
                r"`--dispatcher`='localhost' is not HOST:PORT .*; give it as localhost:5050",
            ),
            "no dispatcher at the address": (
                ["worker", "--dispatcher", f"localhost:{unreachable}", "--wait-s", "1"],
                rf"`--dispatcher`=localhost:{unreachable}: nothing answered there within 1 s; "
                r"start the dispatcher first",
            ),
            "fault tolerance without a work dir": (
                ["dispatcher", "--port", "0", "--fault-tolerant"],
                r"`--fault-tolerant` .* add `--work-dir DIR`",
            ),
        }
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        launched = {}
        for i, (name, (args, _)) in enumerate(launches.items()):
            with open(tmp_path / f"{i}.log", "w") as log:
                launched[name] = subprocess.Popen(
                    [sys.executable, "-m", "feedpipe", "service", *args],
                    cwd=REPO_ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + LAUNCH_DEADLINE_S
        try:
            for name, process in launched.items():
                try:
                    codes[name] = process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[name] = None  # still running: it did not refuse
        finally:
            for process in launched.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
    dispatcher.stop()
    for i, (name, (_, message)) in enumerate(launches.items()):
        output = (tmp_path / f"{i}.log").read_text()
        assert codes[name] == 2, f"{name}: exit {codes[name]}\n{output}"
        assert re.search(message, output), f"{name}:\n{output}"
        assert "Traceback" not in output, f"{name}:\n{output}"


def test_no_server_process_is_left_when_the_test_fails(tmp_path):
    with (
        pytest.raises(RuntimeError, match="the test failed"),
        service_cluster(1, tmp_path) as cluster,
    ):
        interrupted = cluster.add_worker()
        interrupted.send_signal(signal.SIGINT)
        assert interrupted.wait(timeout=10) == 0, cluster.log(interrupted)
        cluster.kill_dispatcher()
        raise RuntimeError("the test failed")
    dispatcher, worker, _ = cluster.processes
    assert dispatcher.returncode == -signal.SIGKILL
    assert worker.returncode == 0, cluster.log(worker)  # SIGTERM, its dispatcher gone
    left = []
    for process in cluster.processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(f"{process.pid} ({psutil.Process(process.pid).status()})")
    assert not left
