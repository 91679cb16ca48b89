"""Warm workers: a feeder gives its healthy worker processes back at `close()`, the next feeder
adopts them with nothing of the previous one left in them, a killed one is never reused, idle
ones are capped and end by themselves, and none outlives the process, SIGKILL included."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import os
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import psutil
import pytest

import feedpipe as fp
from feedpipe.core import _arrays, auto, env, warm
from feedpipe.core._shm import NAME_PATTERN
from feedpipe.core.cost import SampleCost, Setting
from tests import worker_fakes as wf
from tests.conftest import wait_for_no_feedpipe_threads
from tests.fakes import all_ids
from tests.test_worker_faults import run_isolated, wait_gone

GLOBAL_BATCH = 8


@pytest.fixture(autouse=True)
def warm_on(monkeypatch):
    """Warm workers on (the other tests keep them off), and none left for the leak check."""
    monkeypatch.setenv(env.WARM_WORKERS, "4")
    warm.release()
    yield
    warm.release()


def worker_pids(feeder) -> list[int]:
    return list(feeder._assembly.workers.pids)


def batches(feeder) -> list[tuple[list[int], list[int]]]:
    """Each batch's ids and second fields, in order."""
    got = []
    for batch in feeder:
        ids, values = [], []
        for replica in batch.replicas:
            ids += np.asarray(replica[0]).reshape(len(replica[1]), -1)[:, 0].tolist()
            values += np.asarray(replica[1]).tolist()
        got.append((ids, values))
    return got


def feed(source, devices, workers=2, **options):
    return fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=workers, **options)


def mapped_shared_memory(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split(maxsplit=5)[-1].strip() for line in maps if NAME_PATTERN.search(line)]


def test_a_second_feeder_adopts_the_workers_of_the_first(devices):
    with feed(wf.IndexSource(64), devices) as first:
        next(iter(first))
        pids = worker_pids(first)
    assert sorted(warm.idle_pids()) == sorted(pids)
    with feed(wf.IndexSource(64), devices) as second:
        next(iter(second))
        assert sorted(worker_pids(second)) == sorted(pids)
        assert warm.idle_pids() == []


def test_a_different_source_in_adopted_workers_gives_exact_batches(devices):
    with feed(wf.HeldArraySource(96, 64), devices) as first:
        list(first)
        pids = worker_pids(first)
    source = wf.PidSource(64)
    with feed(source, devices, workers=0, shuffle=True) as reference:
        expected = [ids for ids, _ in batches(reference)]
    with feed(source, devices, shuffle=True) as second:
        got = batches(second)
        assert sorted(worker_pids(second)) == sorted(pids)
    assert [ids for ids, _ in got] == expected
    assert {pid for _, values in got for pid in values} == set(pids)


def test_an_adopted_worker_holds_nothing_of_the_previous_feeder(devices):
    with feed(wf.MarkedSource(64), devices) as first:
        list(first)
        pids = worker_pids(first)
    for pid in pids:  # its host slots, status rows and shared arrays are unmapped
        assert mapped_shared_memory(pid) == []
    with feed(wf.LeftoverProbe(64), devices) as second:
        held = [value for _, values in batches(second) for value in values]
        assert sorted(worker_pids(second)) == sorted(pids)
    assert held == [0] * 64


def test_a_worker_that_keeps_its_source_is_not_given_back(devices):
    # The worker that reads sample 3 keeps its source alive in a module; the other lets go.
    with feed(wf.ActionSource(64, at=3, action="keep"), devices) as feeder:
        list(feeder)
        pids = worker_pids(feeder)
    kept = warm.idle_pids()
    assert len(kept) == 1 and kept[0] in pids
    assert wait_gone([pid for pid in pids if pid not in kept])[0] == []


def test_adopted_workers_import_no_framework(devices):
    with feed(wf.IndexSource(64), devices) as first:
        list(first)
    with feed(wf.FrameworkProbe(64), devices) as second:
        loaded = [value for _, values in batches(second) for value in values]
    assert loaded == [0] * 64


def test_a_killed_adopted_worker_is_not_given_back(devices):
    with feed(wf.IndexSource(64), devices) as first:
        next(iter(first))
        pids = worker_pids(first)
    second = feed(wf.IndexSource(6400), devices)
    stream = iter(second)
    next(stream)
    assert sorted(worker_pids(second)) == sorted(pids)
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(fp.WorkerError, match=f"pid {pids[0]}"):
        for _ in stream:
            pass
    second.close()
    assert warm.idle_pids() == [pids[1]]
    with feed(wf.IndexSource(64), devices, workers=0) as reference:
        expected = [ids for ids, _ in batches(reference)]
    with feed(wf.IndexSource(64), devices) as third:
        got = [ids for ids, _ in batches(third)]
        assert pids[1] in worker_pids(third) and pids[0] not in worker_pids(third)
    assert got == expected


def test_large_arrays_give_exact_batches_and_leave_no_shared_memory(devices):
    source = wf.HeldArraySource(512, 64 * 1024)  # 32 MiB, sent once to both workers
    with feed(source, devices, workers=0, shuffle=True) as reference:
        expected = batches(reference)
    with feed(source, devices, shuffle=True) as feeder:
        got = [(ids, values) for ids, values in batches(feeder)]
        rows = next(iter(feeder)).replicas[0][0]
        pids = worker_pids(feeder)
    assert got == expected
    assert all((np.asarray(rows) == np.asarray(rows)[:, :1]).all(axis=1))
    for pid in pids:
        assert mapped_shared_memory(pid) == []


def test_idle_workers_are_capped(devices, monkeypatch):
    monkeypatch.setenv(env.WARM_WORKERS, "1")
    with feed(wf.IndexSource(64), devices) as feeder:
        next(iter(feeder))
        pids = worker_pids(feeder)
    kept = warm.idle_pids()
    assert len(kept) == 1 and kept[0] in pids
    assert wait_gone([pid for pid in pids if pid not in kept])[0] == []


def test_idle_workers_end_after_the_idle_time(devices, monkeypatch):
    monkeypatch.setenv(env.WARM_IDLE_S, "0.3")
    monkeypatch.setattr(warm, "EXIT_MARGIN_S", 0.2)
    with feed(wf.IndexSource(64), devices) as feeder:
        next(iter(feeder))
        pids = worker_pids(feeder)
    assert sorted(warm.idle_pids()) == sorted(pids)
    running, waited_s = wait_gone(pids)
    assert running == [] and waited_s < 3.0
    assert warm.idle_pids() == []


def test_warm_workers_off_ends_every_worker_with_its_feeder(devices, monkeypatch):
    monkeypatch.setenv(env.WARM_WORKERS, "0")
    with feed(wf.IndexSource(64), devices) as feeder:
        next(iter(feeder))
        pids = worker_pids(feeder)
    assert warm.idle_pids() == []
    assert wait_gone(pids)[0] == []


@pytest.mark.parametrize(
    ("variable", "value", "match"),
    [
        (env.WARM_WORKERS, "many", "FEEDPIPE_WARM_WORKERS='many' must be a whole number of"),
        (env.WARM_IDLE_S, "-1", "FEEDPIPE_WARM_IDLE_S='-1' must be a number of seconds > 0"),
    ],
)
def test_a_bad_setting_is_refused_by_name(devices, monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=match):
        fp.warm_workers(2)


def test_workers_started_ahead_are_adopted(devices):
    pids = fp.warm_workers(2)
    assert len(pids) == 2
    with feed(wf.IndexSource(64), devices) as feeder:
        next(iter(feeder))
        assert sorted(worker_pids(feeder)) == sorted(pids)
    with pytest.raises(ValueError, match="`count`=-1 must be a number of processes >= 0"):
        fp.warm_workers(-1)


def test_auto_workers_adopt_warm_workers_and_give_the_batches_of_workers0(devices, monkeypatch):
    monkeypatch.setattr(auto, "TRIAL_S", 0.01)
    monkeypatch.setattr(auto, "TRIAL_BATCHES", 2)
    monkeypatch.setattr(auto, "WARM_BATCHES", 1)
    monkeypatch.setattr(
        SampleCost,
        "settings",
        lambda self, target=math.inf, at_least_one=False: [Setting("process", 2, 1e9)],
    )
    pids = fp.warm_workers(2)
    source = wf.SlowSource(96, 0.001)
    with feed(source, devices, workers=0, shuffle=True) as reference:
        expected = [all_ids(batch) for _ in range(3) for batch in reference]
    with feed(source, devices, workers="auto", shuffle=True) as feeder:
        got = [all_ids(batch) for _ in range(3) for batch in feeder]
        assert ("process", 2) in feeder._assembly.producer.measured
    assert got == expected
    assert sorted(warm.idle_pids()) == sorted(pids)


@pytest.mark.slow
def test_no_worker_outlives_a_trainer_killed_with_sigkill():
    reports, returncode = run_isolated(
        """
        os.environ["FEEDPIPE_WARM_WORKERS"] = "8"
        first = fp.Feeder(wf.IndexSource(64), 4, devices=DEVICES, workers=2)
        next(iter(first))
        first.close()  # two idle workers
        fp.warm_workers(3)  # one more, started ahead
        ahead = threading.Thread(target=fp.warm_workers, args=(4,))  # one from another thread
        ahead.start()
        ahead.join()
        feeder = fp.Feeder(wf.IndexSource(64), 4, devices=DEVICES, workers=2)
        next(iter(feeder))  # two adopted and serving, two idle
        pids = [
            child.pid for child in psutil.Process().children()
            if "feedpipe.core._worker" in child.cmdline()
        ]
        report("parent", pids=pids)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert returncode == -signal.SIGKILL
    pids = reports["parent"]["pids"]
    assert len(pids) == 4
    running, waited_s = wait_gone(pids)
    assert running == [], f"workers {running} outlived their parent by {waited_s:.1f} s"
    assert waited_s < 2.0


def test_workers_started_ahead_end_with_their_idle_time(monkeypatch):
    monkeypatch.setenv(env.WARM_IDLE_S, "0.3")
    monkeypatch.setattr(warm, "EXIT_MARGIN_S", 0.2)
    started = time.monotonic()
    pids = fp.warm_workers(2)
    running, _ = wait_gone(pids)
    assert running == []
    assert time.monotonic() - started >= 0.5
    assert warm.idle_pids() == []


def test_idle_workers_are_started_from_any_thread(devices):
    thread = threading.Thread(target=fp.warm_workers, args=(2,))
    thread.start()
    thread.join()
    pids = warm.idle_pids()
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    with feed(wf.IndexSource(64), devices) as feeder:
        assert len(list(feeder)) == 8
        assert sorted(worker_pids(feeder)) == sorted(pids)


def shared_arrays(pids: list[int]) -> set[str]:
    return {path for pid in pids for path in mapped_shared_memory(pid) if "-data-" in path}


def test_a_second_feeder_over_the_same_arrays_maps_the_kept_copy(devices):
    source = wf.HeldArraySource(256, 4096)
    with feed(source, devices) as first:
        list(first)
        copied = shared_arrays(worker_pids(first))
    assert len(copied) == 1 and _arrays.kept_nbytes() >= source.rows.nbytes
    with feed(source, devices, workers=0, shuffle=True) as reference:
        expected = batches(reference)
    with feed(source, devices, shuffle=True) as second:
        got = batches(second)
        assert shared_arrays(worker_pids(second)) == copied
    assert got == expected
    warm.release()
    assert _arrays.kept_nbytes() == 0


def test_arrays_changed_between_feeders_are_copied_again(devices):
    source = wf.HeldArraySource(256, 4096)
    with feed(source, devices) as first:
        list(first)
        copied = shared_arrays(worker_pids(first))
    source.rows[5] = 999
    with feed(source, devices, workers=0) as reference:
        expected = [(ids, rows) for ids, rows in rows_of(reference)]
    with feed(source, devices) as second:
        got = [(ids, rows) for ids, rows in rows_of(second)]
        assert shared_arrays(worker_pids(second)).isdisjoint(copied)
    assert got == expected
    assert 999 in {value for _, rows in got for value in rows}


def test_read_only_arrays_give_exact_batches(devices):
    source = wf.HeldArraySource(256, 4096)
    source.rows.flags.writeable = False
    with feed(source, devices) as first:
        list(first)
    with feed(source, devices, workers=0) as reference:
        expected = rows_of(reference)
    with feed(source, devices) as second:
        assert rows_of(second) == expected


def edit_through_the_base(source: wf.HeldArraySource) -> None:
    """The source's rows become a read-only view; row 5 is then written through its base."""
    base = source.rows
    source.rows = base.view()
    source.rows.flags.writeable = False
    yield
    base[5] = -1


def edit_between_flags(source: wf.HeldArraySource) -> None:
    """The source's rows are read-only; row 5 is written with the flag switched on and off."""
    source.rows.flags.writeable = False
    yield
    source.rows.flags.writeable = True
    source.rows[5] = -1
    source.rows.flags.writeable = False


@pytest.mark.parametrize("edit", [edit_through_the_base, edit_between_flags])
def test_read_only_arrays_edited_between_feeders_give_the_batches_of_workers0(devices, edit):
    source = wf.HeldArraySource(256, 4096)
    editing = edit(source)
    next(editing)
    with feed(source, devices) as first:
        list(first)
    next(editing, None)
    assert not source.rows.flags.writeable and (source.rows[5] == -1).all()
    with feed(source, devices, workers=0) as reference:
        expected = rows_of(reference)
    with feed(source, devices) as second:
        got = rows_of(second)
    assert got == expected
    assert -1 in {value for _, rows in got for value in rows}


def test_arrays_over_bytes_are_handed_over_without_a_comparison(devices):
    source = wf.HeldArraySource(256, 4096)
    source.rows = np.frombuffer(source.rows.tobytes(), np.int64).reshape(source.rows.shape)
    with feed(source, devices) as first:
        list(first)
        copied = shared_arrays(worker_pids(first))
    with feed(source, devices, workers=0) as reference:
        expected = rows_of(reference)
    with feed(source, devices) as second:
        got = rows_of(second)
        assert shared_arrays(worker_pids(second)) == copied
    assert got == expected
    assert _arrays.current()._view is None  # the kept copy was never mapped to compare


def test_no_copy_is_kept_with_warm_workers_off(devices, monkeypatch):
    monkeypatch.setenv(env.WARM_WORKERS, "0")
    with feed(wf.HeldArraySource(256, 4096), devices) as feeder:
        list(feeder)
    assert _arrays.kept_nbytes() == 0


def rows_of(feeder) -> list[tuple[list[int], list[int]]]:
    """Each batch's ids and the value each row's features are filled with (-1: not one)."""
    got = []
    for batch in feeder:
        ids, firsts = [], []
        for replica in batch.replicas:
            flat = np.asarray(replica[0]).reshape(len(replica[1]), -1)
            firsts += np.where((flat == flat[:, :1]).all(axis=1), flat[:, 0], -1).tolist()
            ids += np.asarray(replica[1]).tolist()
        got.append((ids, firsts))
    return got


def test_an_adopted_worker_sees_the_working_directory_and_environment_of_now(
    devices, monkeypatch, tmp_path
):
    with feed(wf.IndexSource(64), devices) as first:
        list(first)
        pids = worker_pids(first)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "offset.txt").write_text("1000")
    monkeypatch.setenv("FEEDPIPE_TEST_OFFSET", "7")
    with feed(wf.PlaceProbe(64), devices) as second:
        values = {value for _, values in batches(second) for value in values}
        assert sorted(worker_pids(second)) == sorted(pids)
    assert values == {1007}


def test_arrays_written_in_several_files_read_as_one_give_exact_batches(devices, monkeypatch):
    monkeypatch.setattr(_arrays, "PART_BYTES", 1 << 20)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    source = wf.HeldArraySource(255, 12344)  # ~3 MB in 3 files: rows lie across them
    assert len(_arrays.parts(source.rows.nbytes)) == 3
    with feed(source, devices, workers=0, shuffle=True) as reference:
        expected = rows_of(reference)
    with feed(source, devices, shuffle=True) as feeder:
        got = rows_of(feeder)
        assert len(shared_arrays(worker_pids(feeder))) == 3
    assert got == expected


@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 5 << 20, (64 << 20) * 3 + 17])
def test_the_copy_is_split_into_whole_pages_one_file_a_thread(total):
    sizes = _arrays.parts(total)
    assert sum(sizes) == total and all(size > 0 for size in sizes[:-1])
    assert all(size % 4096 == 0 for size in sizes[:-1])
    assert len(sizes) <= max(1, min(len(os.sched_getaffinity(0)), _arrays.MAX_PARTS))


def test_a_worker_whose_source_imported_a_framework_is_not_reused(devices):
    with feed(wf.ImportingSource(64, "jax"), devices) as first:
        list(first)
        pids = worker_pids(first)
    assert warm.idle_pids() == []
    assert wait_gone(pids)[0] == []


MODULE = """
import os

import numpy as np

SCALE = int(os.environ.get("FEEDPIPE_TEST_SCALE", "1"))


class Source:
    \"\"\"Sample i is (i, i * {factor} * SCALE).\"\"\"

    def __len__(self):
        return 32

    def __getitem__(self, index):
        return np.int64(index), np.int64(index * {factor} * SCALE)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes the module `name` (sample i is (i, i * factor)) into a folder on `sys.path`, as
    a user's own file, and forgets it after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, factor: int):
        (tmp_path / f"{name}.py").write_text(MODULE.format(factor=factor))
        importlib.invalidate_caches()
        written.append(name)

    yield write
    for name in written:
        sys.modules.pop(name, None)


def values_of(feeder) -> list[int]:
    return [value for _, values in batches(feeder) for value in values]


def test_an_edited_and_reloaded_module_is_not_run_by_a_warm_worker(devices, user_module):
    user_module("edited_source", factor=1)
    module = importlib.import_module("edited_source")
    with feed(module.Source(), devices) as first:
        assert values_of(first)[:4] == [0, 1, 2, 3]
        pids = worker_pids(first)
    assert sorted(warm.idle_pids()) == sorted(pids)
    user_module("edited_source", factor=100)
    importlib.reload(module)
    assert module.Source()[3][1] == 300
    with feed(module.Source(), devices, workers=0) as reference:
        expected = values_of(reference)
    with feed(module.Source(), devices) as second:
        got = values_of(second)
        assert set(worker_pids(second)).isdisjoint(pids)  # fresh workers
    assert got == expected
    assert got[:4] == [0, 100, 200, 300]


def test_a_module_reloaded_without_an_edit_is_not_run_by_a_warm_worker(
    devices, user_module, monkeypatch
):
    user_module("reloaded_source", factor=1)
    module = importlib.import_module("reloaded_source")
    with feed(module.Source(), devices) as first:
        list(first)
        pids = worker_pids(first)
    monkeypatch.setenv("FEEDPIPE_TEST_SCALE", "100")  # read when the module runs
    importlib.reload(module)
    with feed(module.Source(), devices, workers=0) as reference:
        expected = values_of(reference)
    with feed(module.Source(), devices) as second:
        got = values_of(second)
        assert set(worker_pids(second)).isdisjoint(pids)
    assert got == expected
    assert got[:4] == [0, 100, 200, 300]


LAZY_MODULE = """
import importlib
import importlib.util


class Source:
    \"\"\"Sample i is the module {inner}'s sample i, that module imported where the sample is
    made: the training process never imports it.\"\"\"

    def __len__(self):
        return 32

    def __getitem__(self, index):
        return importlib.import_module("{inner}").Source()[index]
"""


def test_an_edited_module_that_only_the_workers_imported_is_not_run_by_a_warm_worker(
    devices, user_module, tmp_path
):
    user_module("imported_by_workers", factor=1)
    (tmp_path / "importing_source.py").write_text(LAZY_MODULE.format(inner="imported_by_workers"))
    module = importlib.import_module("importing_source")
    with feed(module.Source(), devices) as first:
        list(first)
        pids = worker_pids(first)
    assert "imported_by_workers" not in sys.modules
    user_module("imported_by_workers", factor=100)
    with feed(module.Source(), devices) as second:
        got = values_of(second)
        assert set(worker_pids(second)).isdisjoint(pids)
    with feed(module.Source(), devices, workers=0) as reference:
        assert values_of(reference) == got
    assert got[:4] == [0, 100, 200, 300]
    sys.modules.pop("importing_source")


def test_an_unchanged_module_is_run_by_the_warm_workers(devices, user_module):
    user_module("unchanged_source", factor=1)
    module = importlib.import_module("unchanged_source")
    with feed(module.Source(), devices) as first:
        expected = values_of(first)
        pids = worker_pids(first)
    with feed(module.Source(), devices) as second:
        got = values_of(second)
        assert sorted(worker_pids(second)) == sorted(pids)
    assert got == expected


def test_a_dataset_of_a_collected_feeder_leaves_no_thread(devices):
    source = wf.HeldArraySource(256, 4096)
    feeder = feed(source, devices)
    for _ in feeder.as_dataset().take(2):
        pass
    del feeder
    gc.collect()
    assert wait_for_no_feedpipe_threads() == []
    assert _arrays.kept_nbytes() >= source.rows.nbytes  # kept: memory alone, no thread
    fp.release()
    assert _arrays.kept_nbytes() == 0


def test_release_ends_the_idle_workers_and_the_kept_copy_at_once(devices):
    source = wf.HeldArraySource(256, 4096)
    with feed(source, devices) as feeder:
        list(feeder)
        pids = worker_pids(feeder)
    assert sorted(warm.idle_pids()) == sorted(pids) and _arrays.kept_nbytes() > 0
    fp.release()
    assert warm.idle_pids() == [] and _arrays.kept_nbytes() == 0
    assert wait_gone(pids)[0] == []


def test_a_kept_copy_older_than_the_idle_time_is_not_handed_over(devices, monkeypatch):
    source = wf.HeldArraySource(256, 4096)
    with feed(source, devices) as first:
        list(first)
        copied = shared_arrays(worker_pids(first))
    with monkeypatch.context() as later:
        later.setattr(time, "monotonic", lambda: math.inf)  # the idle time has passed
        assert _arrays.kept_nbytes() == 0
    with feed(source, devices) as second:
        assert shared_arrays(worker_pids(second)).isdisjoint(copied)


def test_a_lazily_imported_module_is_not_loaded_by_a_feeder(devices, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lazy_user_module.py").write_text("import os\nos.environ['LAZY_RAN'] = '1'\n")
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("lazy_user_module")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lazy_user_module", module)
    spec.loader.exec_module(module)
    monkeypatch.delenv("LAZY_RAN", raising=False)
    with feed(wf.IndexSource(64), devices) as feeder:
        list(feeder)
    assert "LAZY_RAN" not in os.environ


def test_a_worker_that_imported_a_module_from_a_zip_file_is_not_adopted(
    devices, tmp_path, monkeypatch
):
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as zipped:  # no file of its own to prove unchanged
        zipped.writestr("zipped_source.py", MODULE.format(factor=1))
    monkeypatch.syspath_prepend(str(archive))
    module = importlib.import_module("zipped_source")
    try:
        with feed(module.Source(), devices) as first:
            expected = values_of(first)
            pids = worker_pids(first)
        with feed(module.Source(), devices) as second:
            assert values_of(second) == expected
            assert set(worker_pids(second)).isdisjoint(pids)
    finally:
        sys.modules.pop("zipped_source")


def test_a_worker_is_not_adopted_once_the_import_path_changes(devices, user_module, monkeypatch):
    user_module("path_source", factor=1)
    module = importlib.import_module("path_source")
    with feed(module.Source(), devices) as first:
        list(first)
        pids = worker_pids(first)
    monkeypatch.syspath_prepend(str(Path(module.__file__).parent / "elsewhere"))
    with feed(module.Source(), devices) as second:
        list(second)
        assert set(worker_pids(second)).isdisjoint(pids)
