"""Worker faults: an error in user code, a worker that dies or hangs, a parent that dies, and
bad input, each reaching the consumer as an error it can act on, in bounded time, with no
process, thread or shared memory left behind.

Scenarios that kill or hang a process run in a fresh interpreter with a hard deadline
(`run_isolated`), so a hang fails the test instead of freezing the suite; the interpreter
prints its measured figures as JSON and the test asserts on them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import feedpipe as fp
from feedpipe._shm import SHM_DIR
from tests import worker_fakes as wf
from tests.conftest import (
    feedpipe_memory,
    feedpipe_processes,
    feedpipe_segments,
    wait_for_no_feedpipe_threads,
)
from tests.fakes import CountingSource, real_ids

GLOBAL_BATCH = 8
REPO_ROOT = Path(__file__).resolve().parents[1]
ISOLATED_DEADLINE_S = 60.0
"""Hard deadline of one isolated scenario: ~3 s of TensorFlow import plus a few seconds."""
GONE_WAIT_S = 5.0


# ---- helpers ----------------------------------------------------------------------------------


def take_until_error(feeder) -> tuple[list[list[int]], float, BaseException | None]:
    """The real ids of each batch delivered, the seconds from asking for the batch that failed
    to its error, and the error (None if the epoch ended)."""
    delivered: list[list[int]] = []
    batches = iter(feeder)
    while True:
        asked = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return delivered, 0.0, None
        except Exception as error:
            return delivered, time.perf_counter() - asked, error
        delivered.append(real_ids(batch))


def notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie has exited: it only waits to be reaped)."""
    running = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running


def wait_gone(pids: list[int], timeout_s: float = GONE_WAIT_S) -> tuple[list[int], float]:
    """The pids still running after up to `timeout_s`, and the seconds waited."""
    started = time.monotonic()
    while (running := alive(pids)) and time.monotonic() - started < timeout_s:
        time.sleep(0.02)
    return running, time.monotonic() - started


ISOLATED_PRELUDE = """
import json, os, resource, signal, sys, threading, time
import psutil
import feedpipe as fp
from feedpipe._shm import SHM_DIR
from tests import worker_fakes as wf

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker's SIGSEGV must not dump core
DEVICES = ["/cpu:0"]

def worker_pids():
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
            if "feedpipe._worker" in cmdline and child.status() != psutil.STATUS_ZOMBIE:
                found[cmdline[-2]] = child.pid
        except psutil.Error:
            pass
    return found

def feedpipe_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("feedpipe")]

def take_until_error(feeder, on_batch=None):
    ids, batches = [], iter(feeder)
    while True:
        asked = time.monotonic()
        try:
            batch = next(batches)
        except Exception as error:
            return ids, asked, time.monotonic(), error
        ids.append(int(batch.replicas[0][1].numpy()[0]))
        if on_batch is not None:
            on_batch(len(ids))

def described(error):
    return {
        "type": type(error).__name__,
        "is_worker_error": isinstance(error, fp.WorkerError),
        "message": str(error),
        "notes": getattr(error, "__notes__", []),
    }

def closed_and_cleaned(feeder, pids):
    started = time.monotonic()
    feeder.close()
    close_s = time.monotonic() - started
    return {
        "close_s": close_s,
        "processes_left": worker_pids(),
        "threads_left": feedpipe_threads(),
        "segments_left": sorted(p.name for p in SHM_DIR.glob(f"feedpipe-{os.getpid()}-*")),
        "pids": pids,
    }

def report(name, **figures):
    print("REPORT " + json.dumps({"name": name, **figures}), flush=True)
"""


def run_isolated(body: str) -> tuple[dict[str, dict], int]:
    """Runs `body` after `ISOLATED_PRELUDE` in a fresh interpreter with a hard deadline.

    Returns its reports by name and its exit code. Output goes to files, not pipes, so workers
    that outlive the interpreter cannot hold the call open.
    """
    code = ISOLATED_PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            done = subprocess.run(
                [sys.executable, "-c", code],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                timeout=ISOLATED_DEADLINE_S,
            )
            returncode = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode is None:
        pytest.fail(
            f"The scenario did not finish within {ISOLATED_DEADLINE_S:.0f} s (a hang).\n"
            f"stdout:\n{stdout}\nstderr:\n{stderr[-4000:]}"
        )
    reports = {}
    for line in stdout.splitlines():
        if line.startswith("REPORT "):
            figures = json.loads(line.removeprefix("REPORT "))
            reports[figures.pop("name")] = figures
    if not reports:
        pytest.fail(f"The scenario reported nothing (exit code {returncode}).\n{stderr[-4000:]}")
    return reports, returncode


# ---- an exception in user code ----------------------------------------------------------------


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_source_error_reaches_the_consumer_after_every_earlier_batch(devices, worker_mode):
    fail_at = 45  # in batch 5, after five full batches
    feeder = fp.Feeder(
        wf.FailingSource(64, fail_at),
        GLOBAL_BATCH,
        devices=devices,
        workers=2,
        worker_mode=worker_mode,
    )
    delivered, error_s, error = take_until_error(feeder)

    assert type(error) is wf.SourceBroke
    assert str(error) == f"sample {fail_at} is broken"
    assert "feedpipe-worker-" in notes(error)
    assert f"index {fail_at} of epoch 0" in notes(error)
    assert delivered == [list(range(b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH)) for b in range(5)]
    assert error_s < 1.0, f"the error took {error_s:.2f} s to reach the consumer"
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(feeder))
    assert feedpipe_processes() == []
    assert wait_for_no_feedpipe_threads() == []


def test_an_error_that_cannot_be_unpickled_names_its_type_and_message(devices):
    feeder = fp.Feeder(wf.UnpicklableFailingSource(32), GLOBAL_BATCH, devices=devices, workers=2)
    delivered, _, error = take_until_error(feeder)

    assert error is not None
    assert delivered == []  # sample 5 is in the first batch
    assert "UnpicklableError" in str(error)
    assert "left and right" in str(error)
    assert "feedpipe-worker-" in str(error) + notes(error)
    assert "index 5 of epoch 0" in str(error) + notes(error)
    assert feedpipe_processes() == []


# ---- a worker that dies ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deaths() -> dict[str, dict]:
    """A worker killed from outside with SIGKILL, one that exits with code 3, one that
    crashes with SIGSEGV, each in its own feeder; measured in one fresh interpreter."""
    reports, _ = run_isolated(
        """
        feeder = fp.Feeder(wf.SleepySource(400, 0.01), 4, devices=DEVICES, workers=2)
        pids = worker_pids()
        killed = {}

        def kill_worker_0(taken):
            if taken == 3:
                killed["pid"] = pids["feedpipe-worker-0"]
                killed["at"] = time.monotonic()
                os.kill(killed["pid"], signal.SIGKILL)

        ids, asked, raised, error = take_until_error(feeder, kill_worker_0)
        report(
            "SIGKILL", ids=ids, error_s=raised - killed["at"], dead_pid=killed["pid"],
            **described(error), **closed_and_cleaned(feeder, list(pids.values())),
        )
        for action in ("exit", "segv"):
            feeder = fp.Feeder(wf.ActionSource(200, 50, action), 4, devices=DEVICES, workers=2)
            pids = worker_pids()
            ids, asked, raised, error = take_until_error(feeder)
            report(
                action, ids=ids, error_s=raised - asked, **described(error),
                **closed_and_cleaned(feeder, list(pids.values())),
            )
        """
    )
    return reports


DEATHS = {
    "SIGKILL": "killed by signal 9 (SIGKILL)",
    "exit": "exited with code 3",
    "segv": "killed by signal 11 (SIGSEGV)",
}


@pytest.mark.parametrize("death", list(DEATHS))
def test_a_dead_worker_raises_worker_error_naming_pid_and_cause_within_two_seconds(deaths, death):
    got = deaths[death]
    assert got["type"] == "WorkerError"
    assert got["is_worker_error"]
    assert DEATHS[death] in got["message"]
    named = [pid for pid in got["pids"] if f"(pid {pid})" in got["message"]]
    assert len(named) == 1, got["message"]
    if death == "SIGKILL":
        assert named == [got["dead_pid"]]
    # SIGKILL: from the kill; exit and segv: from asking for the batch whose worker died.
    assert got["error_s"] < 2.0, f"{got['error_s']:.2f} s to the WorkerError"
    # The batches before the death arrive in order, none skipped.
    assert got["ids"] == list(range(0, 4 * len(got["ids"]), 4))


@pytest.mark.parametrize("death", list(DEATHS))
def test_after_a_worker_death_close_is_quick_and_leaves_nothing(deaths, death):
    got = deaths[death]
    assert got["close_s"] < 5.0
    assert got["processes_left"] == {}
    assert got["threads_left"] == []
    assert got["segments_left"] == []
    assert wait_gone(got["pids"])[0] == []


# ---- a worker that hangs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hangs() -> dict[str, dict]:
    """A worker hung on sample 50 with timeout_s=1, and one hung on sample 10 without a timeout
    that the main thread closes while a consumer thread waits for it."""
    reports, _ = run_isolated(
        """
        feeder = fp.Feeder(
            wf.ActionSource(200, 50, "hang"), 4, devices=DEVICES, workers=2, timeout_s=1
        )
        pids = worker_pids()
        ids, asked, raised, error = take_until_error(feeder)
        report(
            "timeout", ids=ids, error_s=raised - asked, **described(error),
            **closed_and_cleaned(feeder, list(pids.values())),
        )

        feeder = fp.Feeder(wf.ActionSource(200, 10, "hang"), 4, devices=DEVICES, workers=2)
        pids = worker_pids()
        consumed = {"ids": []}

        def consume():
            try:
                for batch in feeder:
                    consumed["ids"].append(int(batch.replicas[0][1].numpy()[0]))
            except Exception as error:
                consumed["error"] = described(error)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        deadline = time.monotonic() + 20
        while len(consumed["ids"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # the consumer now waits for the batch of sample 10, which never comes
        stuck = consumer.is_alive() and len(consumed["ids"]) == 2
        figures = closed_and_cleaned(feeder, list(pids.values()))
        consumer.join(5)
        report(
            "no timeout", stuck=stuck, ids=consumed["ids"],
            consumer_ended=not consumer.is_alive(), consumer_error=consumed.get("error"),
            **figures,
        )
        """
    )
    return reports


def test_a_hung_worker_raises_timeout_error_naming_worker_and_sample(hangs):
    got = hangs["timeout"]
    assert got["type"] == "TimeoutError"
    assert "feedpipe-worker-" in got["message"]
    assert "on sample 50 of epoch 0" in got["message"]
    assert "`timeout_s`=1" in got["message"]
    assert got["ids"] == list(range(0, 48, 4))
    timeout_s = 1.0
    assert got["error_s"] < timeout_s + 1.0, f"{got['error_s']:.2f} s to the TimeoutError"
    assert got["close_s"] < 5.0
    assert got["processes_left"] == {}
    assert got["threads_left"] == []
    assert wait_gone(got["pids"])[0] == []


def test_close_ends_a_hung_worker_within_five_seconds(hangs):
    got = hangs["no timeout"]
    assert got["stuck"], "the worker was not hung when close() was called"
    assert got["ids"] == [0, 4]
    assert got["close_s"] < 5.0
    assert got["processes_left"] == {}
    assert got["threads_left"] == []
    assert got["consumer_ended"], "the consumer thread still waits after close()"
    # The interrupted loop raises: it must not look like the end of the epoch.
    assert got["consumer_error"] is not None
    assert wait_gone(got["pids"])[0] == []


# ---- the parent dies --------------------------------------------------------------------------


@pytest.mark.parametrize("death", ["os._exit(0)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_workers_exit_when_the_parent_process_dies(death):
    reports, returncode = run_isolated(
        f"""
        feeder = fp.Feeder(wf.IndexSource(64), 4, devices=DEVICES, workers=2)
        next(iter(feeder))  # both workers are up and serving
        report("parent", pids=list(worker_pids().values()))
        {death}
        """
    )
    assert returncode in (0, -9)
    pids = reports["parent"]["pids"]
    assert len(pids) == 2
    running, waited_s = wait_gone(pids)
    assert running == [], f"workers {running} outlived their parent by {waited_s:.1f} s"
    assert waited_s < 2.0


# ---- nothing is left behind -------------------------------------------------------------------


def _end_a_feeder(devices, ending: str) -> list[int]:
    """Builds a feeder with two worker processes, ends it by `ending`, and drops it."""
    source = wf.FailingSource(64, 20) if ending == "exception" else wf.IndexSource(64)
    feeder = fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2)
    pids = [p.pid for p in psutil.Process().children() if "feedpipe._worker" in p.cmdline()]
    if ending == "close":
        next(iter(feeder))
        feeder.close()
    elif ending == "del":
        batches = iter(feeder)
        next(batches)
        del batches
    elif ending == "break":
        for _ in feeder:
            break
    elif ending == "exception":
        with pytest.raises(wf.SourceBroke):
            list(feeder)
    del feeder
    return pids


@pytest.mark.parametrize("ending", ["close", "del", "break", "exception"])
def test_no_process_thread_or_shared_memory_left_after_the_feeder_ends(devices, ending):
    pids = _end_a_feeder(devices, ending)
    gc.collect()
    assert len(pids) == 2
    assert wait_gone(pids)[0] == []
    assert feedpipe_processes() == []
    assert wait_for_no_feedpipe_threads() == []
    assert feedpipe_segments() == []
    assert feedpipe_memory() == []


def test_an_early_break_stops_the_thread_and_keeps_the_workers_for_the_next_loop(devices):
    with fp.Feeder(wf.IndexSource(64), GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        for _ in feeder:
            break
        assert wait_for_no_feedpipe_threads() == []
        assert len(feedpipe_processes()) == 2
        assert [i for batch in feeder for i in real_ids(batch)] == list(range(GLOBAL_BATCH, 64))
    assert feedpipe_processes() == []


# ---- shared-memory files of a dead owner ------------------------------------------------------


def test_segments_of_a_dead_owner_are_removed_at_the_next_start(devices):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    assert not psutil.pid_exists(finished.pid)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    orphan = SHM_DIR / f"feedpipe-{finished.pid}-slot-0"
    kept = SHM_DIR / f"feedpipe-{living.pid}-slot-0"
    try:
        orphan.write_bytes(b"\0" * 64)
        kept.write_bytes(b"\0" * 64)
        with fp.Feeder(wf.IndexSource(8), GLOBAL_BATCH, devices=devices, workers=1):
            assert not orphan.exists()
            assert kept.exists()
    finally:
        orphan.unlink(missing_ok=True)
        kept.unlink(missing_ok=True)
        living.kill()
        living.wait()


# ---- bad input --------------------------------------------------------------------------------


def test_an_unpicklable_source_is_a_type_error_at_construction(devices):
    source = CountingSource(16)  # holds a threading.Lock
    with pytest.raises(TypeError, match=r"^`source` cannot be sent to worker processes.*lock"):
        fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2)
    assert feedpipe_processes() == []


def test_an_unpicklable_transform_is_a_type_error_at_construction(devices):
    lock = threading.Lock()

    def guarded(sample):
        with lock:
            return sample

    with pytest.raises(TypeError, match=r"^`transform` cannot be sent to worker processes.*lock"):
        fp.Feeder(wf.IndexSource(16), GLOBAL_BATCH, devices=devices, workers=2, transform=guarded)
    assert feedpipe_processes() == []


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_sample_of_another_shape_names_field_index_and_both_shapes(devices, worker_mode):
    feeder = fp.Feeder(
        wf.WrongShapeAt(32, 13),
        GLOBAL_BATCH,
        devices=devices,
        workers=2,
        worker_mode=worker_mode,
    )
    delivered, _, error = take_until_error(feeder)

    assert type(error) is ValueError
    assert str(error).startswith(
        "Field [0] of sample 13 has shape (4,) and dtype float32, but the first sample had "
        "shape (3,) and dtype float32"
    )
    assert delivered == [list(range(8))]


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_a_transform_returning_another_structure_names_both_structures(devices, worker_mode):
    def drop_label_of_11(sample):
        return wf.drop_label(sample) if int(sample[1]) == 11 else sample

    feeder = fp.Feeder(
        wf.IndexSource(32),
        GLOBAL_BATCH,
        devices=devices,
        workers=2,
        worker_mode=worker_mode,
        transform=drop_label_of_11,
    )
    delivered, _, error = take_until_error(feeder)

    assert type(error) is ValueError
    assert str(error).startswith(
        "Sample 11 has structure PyTreeSpec(*), but the first sample had PyTreeSpec((*, *))"
    )
    assert delivered == [list(range(8))]
