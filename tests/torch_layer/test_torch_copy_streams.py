"""The CUDA staging protocol of the PyTorch layer, on the CPU: torch's CUDA stream and event API
replaced by recorders, so that what the stager and the batch ask of it can be checked where no
GPU is (the copies themselves are CPU copies; tests/gpu checks them on a real GPU).

Promised: each device's regions are copied inside that device's own stream, an event is recorded
on that stream after them and waited for before the slot returns; when the batch is handed to the
consumer, the consumer's current stream on each device waits for that event (no other), and every
tensor of the batch is marked as used by that stream (`record_stream`), so torch's allocator does
not give its memory to a later copy while a step still reads it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import feedpipe as fp
from feedpipe.torch import layer as torch_layer
from tests.worker_fakes import index_pairs


class Log:
    """What the fakes were asked, in order."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.current: FakeStream | None = None


class FakeStream:
    def __init__(self, log: Log, name: str):
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.calls.append(("wait_event", self.name, event.number))

    def synchronize(self) -> None:
        self.log.calls.append(("stream_synchronize", self.name))


class FakeEvent:
    made = 0

    def __init__(self, log: Log, blocking: bool):
        FakeEvent.made += 1
        self.log, self.number, self.blocking = log, FakeEvent.made, blocking

    def record(self, stream: FakeStream) -> None:
        self.log.calls.append(("record", stream.name, self.number))

    ready = True
    """What `query` answers: the copies before the event are done."""

    def query(self) -> bool:
        self.log.calls.append(("query", self.number))
        return self.ready

    def synchronize(self) -> None:
        self.log.calls.append(("synchronize", self.number))


@pytest.fixture
def fake_cuda(monkeypatch):
    """The layer takes its two CPU devices for CUDA ones, with torch's stream API recorded."""
    log = Log()
    made = iter(range(100))

    @contextlib.contextmanager
    def stream(s):
        log.current = s
        log.calls.append(("enter", s.name))
        yield
        log.calls.append(("leave", s.name))
        log.current = None

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream(log, f"copy{next(made)}"))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda blocking=False: FakeEvent(log, blocking))
    consumers = {}
    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device: consumers.setdefault(device, FakeStream(log, "consumer")),
    )
    marked = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marked.append((t, s.name)))
    original_init = torch_layer.TorchLayer.__init__

    def as_cuda(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cuda = self.accelerated = True
        self.page_lock = None

    monkeypatch.setattr(torch_layer.TorchLayer, "__init__", as_cuda)
    return log, marked


def test_copies_run_on_each_devices_own_stream_and_the_consumer_waits_for_them(fake_cuda):
    log, marked = fake_cuda
    with fp.Feeder(index_pairs(16), 8, devices=["cpu", "cpu"], framework="torch") as feeder:
        loop = iter(feeder)
        batch = next(loop)
        calls = list(log.calls)
        loop.close()
    staged = [c for c in calls if c[0] in ("enter", "leave", "record", "query")]
    # The pattern's masks are made first, once, each on its device's own stream; then, per
    # device, the batch's copies (its mask's too) inside that stream, then an event on it.
    made, first = staged[:4], staged[4:12]
    assert [c[0] for c in made] == ["enter", "leave"] * 2
    assert [c[0] for c in first] == ["enter", "leave", "record"] * 2 + ["query"] * 2
    assert first[0][1] == first[1][1] == first[2][1] != first[3][1]
    assert first[3][1] == first[4][1] == first[5][1]
    events = [first[2][2], first[5][2]]
    assert [c[1] for c in first[6:]] == events  # the slot returns after its own copies
    waits = [c for c in calls if c[0] == "wait_event"]
    assert waits[:2] == [("wait_event", "consumer", e) for e in events]
    # The masks, made once per pattern, are copied on the same own streams, waited for there.
    copy_streams = {first[0][1], first[3][1]}
    assert {c[1] for c in made} == copy_streams
    assert {c[1] for c in calls if c[0] == "stream_synchronize"} == copy_streams
    leaves = [t for replica in batch.replicas for t in replica] + list(batch.masks)
    assert len(marked) >= len(leaves)
    assert all(name == "consumer" for _, name in marked)
    assert {id(t) for t in leaves} <= {id(t) for t, _ in marked}


def test_the_batches_are_exact_through_the_stream_path(fake_cuda):
    with fp.Feeder(index_pairs(20), 8, devices=["cpu", "cpu"], framework="torch") as feeder:
        got = [
            int(v)
            for batch in feeder
            for (_, y), mask in zip(batch.replicas, batch.masks, strict=True)
            for v in y[mask].tolist()
        ]
        assert feeder.stats().copies >= 3  # and any staged ahead of the next loop
    assert got == list(range(20))
    assert np.all(np.diff(got) == 1)


def test_a_copy_not_done_within_its_expected_time_is_slept_on_rather_than_polled(
    fake_cuda, monkeypatch
):
    log, _ = fake_cuda
    monkeypatch.setattr(FakeEvent, "ready", False)  # the copies never report done by a query
    with fp.Feeder(index_pairs(16), 8, devices=["cpu", "cpu"], framework="torch") as feeder:
        loop = iter(feeder)
        next(loop)
        calls = list(log.calls)
        loop.close()
    events = {c[2] for c in calls if c[0] == "record"}
    slept = [c[1] for c in calls if c[0] == "synchronize"]
    assert set(slept) == events, "each event is slept on once its poll gives up"
    for event in events:
        polls = [c for c in calls if c == ("query", event)]
        assert 1 <= len(polls) < 10_000, "polled for about the copy's time, not forever"
