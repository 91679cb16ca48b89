"""Workers: the same batches for every number and kind of worker, samples made in worker
processes that never load TensorFlow, generators sharded across workers, the layout change
fused into the write, steady-state memory, and the errors a user gets for bad options."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from tests import worker_fakes as wf
from tests.core.test_slots import small_dev_shm
from tests.fakes import all_ids, host_batch_ids, index_pydataset, real_ids

GLOBAL_BATCH = 8


def stream(feeder, epochs: int = 1) -> list[list[int]]:
    """Every row's id, padding included, of each batch of `epochs` loops."""
    return [all_ids(batch) for _ in range(epochs) for batch in feeder]


@pytest.fixture(scope="module")
def reference(devices):
    """The batches of workers=0, the order every worker count must reproduce."""
    cache = {}

    def batches(source, **options):
        key = (type(source).__name__, len(source), tuple(sorted(options.items())))
        if key not in cache:
            with fp.Feeder(source, GLOBAL_BATCH, devices=devices, **options) as feeder:
                cache[key] = stream(feeder, epochs=2)
        return cache[key]

    return batches


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_every_worker_count_gives_the_same_batches(devices, reference, workers, remainder):
    source = wf.IndexSource(37)
    options = {"shuffle": True, "seed": 5, "remainder": remainder}
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=workers, **options) as feeder:
        assert stream(feeder, epochs=2) == reference(source, **options)


def test_worker_threads_give_the_same_batches(devices, reference):
    source = wf.IndexSource(29)
    with fp.Feeder(
        source, GLOBAL_BATCH, devices=devices, workers=3, worker_mode="thread", shuffle=True
    ) as feeder:
        assert stream(feeder, epochs=2) == reference(source, shuffle=True)


def test_arrays_give_the_same_batches_with_workers(devices):
    features = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)
    options = {"devices": devices, "shuffle": True, "seed": 1}
    with fp.Feeder(features, GLOBAL_BATCH, **options) as thread:
        expected = [[r.numpy() for r in b.replicas] for b in thread]
    with fp.Feeder(features, GLOBAL_BATCH, workers=2, **options) as workers:
        got = [[r.numpy() for r in b.replicas] for b in workers]
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_each_replica_gets_its_rows_on_its_device_with_workers(devices):
    with fp.Feeder(wf.IndexSource(16), GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        batch = next(iter(feeder))
        for replica, (device, (features, labels)) in enumerate(
            zip(devices, batch.replicas, strict=True)
        ):
            assert features.device.endswith(device.replace("/cpu", "device:CPU"))
            assert labels.numpy().tolist() == [2 * replica, 2 * replica + 1]


def test_transform_rng_does_not_depend_on_the_workers(devices):
    def features(**options):
        with fp.Feeder(
            wf.IndexSource(20), GLOBAL_BATCH, devices=devices, transform=wf.add_noise, **options
        ) as feeder:
            return np.concatenate([b.replicas[1][0].numpy() for b in feeder])

    expected = features()
    assert not np.array_equal(expected, np.round(expected))  # the transform added noise
    np.testing.assert_array_equal(features(workers=2), expected)
    np.testing.assert_array_equal(features(workers=2, worker_mode="thread"), expected)


def test_worker_processes_never_import_tensorflow(devices):
    with fp.Feeder(wf.TensorFlowProbe(16), GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        loaded = [int(flag) for b in feeder for r in b.replicas for flag in r[1].numpy()]
    assert loaded == [0] * 16


def test_samples_are_made_in_every_worker_process(devices):
    import os

    with fp.Feeder(wf.PidSource(64), GLOBAL_BATCH, devices=devices[:1], workers=2) as feeder:
        pids = {int(p) for b in feeder for p in b.replicas[0][1].numpy()}
    assert len(pids) == 2
    assert os.getpid() not in pids


@pytest.mark.parametrize("length", [1, 7, 8, 30, 61])
def test_generator_shards_deliver_every_sample_once(devices, length):
    source = fp.from_generator(wf.sharded_range(length))
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=3) as feeder:
        for _ in range(2):
            batches = list(feeder)
            ids = [i for b in batches for i in real_ids(b)]
            assert sorted(ids) == list(range(length))
            # Only the last batch of the epoch is partial: the shards' tails are merged.
            assert [b.num_valid for b in batches[:-1]] == [GLOBAL_BATCH] * (len(batches) - 1)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_generator_order_is_the_same_every_time(devices, remainder):
    def read(**options):
        source = fp.from_generator(wf.uneven_shards)
        with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=3, **options) as feeder:
            return stream(feeder, epochs=2)

    first = read(remainder=remainder)
    assert first == read(remainder=remainder)
    total = sum(5 * (shard + 1) + 3 for shard in range(3))
    real = [i for ids in first[: len(first) // 2] for i in ids]
    if remainder == "drop":
        assert len(real) == total - total % GLOBAL_BATCH
    else:
        assert len(set(real)) == total


def test_generator_error_remainder_raises_at_the_end_of_the_stream(devices):
    source = fp.from_generator(wf.sharded_range(13))
    with (
        fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2, remainder="error") as feeder,
        pytest.raises(ValueError, match=r'`remainder`="error", but epoch 0 .* 13 samples'),
    ):
        list(feeder)


@pytest.mark.parametrize("kind", ["map", "generator"])
def test_resume_with_workers_continues_the_same_stream(devices, kind):
    def source():
        if kind == "map":
            return wf.IndexSource(45)
        return fp.from_generator(wf.uneven_shards)

    options = {"devices": devices, "workers": 2}
    if kind == "map":
        options["shuffle"] = True
    with fp.Feeder(source(), GLOBAL_BATCH, **options) as whole:
        first_epoch, next_epoch = stream(whole), stream(whole)
    for stop_after in (1, 3):
        with fp.Feeder(source(), GLOBAL_BATCH, **options) as first:
            taken = []
            for batch in first:
                taken.append(all_ids(batch))
                if len(taken) == stop_after:
                    break
            state = first.get_state()
        with fp.Feeder(source(), GLOBAL_BATCH, **options) as second:
            second.set_state(state)
            rest = stream(second)
        if len(taken) < len(first_epoch):
            assert taken + rest == first_epoch
        else:  # the epoch's last batch was taken: the next loop is the next epoch, not empty
            assert (taken, rest) == (first_epoch, next_epoch)


def test_a_loop_left_early_resumes_with_workers(devices, reference):
    source = wf.IndexSource(40)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2, shuffle=True) as feeder:
        got = []
        for batch in feeder:
            got.append(all_ids(batch))
            if len(got) == 2:
                break
        got += stream(feeder, epochs=2)
    assert got[:5] + got[5:] == reference(source, shuffle=True)[: len(got)]


def test_kept_batches_keep_their_values_with_workers(devices):
    with fp.Feeder(wf.IndexSource(80), GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        kept = list(feeder)  # more batches than slots: one-off shared slots are made
        assert [i for b in kept for i in real_ids(b)] == list(range(80))
        assert feeder.stats().overflow_slots > 0
        kept.clear()
        assert [i for b in feeder for i in real_ids(b)] == list(range(80))


def test_slots_never_outnumber_depth_plus_three(devices):
    depth = 2
    with fp.Feeder(
        wf.IndexSource(64), GLOBAL_BATCH, devices=devices, workers=2, depth=depth
    ) as feeder:
        for epoch in range(4):
            list(iter_batches(feeder, 1))
            stats = feeder.stats()
            assert stats.slots_allocated <= depth + 3, epoch
            assert stats.overflow_slots == 0


def iter_batches(feeder, epochs: int):
    """Takes and drops every batch of `epochs` loops."""
    for _ in range(epochs):
        for batch in feeder:
            yield batch.num_valid


def test_a_feeder_with_workers_is_not_refused_for_a_small_dev_shm(devices, monkeypatch):
    """Worker processes share memfds, never files of /dev/shm: with Docker's default 64 MiB
    /dev/shm (faked here as 1 MiB free) a feeder whose slots the memory holds runs."""
    small_dev_shm(monkeypatch, 2**20)
    rows = np.zeros((64, 16384), np.float32)  # 64 KiB a row: a slot of 2 MiB
    with fp.Feeder((rows, np.arange(64)), 32, devices=devices[:2], workers=2) as feeder:
        assert [batch.num_valid for batch in feeder] == [32, 32]


def test_as_dataset_with_workers_gives_the_same_batches(devices):
    source = wf.IndexSource(21)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices) as thread:
        expected = [host_batch_ids(e).tolist() for e in thread.as_dataset()]
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2) as workers:
        dataset = workers.as_dataset()
        for _ in range(2):
            assert [host_batch_ids(e).tolist() for e in dataset] == expected


@pytest.mark.parametrize("worker_mode", ["process", "thread"])
def test_pydataset_batches_are_read_by_workers(devices, worker_mode):
    source = index_pydataset(20, 4)
    with fp.Feeder(
        source, GLOBAL_BATCH, devices=devices, workers=2, worker_mode=worker_mode, shuffle=True
    ) as feeder:
        for _ in range(2):
            ids = [i for b in feeder for i in real_ids(b)]
            assert collections.Counter(ids) == collections.Counter(range(20))


def test_with_worker_processes_the_training_process_reads_no_batch_of_a_pydataset(devices):
    source = index_pydataset(20, 4)
    with fp.Feeder(source, GLOBAL_BATCH, devices=devices, workers=2) as feeder:
        assert sorted(i for b in feeder for i in real_ids(b)) == list(range(20))
    assert not source.batch_reads  # its first and last batches too were read in a worker


def test_tf_data_cannot_be_read_by_workers(devices):
    dataset = tf.data.Dataset.range(8).map(lambda i: tf.cast(i, tf.float32))
    with pytest.raises(ValueError, match=r"`workers`=2, but a tf.data.Dataset runs in"):
        fp.Feeder(dataset, 4, devices=devices, workers=2)


# ---- the layout change fused into the write ---------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_transpose_writes_fields_in_the_new_axis_order(devices, workers):
    with fp.Feeder(
        wf.IndexSource(12),
        GLOBAL_BATCH,
        devices=devices,
        transform=wf.to_channels_last,
        transpose={"image": (2, 0, 1)},
        workers=workers,
    ) as feeder:
        assert feeder.spec.leaves[0].shape == (4, 2, 3)
        for batch in feeder:
            for replica in batch.replicas:
                images, labels = replica["image"].numpy(), replica["label"].numpy()
                for image, label in zip(images, labels, strict=True):
                    expected = wf.to_channels_last((None, label))["image"].transpose(2, 0, 1)
                    np.testing.assert_array_equal(image, expected)


def test_transpose_of_one_array_source(devices):
    images = np.arange(10 * 2 * 3 * 4, dtype=np.float32).reshape(10, 2, 3, 4)
    with fp.Feeder(images, 2, devices=devices[:2], transpose=(2, 0, 1)) as feeder:
        got = np.concatenate([np.concatenate([r.numpy() for r in b.replicas]) for b in feeder])
    np.testing.assert_array_equal(got, images.transpose(0, 3, 1, 2))


def test_transpose_must_name_fields_that_exist(devices):
    with pytest.raises(ValueError, match=r"`transpose` names the field 'picture'.*'image'"):
        fp.Feeder(
            wf.IndexSource(8),
            4,
            devices=devices,
            transform=wf.to_channels_last,
            transpose={"picture": (2, 0, 1)},
        )


def test_transpose_must_be_a_permutation(devices):
    with pytest.raises(ValueError, match=r"axis order \(2, 0\), but that field has shape"):
        fp.Feeder(
            wf.IndexSource(8),
            4,
            devices=devices,
            transform=wf.to_channels_last,
            transpose={"image": (2, 0)},
        )


def test_one_axis_order_needs_a_one_array_sample(devices):
    with pytest.raises(TypeError, match=r"`transpose`=\(1, 0\) is one axis order"):
        fp.Feeder(wf.IndexSource(8), 4, devices=devices, transpose=(1, 0))


# ---- options ----------------------------------------------------------------------------------


def test_worker_mode_must_be_process_or_thread(devices):
    with pytest.raises(ValueError, match=r'`worker_mode`=\'fork\' must be "process" or "thread"'):
        fp.Feeder(wf.IndexSource(8), 4, devices=devices, workers=1, worker_mode="fork")


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"workers": 1, "timeout_s": 0}, ValueError, r"`timeout_s`=0 must be > 0"),
        ({"workers": 1, "timeout_s": "1"}, TypeError, r"`timeout_s`='1' must be a number"),
        ({"timeout_s": 1.0}, ValueError, r"`timeout_s`=1.0 watches workers, but `workers`=0"),
    ],
)
def test_timeout_must_be_positive_and_needs_workers(devices, options, error, match):
    with pytest.raises(error, match=match):
        fp.Feeder(wf.IndexSource(8), 4, devices=devices, **options)


def test_repr_shows_the_worker_settings(devices):
    with fp.Feeder(
        wf.IndexSource(8), 4, devices=devices, workers=1, worker_mode="thread", timeout_s=3
    ) as feeder:
        assert "workers=1, depth=2, worker_mode='thread', timeout_s=3" in repr(feeder)
