"""Worker faults: an error in user code, a worker that dies or hangs, a parent that dies, and
bad input, each reaching the consumer as an error it can act on, in bounded time, with no
process, thread or shared memory left behind.

Scenarios that kill or hang a process run in a fresh interpreter with a hard deadline
(`run_isolated`), so a hang fails the test instead of freezing the suite; the interpreter
prints its measured figures as JSON and the test asserts on them. Those tests are marked
`slow`: each interpreter loads TensorFlow, seconds apiece on a small machine.
"""

from __future__ import annotations

import contextlib
import functools
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
from feedpipe.core._shm import SHM_DIR
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
from feedpipe.core._shm import SHM_DIR
from tests import worker_fakes as wf

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker's SIGSEGV must not dump core
DEVICES = ["/cpu:0"]

def worker_pids():
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
            if "feedpipe.core._worker" in cmdline and child.status() != psutil.STATUS_ZOMBIE:
                found[cmdline[cmdline.index("feedpipe.core._worker") + 1]] = child.pid
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
    with pytest.raises(wf.SourceBroke):  # every later read raises the same error again
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
        feeder = fp.Feeder(wf.SlowSource(400, 0.01), 4, devices=DEVICES, workers=2)
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("death", list(DEATHS))
def test_after_a_worker_death_close_is_quick_and_leaves_nothing(deaths, death):
    got = deaths[death]
    assert got["close_s"] < 5.0
    assert got["processes_left"] == {}
    assert got["threads_left"] == []
    assert got["segments_left"] == []
    assert wait_gone(got["pids"])[0] == []


@pytest.fixture(scope="module")
def unmappable() -> dict:
    """Workers whose address space cannot hold a host slot of 32 samples of 1 MiB."""
    reports, _ = run_isolated(
        """
        import errno
        feeder = fp.Feeder(wf.AddressSpaceLimited(64), 32, devices=DEVICES, workers=2)
        pids = worker_pids()
        ids, asked, raised, error = take_until_error(feeder)
        report(
            "ENOMEM", ids=ids, error_s=raised - asked,
            errno=errno.errorcode.get(getattr(error, "errno", None)), **described(error),
            **closed_and_cleaned(feeder, list(pids.values())),
        )
        """
    )
    return reports["ENOMEM"]


@pytest.mark.slow
def test_a_worker_that_cannot_map_a_host_slot_raises_its_os_error_with_errno_and_fix(unmappable):
    got = unmappable
    assert got["type"] == "OSError"
    assert got["errno"] == "ENOMEM"
    assert got["message"].startswith("[Errno 12] mapping host slot ")
    assert "failed with ENOMEM (Cannot allocate memory)" in got["message"]
    for fix in ("`ulimit -v`", "smaller `depth` or `global_batch_size`", "fewer `workers`"):
        assert fix in got["message"]
    assert "exited with code" not in got["message"]
    named = [pid for pid in got["pids"] if any(f"(pid {pid})" in note for note in got["notes"])]
    assert len(named) == 1, got["notes"]
    assert any("outside any task; it has stopped" in note for note in got["notes"])
    assert got["ids"] == []
    assert got["error_s"] < 2.0, f"{got['error_s']:.2f} s to the error"


@pytest.mark.slow
def test_after_a_worker_cannot_map_a_host_slot_close_leaves_nothing(unmappable):
    got = unmappable
    assert len(got["pids"]) == 2
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    pids = [p.pid for p in psutil.Process().children() if "feedpipe.core._worker" in p.cmdline()]
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


# ---- sources whose arrays are all empty -------------------------------------------------------


EMPTY_SOURCES = {
    # The source and what each batch shows of it: the ids of a map-style source whose only
    # array (an attribute) is empty, the shape of a source that is one array of shape (20, 0).
    "empty attribute": ("wf.EmptyArraySource(20)", "batch.replicas[0][1].numpy().tolist()"),
    "(N, 0) field": ("np.zeros((20, 0), np.float32)", "batch.replicas[0].shape.as_list()"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EMPTY_SOURCES))
def test_a_source_whose_arrays_are_all_empty_delivers_every_sample_with_workers(case):
    source, shown = EMPTY_SOURCES[case]
    reports, _ = run_isolated(
        f"""
        import numpy as np
        feeder = fp.Feeder({source}, 4, devices=DEVICES, workers=2)
        pids = list(worker_pids().values())
        batches = list(feeder)
        report(
            "empty", valid=sum(batch.num_valid for batch in batches),
            shown=[{shown} for batch in batches], **closed_and_cleaned(feeder, pids),
        )
        """
    )
    got = reports["empty"]
    assert got["valid"] == 20
    if case == "empty attribute":
        assert [i for ids in got["shown"] for i in ids] == list(range(20))
    else:
        assert got["shown"] == [[4, 0]] * 5
    assert len(got["pids"]) == 2
    assert got["processes_left"] == {}
    assert got["segments_left"] == []
    assert wait_gone(got["pids"])[0] == []


# ---- every error keeps its type ---------------------------------------------------------------


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_an_os_error_in_a_worker_keeps_its_type_message_and_note(devices, worker_mode):
    feeder = fp.Feeder(
        wf.OSErrorSource(32, 13), GLOBAL_BATCH, devices=devices, workers=2, worker_mode=worker_mode
    )
    delivered, _, error = take_until_error(feeder)

    assert type(error) is FileNotFoundError
    assert error.filename == "/data/13.npy"
    assert "index 13 of epoch 0" in notes(error)
    assert delivered == [list(range(8))]


def test_an_os_error_while_a_worker_loads_the_source_is_raised_at_construction(devices):
    with pytest.raises(FileNotFoundError) as raised:
        fp.Feeder(wf.FailsOnLoad(32), GLOBAL_BATCH, devices=devices, workers=2)
    assert "while loading the source and transform" in notes(raised.value)
    assert wait_gone([])[0] == []
    assert feedpipe_processes() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stop_iteration_from_a_source_is_named_with_its_sample(devices, workers):
    feeder = fp.Feeder(
        wf.StopIterationSource(32, 13), GLOBAL_BATCH, devices=devices, workers=workers
    )
    delivered, _, error = take_until_error(feeder)

    assert type(error) is RuntimeError
    assert "StopIteration('no more rows')" in str(error)
    assert "IndexError" in str(error)
    assert "index 13 of epoch 0" in notes(error)
    assert delivered == [list(range(8))]


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt, wf.Custom])
@pytest.mark.parametrize("timeout_s", [None, 1.0])
def test_a_base_exception_in_a_thread_worker_reaches_the_consumer_with_its_type(
    devices, kind, timeout_s
):
    feeder = fp.Feeder(
        wf.RaisingBaseException(32, 13, kind),
        GLOBAL_BATCH,
        devices=devices,
        workers=2,
        worker_mode="thread",
        timeout_s=timeout_s,
    )
    got: dict = {}

    def consume():
        try:
            got["ids"] = [real_ids(batch) for batch in feeder]
        except BaseException as error:
            got["error"] = error

    consumer = threading.Thread(target=consume, name="test-consumer", daemon=True)
    consumer.start()
    consumer.join(10.0)
    feeder.close()
    assert not consumer.is_alive(), "the consumer still waits: the worker's error was lost"
    assert type(got.get("error")) is kind
    assert str(got["error"]) == "raised at sample 13"
    assert "index 13 of epoch 0" in notes(got["error"])


@pytest.fixture(scope="module")
def script_errors() -> dict[str, dict]:
    """An exception class defined in the user's script, raised by a source defined there."""
    reports, _ = run_isolated(
        """
        class ScriptError(Exception):
            pass

        class ScriptSource:
            def __len__(self):
                return 32

            def __getitem__(self, index):
                if index == 13:
                    raise ScriptError(f"sample {index} is broken")
                return wf.index_sample(index)

        feeder = fp.Feeder(ScriptSource(), 8, devices=DEVICES, workers=2)
        try:
            list(feeder)
            report("script", caught=False, **described(None))
        except ScriptError as error:
            report("script", caught=True, **described(error))
        except Exception as error:
            report("script", caught=False, **described(error))
        """
    )
    return reports


@pytest.mark.slow
def test_an_exception_class_defined_in_the_script_keeps_its_class(script_errors):
    got = script_errors["script"]
    assert got["caught"], f"arrived as {got['type']}: {got['message']}"
    assert got["type"] == "ScriptError"
    assert got["message"] == "sample 13 is broken"


# ---- sample 0 is read by a worker -------------------------------------------------------------


def test_sample_zero_is_read_by_a_worker_not_the_training_process(devices):
    with fp.Feeder(
        wf.NotInTheTrainingProcess(32), GLOBAL_BATCH, devices=devices, workers=2
    ) as feeder:
        assert [i for batch in feeder for i in real_ids(batch)] == list(range(32))


def test_a_source_that_opens_its_file_on_first_use_is_sent_to_workers(devices, tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * 16)
    source = wf.LazyFileSource(32, str(path))
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        assert [i for batch in feeder for i in real_ids(batch)] == list(range(32))
    assert source.file is None  # never read here


@pytest.fixture(scope="module")
def first_sample_faults() -> dict[str, dict]:
    """Sample 0 crashes a worker; sample 0 hangs with timeout_s=1; the source hangs while a
    worker loads it, with timeout_s=1."""
    reports, _ = run_isolated(
        """
        cases = {
            "segv": dict(source=wf.ActionSource(64, 0, "segv")),
            "hang": dict(source=wf.ActionSource(64, 0, "hang"), timeout_s=1),
            "load": dict(source=wf.HangsOnLoad(64), timeout_s=1),
        }
        for name, case in cases.items():
            started = time.monotonic()
            try:
                fp.Feeder(case["source"], 4, devices=DEVICES, workers=2,
                          timeout_s=case.get("timeout_s"))
                error = None
            except Exception as raised:
                error = raised
            report(name, error_s=time.monotonic() - started, **described(error),
                   processes_left=worker_pids(), threads_left=feedpipe_threads())
        """
    )
    return reports


@pytest.mark.slow
def test_a_crash_on_sample_zero_is_a_worker_error_not_a_dead_training_process(first_sample_faults):
    got = first_sample_faults["segv"]
    assert got["is_worker_error"], got
    assert "killed by signal 11 (SIGSEGV)" in got["message"]
    assert got["processes_left"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hang", "load"])
def test_a_hang_before_the_first_batch_is_a_timeout_at_construction(first_sample_faults, case):
    got = first_sample_faults[case]
    assert got["type"] == "TimeoutError", got
    assert "feedpipe-worker-0" in got["message"]
    assert "`timeout_s`=1" in got["message"]
    if case == "hang":
        assert "on sample 0 of epoch 0" in got["message"]
    else:
        assert "no progress" in got["message"]
    # ~3 s of start-up (a fresh interpreter per worker) plus the timeout, on a loaded machine.
    assert got["error_s"] < 15.0
    assert got["processes_left"] == {}
    assert got["threads_left"] == []


# ---- liveness: stopped workers, workers stuck in C, thread workers ----------------------------


@pytest.fixture(scope="module")
def stopped() -> dict[str, dict]:
    """A worker frozen (SIGSTOP) while idle, before the first batch's tasks reach it, with
    timeout_s=1: it never starts a sample, so only its silence can name it."""
    reports, _ = run_isolated(
        """
        feeder = fp.Feeder(wf.IndexSource(400), 4, devices=DEVICES, workers=2, timeout_s=1)
        pids = worker_pids()
        frozen_at = time.monotonic()
        os.kill(pids["feedpipe-worker-1"], signal.SIGSTOP)
        ids, asked, raised, error = take_until_error(feeder)
        report("stopped", ids=ids, error_s=raised - frozen_at, **described(error),
               **closed_and_cleaned(feeder, list(pids.values())))
        """
    )
    return reports


@pytest.mark.slow
def test_a_worker_stopped_between_samples_is_a_timeout(stopped):
    got = stopped["stopped"]
    assert got["type"] == "TimeoutError", got
    assert "feedpipe-worker-1" in got["message"]
    assert "no progress" in got["message"]
    assert got["ids"] == []
    assert got["error_s"] < 3.0, f"{got['error_s']:.2f} s to the TimeoutError"
    assert got["processes_left"] == {}
    assert wait_gone(got["pids"])[0] == []


@pytest.mark.slow
@pytest.mark.parametrize("stuck", ["SIGSTOP", "GIL-holding C call"])
def test_a_stuck_worker_dies_with_its_parent(stuck):
    freeze = (
        'os.kill(worker_pids()["feedpipe-worker-0"], signal.SIGSTOP)'
        if stuck == "SIGSTOP"
        else "time.sleep(1.0)  # worker 0 is inside the regex by now"
    )
    source = "wf.IndexSource(64)" if stuck == "SIGSTOP" else "wf.GILHolder(64, 5)"
    reports, returncode = run_isolated(
        f"""
        feeder = fp.Feeder({source}, 4, devices=DEVICES, workers=2)
        batches = iter(feeder)
        next(batches)
        {freeze}
        report("parent", pids=list(worker_pids().values()))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert returncode == -9
    pids = reports["parent"]["pids"]
    assert len(pids) == 2
    running, waited_s = wait_gone(pids)
    assert running == [], f"workers {running} outlived their parent by {waited_s:.1f} s"


def test_a_thread_worker_past_its_timeout_is_reported_promptly_and_ended(devices):
    feeder = fp.Feeder(
        wf.ActionSource(200, 50, "hang"),
        4,
        devices=devices,
        workers=2,
        worker_mode="thread",
        timeout_s=1,
    )
    _, error_s, error = take_until_error(feeder)
    started = time.monotonic()
    feeder.close()
    close_s = time.monotonic() - started

    assert type(error) is TimeoutError
    assert "on sample 50 of epoch 0" in str(error)
    assert error_s < 2.5, f"{error_s:.2f} s to the TimeoutError"
    assert close_s < 1.0, f"close() waited {close_s:.2f} s for the stuck thread"
    assert wait_for_no_feedpipe_threads() == []  # interrupted at its next Python instruction


# ---- Ctrl-C -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interrupted() -> dict[str, dict]:
    """Ctrl-C as a terminal sends it: SIGINT to the training process and to every worker."""
    reports, _ = run_isolated(
        """
        feeder = fp.Feeder(wf.SlowSource(64, 0.002), 4, devices=DEVICES, workers=2)
        pids = worker_pids()
        ids = []
        try:
            for batch in feeder:
                ids.append(int(batch.replicas[0][1].numpy()[0]))
                if len(ids) == 3:
                    for pid in pids.values():
                        os.kill(pid, signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)
        except KeyboardInterrupt:
            interrupted = True
        else:
            interrupted = False
        try:
            rest = [int(batch.replicas[0][1].numpy()[0]) for batch in feeder]
            error = None
        except Exception as raised:
            rest, error = [], raised
        report("ctrl-c", interrupted=interrupted, ids=ids, rest=rest, **described(error),
               **closed_and_cleaned(feeder, list(pids.values())))
        """
    )
    return reports


@pytest.mark.slow
def test_ctrl_c_interrupts_the_loop_and_the_next_loop_goes_on(interrupted):
    got = interrupted["ctrl-c"]
    assert got["interrupted"]
    assert got["type"] == "NoneType", got["message"]
    assert got["ids"] + got["rest"] == list(range(0, 64, 4))
    assert got["processes_left"] == {}


def test_a_second_ctrl_c_during_cleanup_leaves_the_feeder_usable(devices, monkeypatch):
    from feedpipe.core import pipeline as _pipeline

    joined = _pipeline.join_within
    pressed = []

    def interrupted_join(threads, *args, **kwargs):
        if not pressed:
            pressed.append(True)
            raise KeyboardInterrupt  # pressed again while the loop was being cleaned up
        return joined(threads, *args, **kwargs)

    monkeypatch.setattr(_pipeline, "join_within", interrupted_join)
    with fp.Feeder(wf.IndexSource(64), GLOBAL_BATCH, devices=devices) as feeder:
        # Python raises it, or reports it as unraisable when it comes from a loop's cleanup.
        with contextlib.suppress(KeyboardInterrupt):
            for _ in feeder:
                break
        assert pressed
        assert [i for batch in feeder for i in real_ids(batch)] == list(range(GLOBAL_BATCH, 64))


# ---- descriptors ------------------------------------------------------------------------------


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_batches_kept_by_the_consumer_hold_no_file_descriptor(devices):
    with fp.Feeder(wf.IndexSource(800), GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        batches = iter(feeder)
        kept = [next(batches) for _ in range(10)]
        before = open_descriptors()
        kept += [next(batches) for _ in range(60)]
        grown = open_descriptors() - before
        assert feeder.stats().overflow_slots >= 60
        assert grown <= 2, f"{grown} more descriptors for 60 more kept batches"
        del batches, kept


@pytest.mark.slow
def test_many_kept_batches_fit_a_small_descriptor_limit():
    reports, _ = run_isolated(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        feeder = fp.Feeder(wf.IndexSource(4000), 4, devices=DEVICES, workers=2)
        kept, error = [], None
        try:
            for batch in feeder:
                kept.append(batch)
                if len(kept) == 300:
                    break
        except Exception as raised:
            error = raised
        report("kept", count=len(kept), **described(error))
        feeder.close()
        """
    )
    got = reports["kept"]
    assert got["type"] == "NoneType", got["message"]
    assert got["count"] == 300


# ---- a worker that loads TensorFlow -----------------------------------------------------------


def test_a_worker_that_imports_tensorflow_is_named_in_one_warning(devices, tmp_path):
    package = tmp_path / "tensorflow"
    package.mkdir()
    (package / "__init__.py").write_text("")
    transform = functools.partial(wf.import_a_package_named_tensorflow, fake_root=str(tmp_path))
    with (
        pytest.warns(UserWarning) as caught,
        fp.Feeder(
            wf.IndexSource(64), GLOBAL_BATCH, devices=devices, workers=2, transform=transform
        ) as feeder,
    ):
        assert len([batch for batch in feeder]) == 8
    mine = [str(w.message) for w in caught if "imported TensorFlow" in str(w.message)]
    assert len(mine) == 1, mine
    assert mine[0].startswith("feedpipe-worker-")
    assert 'worker_mode="thread"' in mine[0]
    assert "worker_fakes.py" in mine[0]  # the user's code that pulled it in


def test_the_tensorflow_warning_names_user_code_in_a_checkout_named_feedpipe_dash():
    from feedpipe.core import _worker

    assert _worker._passes_imports_along(_worker.__file__)
    assert not _worker._passes_imports_along("/home/me/feedpipe-0.1.0/tests/worker_fakes.py")
    assert not _worker._passes_imports_along("/home/me/feedpipe-0.1.0/.venv/lib/keras/x.py")
