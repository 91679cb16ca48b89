"""`Feeder.describe()` on JAX devices: the same description as on TensorFlow, devices named as
JAX names them, and on host devices the reason the slots are not page-locked."""

from __future__ import annotations

import json

import numpy as np
import pytest

import feedpipe as fp
from tests.worker_fakes import IndexSource, sharded_range


def round_trips(description) -> bool:
    as_dict = description.to_dict()
    return json.loads(json.dumps(as_dict)) == as_dict


def test_arrays_on_jax_devices_are_described_with_their_bytes(devices):
    x, y = np.zeros((20, 3), np.float32), np.arange(20, dtype=np.int32)
    with fp.Feeder((x, y), 8, devices=devices) as feeder:
        described = feeder.describe()
    assert described.framework == "jax"
    assert (described.source.kind, described.source.nbytes) == ("arrays", x.nbytes + y.nbytes)
    assert described.devices == tuple(str(device) for device in devices)
    assert not described.accelerated
    assert (described.per_replica_batch_size, described.steps_per_epoch) == (2, 3)
    assert described.slots.count == 2 + 2 and described.slots.page_locked is False
    assert described.slots.page_lock_reason == (
        "the devices are CPUs: no batch is copied to an accelerator"
    )
    assert round_trips(described)


def test_a_map_style_source_with_two_workers_is_described_on_jax(devices):
    with fp.Feeder(IndexSource(40, np.int32), 8, devices=devices, workers=2) as feeder:
        described = feeder.describe()
        assert sum(1 for _ in feeder) == 5
        allocated = feeder.stats().slots_allocated
    assert (described.source.kind, described.source.length) == ("map", 40)
    assert (described.workers, described.worker_mode) == (2, "process")
    assert 0 < allocated <= described.slots.count == 2 + 3
    assert round_trips(described)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_generator_is_described_with_its_shards_on_jax(devices, workers):
    source = fp.from_generator(sharded_range(20, np.int32))
    with fp.Feeder(source, 4, devices=devices, workers=workers) as feeder:
        described = feeder.describe()
    assert (described.source.kind, described.source.shards) == ("generator", max(workers, 1))
    assert described.steps_per_epoch is None
    assert round_trips(described)
