"""Hand-off: at most `depth` batches wait, a full ring is refilled from half-empty, and the
hand-off measures its own waits and occupancy."""

from __future__ import annotations

import threading
import time
import types

import pytest

from feedpipe.core import handoff as module
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import EpochEnd


def a_batch(num_valid: int = 4):
    return types.SimpleNamespace(num_valid=num_valid)


@pytest.mark.parametrize("depth", [1, 2, 4, 8])
def test_a_full_ring_wakes_its_producer_once_half_of_it_is_taken(depth, monkeypatch):
    monkeypatch.setattr(module, "WAIT_SLICE_S", 30.0)  # only a wake-up call ends its wait
    handoff = module.Handoff(depth, StatsRecorder(depth), on_starve=lambda: None)
    stop, woken = threading.Event(), threading.Event()
    for _ in range(depth):
        handoff.put(a_batch(), is_batch=True)

    def producer():
        handoff.wait_for_room(stop)
        woken.set()

    thread = threading.Thread(target=producer, name="test-producer", daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    while not handoff._producer_waiting and time.monotonic() < deadline:
        time.sleep(0.001)  # until the producer waits for room
    consumer = threading.current_thread()
    for taken in range(1, depth + 1):
        handoff.get(consumer, stop)
        if depth - taken > depth // 2:  # more than half still staged: the producer sleeps on
            assert not woken.wait(0.05)
        else:
            assert woken.wait(5.0)
            break
    thread.join(5.0)
    assert taken == depth - depth // 2


def test_the_hand_off_measures_the_consumers_waits_and_the_occupancy_it_found():
    stats = StatsRecorder(2)
    handoff = module.Handoff(2, stats, on_starve=lambda: None)
    stop, consumer = threading.Event(), threading.current_thread()
    handoff.put(a_batch(4), is_batch=True)
    handoff.put(a_batch(3), is_batch=True)
    handoff.get(consumer, stop)  # found 2 staged
    handoff.get(consumer, stop)  # found 1
    late = threading.Timer(0.2, handoff.put, args=(a_batch(2),), kwargs={"is_batch": True})
    late.start()
    handoff.get(consumer, stop)  # found none, waited for the late batch
    handoff.put(EpochEnd(0), is_batch=False)
    handoff.get(consumer, stop)
    snapshot = stats.snapshot()
    assert snapshot.steps == 3
    assert snapshot.samples == 9
    assert snapshot.mean_occupancy == pytest.approx(1.0)  # (2 + 1 + 0) / 3
    assert snapshot.consumer_wait_s >= 0.15  # the late batch came after 0.2 s


def test_the_hand_off_measures_the_producers_wait_for_room():
    stats = StatsRecorder(1)
    handoff = module.Handoff(1, stats, on_starve=lambda: None)
    stop, consumer = threading.Event(), threading.current_thread()
    handoff.put(a_batch(), is_batch=True)
    threading.Timer(0.2, handoff.get, args=(consumer, stop)).start()
    handoff.wait_for_room(stop)  # the ring is full until the take, 0.2 s later
    assert stats.snapshot().producer_wait_s >= 0.15
