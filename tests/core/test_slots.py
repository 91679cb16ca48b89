"""Slots: regions are aligned and disjoint, and host slots are reused only once nothing made
from them is alive."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import numpy as np
import pytest

from feedpipe.core._shm import SHM_DIR
from feedpipe.core._sync import Stopped
from feedpipe.core.machine import available_host_bytes
from feedpipe.core.slots import (
    ALIGN_BYTES,
    HostSlot,
    SlotLayout,
    SlotPool,
    check_host_memory,
)
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit


def spec() -> SampleSpec:
    return SampleSpec.of(
        {"a": np.zeros((3,), np.float32), "b": np.int8(0), "c": np.zeros((2, 2), np.float64)}
    )


@pytest.mark.parametrize("contiguous", [False, True])
def test_every_region_is_aligned_and_disjoint(contiguous):
    layout = SlotLayout(spec(), ReplicaSplit(6, 3), contiguous=contiguous)
    slot = HostSlot(layout)
    assert slot.buffer.ctypes.data % ALIGN_BYTES == 0
    spans = []
    for replica in slot.regions:
        for region in replica:
            start = region.ctypes.data - slot.buffer.ctypes.data
            if not contiguous:
                assert region.ctypes.data % ALIGN_BYTES == 0
            spans.append((start, start + region.nbytes))
            assert start + region.nbytes <= layout.nbytes
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert layout.batch_bytes == spec().row_bytes * 6


def test_contiguous_layout_has_whole_batch_views_over_the_replica_regions():
    layout = SlotLayout(spec(), ReplicaSplit(6, 3), contiguous=True)
    slot = HostSlot(layout)
    for row in range(6):
        slot.row(0, row)[...] = row
    whole = layout.global_views(slot.buffer)
    assert whole[0].shape == (6, 3)
    np.testing.assert_array_equal(whole[0][:, 0], np.arange(6))
    with pytest.raises(ValueError, match="contiguous"):
        SlotLayout(spec(), ReplicaSplit(6, 3)).global_views(slot.buffer)


def test_write_rows_crosses_replica_boundaries():
    layout = SlotLayout(SampleSpec.of(np.int64(0)), ReplicaSplit(6, 3))
    slot = HostSlot(layout)
    slot.write_rows(1, [np.arange(100, 110)], 2, 4)  # rows 102..105 to global rows 1..4
    flat = np.concatenate([replica[0] for replica in slot.regions])
    assert flat[1:5].tolist() == [102, 103, 104, 105]


def test_pad_repeats_the_real_rows_in_order():
    layout = SlotLayout(SampleSpec.of((np.zeros(2, np.float32), np.int64(0))), ReplicaSplit(8, 4))
    slot = HostSlot(layout)
    slot.write_rows(0, [np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(3)], 0, 3)
    slot.pad(3)
    labels = np.concatenate([replica[1] for replica in slot.regions])
    assert labels.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    features = np.concatenate([replica[0] for replica in slot.regions])
    np.testing.assert_array_equal(features[3:6], features[:3])


def small_pool(capacity=2) -> SlotPool:
    return SlotPool(SlotLayout(SampleSpec.of(np.int64(0)), ReplicaSplit(2, 1)), capacity)


def test_pool_allocates_at_most_its_capacity():
    pool = small_pool(2)
    stop = threading.Event()
    slots = [pool.take(stop) for _ in range(2)]
    assert all(slot is not None for slot in slots)
    assert pool.take(stop) is None
    assert pool.allocated == 2 and pool.overflow_allocations == 0
    stop.set()
    with pytest.raises(Stopped):
        pool.take(stop)
    del slots


def test_an_overflow_slot_is_dropped_not_pooled():
    pool = small_pool(1)
    stop = threading.Event()
    pool.take(stop)
    extra = pool.overflow()
    assert extra.overflow and pool.overflow_allocations == 1 and pool.allocated == 1
    pool.give_back(extra)
    assert pool._free == [], "an overflow slot is dropped, not pooled"


def test_a_slot_comes_back_only_when_every_view_of_its_lease_is_gone():
    pool = small_pool(1)
    stop = threading.Event()
    slot = pool.take(stop)
    leased = slot.lease(pool.give_back)
    view = slot.layout.views(leased)[0][0]
    del leased
    gc.collect()
    assert pool._free == [], "a live view must keep the slot out of the pool"
    view = view[1:]  # a view of a view keeps it too
    gc.collect()
    assert pool._free == []
    del view
    gc.collect()
    assert pool._free == [slot]
    assert pool.take(stop) is slot
    assert pool.allocated == 1


def test_a_wait_ends_when_a_slot_is_given_back_or_the_pool_is_woken():
    pool = small_pool(1)
    stop = threading.Event()
    slot = pool.take(stop)
    threading.Timer(0.1, pool.give_back, args=(slot,)).start()
    started = time.monotonic()
    pool.wait(30.0)
    assert time.monotonic() - started < 10.0, "the give-back did not end the wait"
    assert pool.take(stop) is slot
    pool.wake()  # before the wait: the wait still ends at once
    started = time.monotonic()
    pool.wait(30.0)
    assert time.monotonic() - started < 10.0


def test_the_host_memory_available_is_read_from_the_system():
    available, where = available_host_bytes(shared=False)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < available <= total
    assert where


def small_dev_shm(monkeypatch, nbytes: int) -> None:
    """The shared-memory directory reports `nbytes` free, as Docker's default 64 MiB /dev/shm
    does once a little of it is used."""
    statvfs = os.statvfs

    def reported(path):
        if os.fspath(path) != os.fspath(SHM_DIR):
            return statvfs(path)
        real = statvfs(path)
        return os.statvfs_result((*real[:4], nbytes // real.f_frsize, *real[5:]))

    monkeypatch.setattr(os, "statvfs", reported)


def test_slots_shared_with_workers_are_checked_against_memory_not_a_small_dev_shm(monkeypatch):
    """Slots shared with worker processes are memfds: memory, never /dev/shm's space. A small
    /dev/shm refuses none that the memory holds."""
    small_dev_shm(monkeypatch, 2**20)
    assert os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize == 2**20
    available, where = available_host_bytes(shared=True)
    assert available > 2**20 and str(SHM_DIR) not in where
    layout = SlotLayout(SampleSpec.of(np.zeros(1024, np.float32)), ReplicaSplit(1024, 4))
    check_host_memory(layout, 2, shared=True)  # 8 MiB of slots


def test_slots_larger_than_the_memory_available_are_refused_naming_the_size_and_the_fix(
    monkeypatch,
):
    monkeypatch.setattr(
        "feedpipe.core.slots.available_host_bytes", lambda shared: (10 * 2**20, "MemAvailable")
    )
    layout = SlotLayout(SampleSpec.of(np.zeros(1024, np.float32)), ReplicaSplit(1024, 4))
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size`=1024 needs 16\.0 MiB of host memory: 4 slots of 4\.0 MiB "
        r"\(1024 rows of 4096 bytes\) and 32 bytes a row of bookkeeping, but only 10\.0 MiB "
        r"is available \(MemAvailable\); use a `global_batch_size` of at most 636",
    ):
        check_host_memory(layout, 4, shared=False)
    check_host_memory(layout, 2, shared=False)  # 8 MiB fit
