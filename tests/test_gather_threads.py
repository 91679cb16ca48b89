"""Arrays gathered in threads, through the feeder (`feedpipe.core.gather`; the producer's own
guarantees are in tests/core/test_parallel_gather.py): the batches, their order and the state of
`workers=0`'s one thread, `describe()` saying how many threads and why, none left at `close()`."""

from __future__ import annotations

import itertools

import numpy as np
import optree
import pytest

import feedpipe as fp
from feedpipe.core import env
from feedpipe.core import gather as gather_module
from tests.conftest import feedpipe_threads
from tests.core.test_parallel_gather import arrays


@pytest.fixture
def threads(monkeypatch):
    """Sets the gather threads of the feeders built next, however small their batches."""
    monkeypatch.setattr(gather_module, "MIN_RANGE_BYTES", 1)

    def use(count: int) -> None:
        monkeypatch.setenv(env.GATHER_THREADS, str(count))

    return use


def batches(feeder, count=None) -> list[list[np.ndarray]]:
    """Every leaf of every replica of the next `count` batches (an epoch where None)."""
    return [
        [np.asarray(leaf) for replica in batch.replicas for leaf in optree.tree_leaves(replica)]
        + [np.asarray(mask) for mask in batch.masks]
        for batch in itertools.islice(feeder, count)
    ]


def assert_same(got, expected):
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_a_feeder_gathering_in_threads_gives_workers_0s_batches(devices, threads):
    source = arrays("dict")
    options = {"devices": devices, "shuffle": True, "seed": 5}
    threads(1)
    with fp.Feeder(source, 24, **options) as feeder:
        assert feeder.describe().gather_threads == 1
        expected = [batches(feeder) for _ in range(2)]
    threads(3)
    with fp.Feeder(source, 24, **options) as feeder:
        described = feeder.describe()
        assert (described.gather_threads, described.slots.count) == (3, 5)
        assert "FEEDPIPE_GATHER_THREADS=3" in described.gather_chosen
        for epoch in expected:
            assert_same(batches(feeder), epoch)


def test_a_state_taken_mid_epoch_resumes_the_same_batches(devices, threads):
    source = arrays("tuple")
    threads(1)
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        expected = batches(feeder, 20)
    threads(2)
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        assert_same(batches(feeder, 5), expected[:5])
        state = feeder.get_state()
    with fp.Feeder(source, 16, devices=devices, shuffle=True) as feeder:
        feeder.set_state(state)
        assert_same(batches(feeder, 15), expected[5:])


def test_a_re_iterated_feeder_gathers_what_workers_0_gives(devices, threads):
    source = arrays("array")
    runs = []
    for count in (1, 3):
        threads(count)
        with fp.Feeder(source, 16, devices=devices) as feeder:
            runs.append(batches(feeder, 3) + batches(feeder) + batches(feeder, 2))
    assert_same(runs[1], runs[0])


def test_closing_while_a_batch_is_gathered_leaves_no_thread(devices, threads):
    threads(2)
    feeder = fp.Feeder(arrays("array", length=4096), 512, devices=devices, shuffle=True)
    next(iter(feeder))
    assert any(name.startswith("feedpipe-gather") for name in feedpipe_threads())
    feeder.close()
    assert not feedpipe_threads()


def test_arrays_of_small_batches_are_gathered_in_one_thread_and_describe_says_why(devices):
    with fp.Feeder(arrays("array"), 8, devices=devices) as feeder:
        described = feeder.describe()
        assert described.gather_threads == 1
        assert described.gather_chosen.startswith("1 thread: batches of 0.0 MiB")
        assert described.slots.count == 4  # nothing is gathered ahead
        next(iter(feeder))
        assert not [t for t in feedpipe_threads() if t.startswith("feedpipe-gather")]


def test_sources_made_otherwise_have_no_gather_threads(devices):
    source = arrays("array")
    with fp.Feeder(source, 8, devices=devices, transform=lambda x: x) as feeder:
        described = feeder.describe()
    assert (described.gather_threads, described.gather_chosen) == (0, None)
