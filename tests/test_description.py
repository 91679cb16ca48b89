"""`Feeder.describe()`: what the feeder is, as plain data that diagnostics and reports read,
JSON as it is, and the same before and after the feeder has been read."""

from __future__ import annotations

import dataclasses
import json

import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe.core.description import SourceDescription
from tests.fakes import index_arrays
from tests.worker_fakes import IndexSource, sharded_range


def round_trips(description) -> bool:
    as_dict = description.to_dict()
    return json.loads(json.dumps(as_dict)) == as_dict


def test_arrays_in_memory_are_described_with_their_bytes(devices):
    x, y = index_arrays(20)
    with fp.Feeder((x, y), 8, devices=devices[:2], shuffle=True, seed=3) as feeder:
        described = feeder.describe()
    assert described.framework == "tensorflow"
    assert described.source == SourceDescription(
        kind="arrays",
        length=20,
        indexed=True,
        nbytes=x.nbytes + y.nbytes,
        shards=None,
        threads=None,
    )
    assert described.fields == ("[0]: float32[3]", "[1]: int64[]")
    assert (described.global_batch_size, described.per_replica_batch_size) == (8, 4)
    assert (described.host_batch_size, described.batch_bytes) == (8, 8 * (3 * 4 + 8))
    assert described.steps_per_epoch == 3  # 20 samples, the last batch padded
    assert described.devices == ("/device:CPU:0", "/device:CPU:1")
    assert not described.accelerated
    assert (described.hosts, described.host, described.service) == (1, 0, None)
    assert (described.workers, described.depth, described.remainder) == (0, 2, "pad")
    assert (described.shuffle, described.seed) == (True, 3)
    assert round_trips(described)


def test_the_slots_are_described_with_why_they_are_not_page_locked_on_cpus(devices):
    with fp.Feeder(index_arrays(20), 8, devices=devices[:2]) as feeder:
        slots = feeder.describe().slots
    assert slots.count == 2 + 2  # depth + 2 with the background thread
    assert slots.bytes_per_slot >= 8 * (3 * 4 + 8)
    assert slots.page_locked is False
    assert slots.page_lock_reason == "the devices are CPUs: no batch is copied to an accelerator"


def test_a_map_style_source_with_two_workers_is_described_with_its_slots(devices):
    with fp.Feeder(IndexSource(40), 8, devices=devices[:2], workers=2) as feeder:
        described = feeder.describe()
        for _ in feeder:
            pass
        allocated = feeder.stats().slots_allocated
        after = feeder.describe()
    assert described.source.kind == "map" and described.source.indexed
    assert described.source.nbytes is None and described.source.length == 40
    assert (described.workers, described.worker_mode) == (2, "process")
    assert described.slots.count == 2 + 3  # depth + 3 with workers over an indexed source
    assert 0 < allocated <= described.slots.count, "the pool stays within the slots described"
    assert after == described, "a description says what the feeder is, not how it is doing"
    assert round_trips(described)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_generator_is_described_with_its_shards_and_no_length(devices, workers):
    source = fp.from_generator(sharded_range(20))
    with fp.Feeder(source, 4, devices=devices[:2], workers=workers) as feeder:
        described = feeder.describe()
    assert described.source.kind == "generator" and not described.source.indexed
    assert described.source.shards == max(workers, 1)
    assert described.source.length is None and described.steps_per_epoch is None
    assert described.slots.count == 2 + 1 + max(workers, 1)
    assert round_trips(described)


def test_a_tf_data_dataset_is_described_as_one(devices):
    dataset = tf.data.Dataset.from_tensor_slices(index_arrays(12))
    with fp.Feeder(dataset, 4, devices=devices[:2]) as feeder:
        described = feeder.describe()
    assert (described.source.kind, described.source.length) == ("tf.data", 12)
    assert described.steps_per_epoch == 3


def test_a_description_is_frozen_and_the_source_is_the_one_given(devices):
    data = index_arrays(8)
    with fp.Feeder(data, 4, devices=devices[:1]) as feeder:
        described = feeder.describe()
        assert feeder.source is data
    with pytest.raises(dataclasses.FrozenInstanceError):
        described.depth = 4
