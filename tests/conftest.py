"""Shared test setup: four logical CPU devices (TensorFlow's, where it is installed, and JAX's),
a MirroredStrategy over TensorFlow's, a GPU marker, Ctrl-C handled as in a terminal, and a leak
check that fails any test leaving a `feedpipe*` thread, worker process or shared-memory segment
behind.

It imports no framework of its own accord: `tests/core` and `tests/jax_layer` run where TensorFlow
is not installed (the CI's JAX step), and the rest import TensorFlow themselves.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib.util
import os
import signal
import threading
import time

NUM_CPU_DEVICES = 4
LEAK_WAIT_S = 2.0

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # Ctrl-C raises KeyboardInterrupt here and in the processes the tests start, as in a
    # terminal's Python: a shell starts a background job (`pytest ... &`) with SIGINT ignored,
    # its children inherit that, and the Ctrl-C tests would then test nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Every worker ends with its feeder, as the leak check expects; tests/test_warm_workers.py turns
# warm workers on where it tests them, and ends them before the check.
os.environ.setdefault("FEEDPIPE_WARM_WORKERS", "0")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # JAX reads it when its CPU backend starts, after this.
    flag = f"--xla_force_host_platform_device_count={NUM_CPU_DEVICES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import psutil  # noqa: E402  (after XLA_FLAGS is set)
import pytest  # noqa: E402

from feedpipe.core._shm import NAME_PATTERN, SHM_DIR  # noqa: E402

HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
if HAS_TENSORFLOW:
    import tensorflow as tf

    from tests.fakes import configure_logical_cpus

    configure_logical_cpus(NUM_CPU_DEVICES)
    HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
else:
    # Without TensorFlow (the GPU machines carry JAX alone), an NVIDIA device node says so.
    HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*"))


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real GPU; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def devices() -> list[str]:
    """The four logical CPU devices, as device strings."""
    return [f"/cpu:{i}" for i in range(NUM_CPU_DEVICES)]


@pytest.fixture(params=["gathered", "handed over"])
def as_dataset_path(request, monkeypatch) -> str:
    """Both ways `as_dataset()` serves arrays: gathered by TensorFlow's own threads (arrays in
    memory) and handed over from the feeder's thread (every other source), for the tests of
    promises that either must keep."""
    if request.param == "handed over":
        monkeypatch.setattr("feedpipe.tf.feeder.GATHER_MAX_BYTES", -1)
    return request.param


@pytest.fixture(scope="session")
def strategy(devices):
    """A MirroredStrategy with one replica per logical CPU device."""
    return tf.distribute.MirroredStrategy(devices)


def feedpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedpipe") and t.is_alive()]


def wait_for_no_feedpipe_threads(timeout_s: float = LEAK_WAIT_S) -> list[str]:
    """The feedpipe threads still alive after collecting garbage and waiting up to timeout_s.

    Collecting garbage can only end threads (a collected feeder closes itself), so when none is
    alive there is nothing to collect for: a full collection costs ~0.1 s with TF loaded.
    """
    if not feedpipe_threads():
        return []
    gc.collect()
    deadline = time.monotonic() + timeout_s
    while (alive := feedpipe_threads()) and time.monotonic() < deadline:
        time.sleep(0.02)
        gc.collect()
    return alive


def feedpipe_processes() -> list[str]:
    """This process's live worker processes, as `name (pid)`."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = child.cmdline()
            if "feedpipe.core._worker" in cmdline and child.status() != psutil.STATUS_ZOMBIE:
                name = cmdline[cmdline.index("feedpipe.core._worker") + 1]
                found.append(f"{name} (pid {child.pid})")
    return found


def feedpipe_memory() -> list[str]:
    """This process's descriptors and mappings of feedpipe shared memory (memfds included),
    matched by the buffers' exact names, not by a path that merely holds `feedpipe-`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if NAME_PATTERN.search(target):
                found.append(f"fd {fd}: {target}")
    with open("/proc/self/maps") as maps:
        found += [line.split(maxsplit=5)[-1].strip() for line in maps if NAME_PATTERN.search(line)]
    return found


def feedpipe_segments() -> list[str]:
    """Shared-memory files of this process (none should ever outlive a call)."""
    return sorted(p.name for p in SHM_DIR.glob(f"feedpipe-{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_feedpipe_thread_left():
    """Fails the test if any `feedpipe*` thread, worker process or segment outlives it."""
    yield
    alive = wait_for_no_feedpipe_threads()
    if alive:
        pytest.fail(f"feedpipe threads still alive after the test: {alive}", pytrace=False)
    deadline = time.monotonic() + LEAK_WAIT_S
    while (procs := feedpipe_processes()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    if procs:
        pytest.fail(f"feedpipe worker processes still alive after the test: {procs}", pytrace=False)
    if feedpipe_segments():
        pytest.fail(f"shared-memory segments left: {feedpipe_segments()}", pytrace=False)
    if feedpipe_memory():
        gc.collect()  # only when something is open: a collection per test costs seconds in all
        if feedpipe_memory():
            pytest.fail(f"shared memory still open or mapped: {feedpipe_memory()}", pytrace=False)
