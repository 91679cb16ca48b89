"""The Feeder: what every consumer relies on (exactness, placement, order, errors, shutdown,
resume, bounded memory) and the errors a user gets for bad input."""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import signal
import threading
import time
import warnings

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe.core.sampler import Sampler
from tests.conftest import (
    HAS_GPU,
    feedpipe_processes,
    feedpipe_threads,
    wait_for_no_feedpipe_threads,
)
from tests.fakes import (
    CountingSource,
    FailingSource,
    SourceBroke,
    TransformBroke,
    all_ids,
    epoch_ids,
    host_batch_ids,
    index_arrays,
    index_pydataset,
    index_sample,
    real_ids,
    replica_masks,
    sharded_range,
)
from tests.worker_fakes import IndexSource

GLOBAL_BATCH = 8
PYDATASET_BATCH = 3
INDEXED_KINDS = ("array", "tuple", "dict", "map", "pydataset")
STREAM_KINDS = ("generator", "tfdata")


def make_source(kind: str, length: int):
    """A source of `length` index-carrying samples, of the given kind."""
    features, labels = index_arrays(length)
    if kind == "array":
        return features
    if kind == "tuple":
        return features, labels
    if kind == "dict":
        return {"image": features, "label": labels}
    if kind == "map":
        return CountingSource(length)
    if kind == "pydataset":
        return index_pydataset(length, PYDATASET_BATCH)
    if kind == "generator":
        return fp.from_generator(sharded_range(length))
    if kind == "tfdata":
        return tf.data.Dataset.from_tensor_slices((features, labels))
    raise AssertionError(kind)


def expected_order(kind, length, global_batch, *, shuffle=False, seed=0, epoch=0):
    """The sample order a feeder must follow: the sampler's for indexed sources, else 0..N-1."""
    if kind in STREAM_KINDS:
        return np.arange(length)
    block = PYDATASET_BATCH if kind == "pydataset" else 1
    sampler = Sampler(length, global_batch, shuffle=shuffle, seed=seed, block_size=block)
    return sampler.order(epoch)


def exactness_cases():
    cases = []
    for kind in INDEXED_KINDS + STREAM_KINDS:
        for shuffle in (False, True) if kind in INDEXED_KINDS else (False,):
            for replicas in (1, 2, 4):
                for length in (3, 1, 16, 13):  # < global batch, 1, a multiple, a prime
                    cases.append((kind, shuffle, replicas, "pad", length))
                    if length >= GLOBAL_BATCH:
                        cases.append((kind, shuffle, replicas, "drop", length))
                    if length % GLOBAL_BATCH == 0:
                        cases.append((kind, shuffle, replicas, "error", length))
    return [
        pytest.param(*case, id=f"{case[0]}-shuffle{int(case[1])}-r{case[2]}-{case[3]}-n{case[4]}")
        for case in cases
    ]


@pytest.mark.parametrize(("kind", "shuffle", "replicas", "remainder", "length"), exactness_cases())
def test_every_epoch_delivers_the_dataset_exactly(
    devices, kind, shuffle, replicas, remainder, length
):
    source = make_source(kind, length)
    leftover = length % GLOBAL_BATCH if remainder == "drop" else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feeder = fp.Feeder(
            source,
            GLOBAL_BATCH,
            devices=devices[:replicas],
            remainder=remainder,
            shuffle=shuffle,
            seed=7,
        )
        if kind == "pydataset":
            source.batch_reads.clear()  # reading the spec at construction is not an epoch
        with feeder:
            for epoch in range(2):
                batches = list(feeder)
                order = expected_order(
                    kind, length, GLOBAL_BATCH, shuffle=shuffle, seed=7, epoch=epoch
                )
                delivered = [i for batch in batches for i in real_ids(batch)]
                kept = order[: length - leftover]
                if remainder != "drop":
                    assert collections.Counter(delivered) == collections.Counter(range(length))
                assert collections.Counter(delivered) == collections.Counter(kept.tolist())
                assert delivered == kept.tolist()
                if remainder == "drop":
                    missing = collections.Counter(range(length)) - collections.Counter(delivered)
                    assert sorted(missing) == sorted(order[length - leftover :].tolist())
                steps = length // GLOBAL_BATCH + (
                    remainder == "pad" and bool(length % GLOBAL_BATCH)
                )
                assert len(batches) == steps
                if kind != "generator":
                    assert len(feeder) == steps
                assert [b.epoch for b in batches] == [epoch] * len(batches)
                assert [b.step for b in batches] == list(range(len(batches)))
                for batch in batches:
                    assert_padding_is_masked_and_repeats_real_rows(batch, GLOBAL_BATCH)
    dropped_warnings = [str(w.message) for w in caught if "drop" in str(w.message)]
    if leftover:
        assert dropped_warnings
        assert all(f"last {leftover} " in message for message in dropped_warnings)
    else:
        assert not dropped_warnings
    if kind == "pydataset":
        reads = source.batch_reads
        assert max(reads.values()) == 1, "a PyDataset batch was read twice in one epoch"
        needed = {index // PYDATASET_BATCH for index in kept.tolist()}
        assert {n for (e, n) in reads if e == 1} == needed, "each needed batch is read in epoch 1"


def assert_padding_is_masked_and_repeats_real_rows(batch, global_batch):
    masks = np.concatenate(replica_masks(batch))
    assert masks.shape == (global_batch,)
    assert masks.tolist() == [row < batch.num_valid for row in range(global_batch)]
    ids = all_ids(batch)
    assert ids == [ids[row % batch.num_valid] for row in range(global_batch)]
    assert batch.num_valid == len(set(ids[: batch.num_valid])) == len(real_ids(batch))


def rich_arrays(length: int) -> dict[str, np.ndarray]:
    """Fields of many dtypes and shapes, with random bits (NaN payloads included)."""
    rng = np.random.default_rng(1)
    return {
        "bits_f32": rng.integers(0, 2**32, (length, 5), dtype=np.uint32).view(np.float32),
        "image": rng.integers(0, 256, (length, 4, 4, 3), dtype=np.uint8),
        "label": rng.integers(-(2**62), 2**62, (length,), dtype=np.int64),
        "flag": rng.random(length) < 0.5,
        "half": rng.standard_normal((length, 7)).astype(np.float16),
        "bf16": rng.standard_normal((length, 2)).astype(ml_dtypes.bfloat16),
        "scalar": rng.standard_normal(length),
    }


class DictRows:
    """Map-style view over `rich_arrays`, so samples take the per-sample path."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["label"])

    def __getitem__(self, index):
        return {name: array[index] for name, array in self.arrays.items()}


@pytest.mark.parametrize("per_sample", [False, True], ids=["arrays", "map"])
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_each_replica_gets_its_own_rows_bit_for_bit_on_its_device(devices, per_sample, replicas):
    length, global_batch = 21, 8
    arrays = rich_arrays(length)
    source = DictRows(arrays) if per_sample else arrays
    per_replica = global_batch // replicas
    with fp.Feeder(
        source, global_batch, devices=devices[:replicas], shuffle=True, seed=3
    ) as feeder:
        for epoch in range(2):
            order = Sampler(length, global_batch, shuffle=True, seed=3).order(epoch)
            steps = 0
            for batch in feeder:
                rows = order[batch.step * global_batch : (batch.step + 1) * global_batch]
                assert batch.num_valid == len(rows)
                padded = np.array([rows[j % len(rows)] for j in range(global_batch)])
                assert len(batch.replicas) == len(batch.masks) == replicas
                for r, (replica, mask) in enumerate(zip(batch.replicas, batch.masks, strict=True)):
                    mine = padded[r * per_replica : (r + 1) * per_replica]
                    assert set(replica) == set(arrays)
                    for name, tensor in replica.items():
                        assert tensor.device.endswith(f"CPU:{r}"), (name, tensor.device)
                        assert tensor.dtype == tf.as_dtype(arrays[name].dtype)
                        got = tensor.numpy()
                        assert got.shape == (per_replica, *arrays[name].shape[1:])
                        assert got.tobytes() == arrays[name][mine].tobytes(), name
                    assert mask.device.endswith(f"CPU:{r}")
                    expected_mask = np.arange(r * per_replica, (r + 1) * per_replica) < len(rows)
                    assert mask.numpy().tolist() == expected_mask.tolist()
                steps += 1
            assert steps == len(feeder) == 3


def test_a_strategy_gives_the_feeder_its_replica_devices(strategy):
    with fp.Feeder(index_arrays(8), 8, strategy=strategy) as feeder:
        batch = next(iter(feeder))
        for r, (features, labels) in enumerate(batch.replicas):
            assert features.device.endswith(f"CPU:{r}")
            assert labels.numpy().tolist() == [2 * r, 2 * r + 1]


# ---- shuffle, determinism and transform -------------------------------------------------


def two_epochs(**kwargs) -> list[list[int]]:
    with fp.Feeder(CountingSource(40), 8, **kwargs) as feeder:
        return [epoch_ids(feeder) for _ in range(2)]


def test_shuffle_same_seed_and_epoch_gives_the_same_order(devices):
    first = two_epochs(devices=devices[:2], shuffle=True, seed=5)
    again = two_epochs(devices=devices[:4], shuffle=True, seed=5)
    assert first == again
    assert sorted(first[0]) == list(range(40))


def test_shuffle_next_epoch_gives_another_order():
    epoch0, epoch1 = two_epochs(shuffle=True, seed=5)
    assert epoch0 != epoch1
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != list(range(40))


def test_shuffle_different_seed_gives_another_order():
    assert two_epochs(shuffle=True, seed=5)[0] != two_epochs(shuffle=True, seed=6)[0]


def test_without_shuffle_the_order_is_the_dataset_order():
    assert two_epochs() == [list(range(40))] * 2


def noisy_ids(feeder, epochs=2) -> list[dict[int, float]]:
    """Per epoch, each sample id's transformed noise value."""
    out = []
    for _ in range(epochs):
        noise = {}
        for batch in feeder:
            for replica, mask in zip(batch.replicas, batch.masks, strict=True):
                ids, values = replica["id"].numpy(), replica["noise"].numpy()
                for i, v in zip(ids[mask.numpy()], values[mask.numpy()], strict=True):
                    noise[int(i)] = float(v)
        out.append(noise)
    return out


def add_noise(sample, rng):
    features, label = sample
    return {"id": label, "noise": np.float64(rng.random()), "features": features * 2}


def test_transform_rng_depends_only_on_seed_epoch_and_index(devices):
    with fp.Feeder(
        CountingSource(13), 4, devices=devices[:1], seed=9, transform=add_noise
    ) as plain:
        reference = noisy_ids(plain)
    with fp.Feeder(
        CountingSource(13), 8, devices=devices, seed=9, shuffle=True, transform=add_noise
    ) as other:
        assert noisy_ids(other) == reference
    assert sorted(reference[0]) == list(range(13))
    assert reference[0] != reference[1], "the next epoch must draw other numbers"
    with fp.Feeder(
        CountingSource(13), 4, devices=devices[:1], seed=10, transform=add_noise
    ) as reseeded:
        assert noisy_ids(reseeded)[0] != reference[0]


def test_transform_without_rng_is_applied_to_every_sample(devices):
    def double(sample):
        features, label = sample
        return features * 2, label

    source = CountingSource(10)
    with fp.Feeder(source, 4, devices=devices[:2], transform=double) as feeder:
        for batch in feeder:
            for features, labels in batch.replicas:
                labels = labels.numpy()
                np.testing.assert_array_equal(
                    features.numpy(), 2 * np.repeat(labels[:, None], 3, axis=1).astype(np.float32)
                )
    assert "feedpipe-producer-0" in source.reader_threads


def test_transform_is_applied_to_generator_samples(devices):
    def shift(sample, rng):
        features, label = sample
        return features + 1, label

    with fp.Feeder(
        fp.from_generator(sharded_range(6)), 4, devices=devices[:2], transform=shift
    ) as feeder:
        batches = list(feeder)
    features = np.concatenate([r[0].numpy() for b in batches for r in b.replicas])
    np.testing.assert_array_equal(features[:6, 0], np.arange(6) + 1)


# ---- errors from user code ----------------------------------------------------------------


def assert_noted(error: BaseException, index: int) -> None:
    notes = getattr(error, "__notes__", [])
    assert any("feedpipe-producer-0" in note and f"index {index} " in note for note in notes), notes


def assert_closed(feeder, error: BaseException) -> None:
    """The failed feeder has stopped, and every later read raises its error again."""
    assert wait_for_no_feedpipe_threads() == []
    for _ in range(2):
        with pytest.raises(type(error)) as again:
            next(iter(feeder))
        assert again.value is error


def test_source_error_reaches_the_consumer_with_its_type_message_and_note(devices):
    feeder = fp.Feeder(FailingSource(24, fail_at=13), 4, devices=devices[:2])
    delivered = []
    with pytest.raises(SourceBroke, match=r"^sample 13 is broken") as info:
        for batch in feeder:
            delivered.append(real_ids(batch))
    assert delivered == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert str(info.value) == "sample 13 is broken"
    assert_noted(info.value, 13)
    assert_closed(feeder, info.value)


def test_transform_error_reaches_the_consumer_with_its_type_message_and_note(devices):
    def fragile(sample):
        if int(sample[1]) == 6:
            raise TransformBroke("cannot transform 6")
        return sample

    feeder = fp.Feeder(CountingSource(12), 4, devices=devices[:4], transform=fragile)
    delivered = []
    with pytest.raises(TransformBroke, match=r"^cannot transform 6") as info:
        for batch in feeder:
            delivered += real_ids(batch)
    assert delivered == [0, 1, 2, 3]
    assert str(info.value) == "cannot transform 6"
    assert_noted(info.value, 6)
    assert_closed(feeder, info.value)


def test_an_error_while_building_the_feeder_keeps_its_type_and_names_sample_0(devices):
    with pytest.raises(SourceBroke, match="sample 0 is broken") as read:
        fp.Feeder(FailingSource(8, fail_at=0), 4, devices=devices[:2])
    assert any("reading sample 0" in note for note in read.value.__notes__)

    def broken(sample):
        raise TransformBroke("cannot transform")

    with pytest.raises(TransformBroke, match="cannot transform") as transformed:
        fp.Feeder(CountingSource(8), 4, devices=devices[:2], transform=broken)
    assert any("sample index 0 of epoch 0" in note for note in transformed.value.__notes__)


def test_generator_error_reaches_the_consumer_with_its_type_message_and_note(devices):
    def generate(shard, num_shards):
        for index in range(10):
            if index == 6:
                raise SourceBroke("generator broke at 6")
            yield index_sample(index)

    feeder = fp.Feeder(fp.from_generator(generate), 2, devices=devices[:2])
    delivered = []
    with pytest.raises(SourceBroke, match=r"^generator broke at 6") as info:
        for batch in feeder:
            delivered += real_ids(batch)
    assert delivered == [0, 1, 2, 3, 4, 5]
    assert str(info.value) == "generator broke at 6"
    assert_noted(info.value, 6)
    assert_closed(feeder, info.value)


def test_tf_data_error_reaches_the_consumer_with_its_type_and_its_block(devices):
    # 1 / (9 - i) is infinite at i = 9, which check_numerics turns into an error; tf.data reads
    # blocks of one global batch (4), so the note names the block that starts at sample 8.
    dataset = tf.data.Dataset.range(12).map(
        lambda i: tf.debugging.check_numerics(1.0 / tf.cast(9 - i, tf.float32), "dataset broke")
    )
    feeder = fp.Feeder(dataset, 4, devices=devices[:2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="dataset broke") as raised:
        list(feeder)
    notes = "\n".join(raised.value.__notes__)
    assert "feedpipe-producer-0" in notes
    assert "reading the samples from index 8 of epoch 0" in notes
    assert_closed(feeder, raised.value)


def test_samples_whose_shapes_differ_name_the_field_index_and_both_shapes(devices):
    class Ragged(CountingSource):
        def __getitem__(self, index):
            features, label = super().__getitem__(index)
            return (np.zeros(4, np.float32) if index == 5 else features), label

    feeder = fp.Feeder(Ragged(8), 4, devices=devices[:1])
    with pytest.raises(
        ValueError,
        match=r"Field \[0\] of sample 5 has shape \(4,\).*first sample had shape \(3,\)",
    ) as raised:
        list(feeder)
    assert_closed(feeder, raised.value)


def test_error_remainder_refuses_a_generator_that_ends_off_a_multiple(devices):
    feeder = fp.Feeder(
        fp.from_generator(sharded_range(10)), 4, devices=devices[:2], remainder="error"
    )
    delivered = []
    with pytest.raises(
        ValueError, match=r'`remainder`="error".*10 samples, 2 past a multiple'
    ) as raised:
        for batch in feeder:
            delivered += real_ids(batch)
    assert delivered == list(range(8))
    assert_closed(feeder, raised.value)


# ---- shutdown -------------------------------------------------------------------------------


def test_no_thread_left_after_close(devices):
    feeder = fp.Feeder(index_arrays(40), 4, devices=devices[:2])
    iterator = iter(feeder)
    next(iterator)
    assert feedpipe_threads() == ["feedpipe-producer-0"]
    feeder.close()
    assert feedpipe_threads() == []
    del iterator


def test_close_is_idempotent(devices):
    feeder = fp.Feeder(index_arrays(40), 4, devices=devices[:2])
    epoch_ids(feeder)  # the producer runs ahead into the next epoch
    assert feedpipe_threads()
    feeder.close()
    feeder.close()
    assert feedpipe_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        list(feeder)
    feeder.close()


def test_with_block_closes_the_feeder(devices):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:2]) as feeder:
        epoch_ids(feeder)
        assert feedpipe_threads()
    assert feedpipe_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        list(feeder)


def test_with_block_closes_the_feeder_on_an_exception(devices):
    with pytest.raises(KeyError), fp.Feeder(index_arrays(40), 4, devices=devices[:2]) as feeder:
        iterator = iter(feeder)
        next(iterator)
        raise KeyError("consumer failed")
    assert feedpipe_threads() == [], "leaving the block must close, not the iterator's end"
    del iterator


def test_no_thread_left_after_del(devices):
    feeder = fp.Feeder(index_arrays(40), 4, devices=devices[:2])
    iterator = iter(feeder)
    batch = next(iterator)
    assert feedpipe_threads()
    del feeder, iterator, batch
    assert wait_for_no_feedpipe_threads() == []


def test_no_thread_left_after_del_of_a_feeder_that_ran_ahead(devices):
    feeder = fp.Feeder(CountingSource(40), 4, devices=devices[:2])
    epoch_ids(feeder)
    assert feedpipe_threads()
    del feeder
    assert wait_for_no_feedpipe_threads() == []


def test_no_thread_left_after_an_early_break(devices):
    feeder = fp.Feeder(index_arrays(40), 4, devices=devices[:2])
    for batch in feeder:
        if batch.step == 2:
            break
    assert feedpipe_threads() == []
    feeder.close()


def test_close_while_the_consumer_holds_every_slot(devices):
    feeder = fp.Feeder(index_arrays(80), 4, devices=devices[:2], depth=1)
    iterator = iter(feeder)
    kept = [next(iterator) for _ in range(4)]  # pins the pooled slots; the producer blocks
    feeder.close()
    assert feedpipe_threads() == []
    assert [real_ids(b) for b in kept] == [list(range(i, i + 4)) for i in range(0, 16, 4)]
    del iterator


def test_a_loop_left_early_continues_where_it_stopped(devices):
    with fp.Feeder(CountingSource(22), 4, devices=devices[:2], shuffle=True, seed=2) as feeder:
        first = []
        for batch in feeder:
            first += real_ids(batch)
            if batch.step == 2:
                break
        rest = epoch_ids(feeder)
        order = Sampler(22, 4, shuffle=True, seed=2).order(0).tolist()
        assert first == order[:12]
        assert first + rest == order
        assert epoch_ids(feeder) == Sampler(22, 4, shuffle=True, seed=2).order(1).tolist()


def test_a_second_concurrent_loop_is_refused(devices):
    with fp.Feeder(index_arrays(16), 4, devices=devices[:1]) as feeder:
        iterator = iter(feeder)
        next(iterator)
        with pytest.raises(RuntimeError, match="already being iterated"):
            next(iter(feeder))
        del iterator


# ---- resume -------------------------------------------------------------------------------


def take(feeder, count: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """The next `count` batches as (epoch, step, all row ids), across as many loops as needed."""
    taken = []
    while len(taken) < count:
        for batch in feeder:
            taken.append((batch.epoch, batch.step, tuple(all_ids(batch))))
            if len(taken) == count:
                break
    return taken


@pytest.mark.parametrize("kind", ["tuple", "map", "pydataset"])
def test_resume_at_every_step_gives_the_same_stream(devices, kind):
    length, global_batch = 13, 4  # 4 steps per epoch, the last one padded

    def build():
        return fp.Feeder(
            make_source(kind, length), global_batch, devices=devices[:2], shuffle=True, seed=11
        )

    with build() as feeder:
        steps = len(feeder)
        total = 2 * steps + 1
        stream = take(feeder, total)
    assert [s[:2] for s in stream] == [(e, i) for e in range(3) for i in range(steps)][:total]
    for stop in range(total):
        with build() as interrupted:
            assert take(interrupted, stop) == stream[:stop]
            state = json.loads(json.dumps(interrupted.get_state()))
        with build() as resumed:
            resumed.set_state(state)
            assert take(resumed, total - stop) == stream[stop:], f"resumed after {stop} steps"


def test_resume_of_a_generator_mid_epoch_gives_the_same_stream(devices):
    def build():
        return fp.Feeder(fp.from_generator(sharded_range(10)), 4, devices=devices[:2])

    with build() as feeder:
        stream = take(feeder, 3)
    for stop in range(3):
        with build() as interrupted:
            take(interrupted, stop)
            state = interrupted.get_state()
        with build() as resumed:
            resumed.set_state(state)
            assert take(resumed, 3 - stop) == stream[stop:]


def test_state_records_what_the_consumer_took_not_what_was_produced(devices):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:2], depth=4) as feeder:
        iterator = iter(feeder)
        next(iterator)
        next(iterator)
        state = feeder.get_state()
        del iterator
    assert (state["epoch"], state["step"]) == (0, 2)
    assert state == json.loads(json.dumps(state))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("interrupted", [2, 5], ids=["mid-epoch", "last batch"])
def test_ctrl_c_in_a_with_batch_step_leaves_that_batch_to_the_handlers_state_and_the_next_loop(
    devices, workers, interrupted
):
    # A real SIGINT in the step on batch `interrupted` (of 6): the state saved in the handler,
    # and the loop run again, both go on from that batch, so each sample is trained once.
    def build(workers):
        return fp.Feeder(IndexSource(48), 8, devices=devices, workers=workers, shuffle=True, seed=4)

    with build(workers) as feeder:
        trained = []
        try:
            for batch in feeder:
                with batch:
                    if batch.step == interrupted:
                        os.kill(os.getpid(), signal.SIGINT)
                        time.sleep(1.0)  # Python raises KeyboardInterrupt here, at the latest
                    trained += real_ids(batch)
        except KeyboardInterrupt:
            saved = json.loads(json.dumps(feeder.get_state()))  # the user's handler
        else:
            pytest.fail("Ctrl-C did not interrupt the loop")
        assert (saved["epoch"], saved["step"]) == (0, interrupted)
        goes_on = [i for batch in feeder for i in real_ids(batch)]
    assert sorted(trained + goes_on) == list(range(48))
    with build(0) as restored:
        restored.set_state(saved)
        assert [i for batch in restored for i in real_ids(batch)] == goes_on


def test_a_batch_whose_step_raised_counts_once_its_loop_goes_on(devices):
    # The plain loop's rule stands for a batch whose error the loop caught and went past, and
    # for one left by break: a batch counts once the loop has taken it.
    with fp.Feeder(index_arrays(48), 8, devices=devices) as feeder:
        steps = []
        for batch in feeder:
            with contextlib.suppress(ValueError), batch:
                if batch.step == 1:
                    raise ValueError("a step that failed, skipped by the loop")
            steps.append(feeder.get_state()["step"])
            if batch.step == 3:
                with batch:
                    break
        assert steps == [1, 1, 3, 4]
        assert feeder.get_state()["step"] == 4
        assert [i for b in feeder for i in real_ids(b)] == list(range(32, 48))


class StepFailed(Exception):
    """An error in a training step, raised on purpose."""


def test_a_batch_whose_with_block_raised_and_then_ended_well_counts_as_taken(devices):
    # A retry: the step on batch 2 raises in one `with batch:` block and succeeds in a second.
    # The batch is trained then, so a checkpoint written after it goes on with batch 3.
    with fp.Feeder(index_arrays(48), 8, devices=devices) as feeder:
        trained, saved = [], None
        for batch in feeder:
            with contextlib.suppress(StepFailed), batch:
                if batch.step == 2:
                    raise StepFailed("the first try")
                trained.append(batch.step)
            if batch.step == 2:
                assert (feeder.get_state()["step"]) == 2, "given back while it failed"
                with batch:
                    trained.append(batch.step)
                saved = json.loads(json.dumps(feeder.get_state()))
                break
    assert trained == [0, 1, 2]
    assert (saved["epoch"], saved["step"]) == (0, 3)
    with fp.Feeder(index_arrays(48), 8, devices=devices) as resumed:
        resumed.set_state(saved)
        assert [b.step for b in resumed] == [3, 4, 5]


def test_retried_batches_count_once_every_batch_given_back_ended_well(devices):
    # Two batches given back by nested blocks (gradients accumulated over two batches) count
    # again once both retries end well, in either order.
    with fp.Feeder(index_arrays(48), 8, devices=devices) as feeder:
        loop = iter(feeder)
        first, second = next(loop), next(loop)
        with contextlib.suppress(StepFailed), first, second:
            raise StepFailed("the accumulated step")
        assert feeder.get_state()["step"] == 0
        with second:
            pass
        assert feeder.get_state()["step"] == 0, "batch 0 is not trained yet"
        with first:
            pass
        assert feeder.get_state()["step"] == 2
        assert next(loop).step == 2
        loop.close()


def prefetching_steps(feeder, fails_on: int) -> list[int]:
    """A loop that takes the next batch before it steps on the current one; the step on batch
    `fails_on` raises StepFailed. The steps trained, in order."""
    trained = []
    batches = iter(feeder)
    current = next(batches)
    try:
        while current is not None:
            upcoming = next(batches, None)  # read ahead of the step
            with current:
                if current.step == fails_on:
                    raise StepFailed(f"the step on batch {fails_on}")
                trained.append(current.step)
            current = upcoming
    finally:
        batches.close()
    return trained


@pytest.mark.parametrize("fails_on", [2, 5], ids=["mid-epoch", "last batch"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_that_raised_on_a_batch_read_ahead_of_gives_back_every_batch_from_it(
    devices, fails_on, workers
):
    def build():
        return fp.Feeder(IndexSource(48), 8, devices=devices, workers=workers, shuffle=True, seed=4)

    with build() as feeder:
        stream = take(feeder, 6)
    with build() as feeder:
        with pytest.raises(StepFailed):
            prefetching_steps(feeder, fails_on)
        saved = json.loads(json.dumps(feeder.get_state()))
        assert (saved["epoch"], saved["step"]) == (0, fails_on)
        assert take(feeder, 6 - fails_on) == stream[fails_on:]
    with build() as resumed:
        resumed.set_state(saved)
        assert take(resumed, 6 - fails_on) == stream[fails_on:]


def test_a_step_read_ahead_of_that_raised_counts_once_the_loop_goes_on(devices):
    # As in a plain loop, an error caught and gone past counts the batch as trained.
    with fp.Feeder(index_arrays(48), 8, devices=devices) as feeder:
        batches = iter(feeder)
        current = next(batches)
        upcoming = next(batches)
        with contextlib.suppress(StepFailed), current:
            raise StepFailed("the step on batch 0")
        assert feeder.get_state()["step"] == 0
        assert next(batches).step == 2
        assert feeder.get_state()["step"] == 3
        with upcoming:
            pass
        assert feeder.get_state()["step"] == 3
        batches.close()


def test_unpacking_a_batch_names_what_to_read_instead(devices):
    with (
        fp.Feeder(index_arrays(16), 8, devices=devices[:1]) as feeder,
        pytest.raises(
            TypeError,
            match=r"cannot be unpacked \(as in `for x, y in feeder`\).*batch\.real_rows\(\).*"
            r"batch\.distributed\(\).*batch\.replicas\[i\]",
        ),
    ):
        for _x, _y in feeder:
            pass


def test_real_rows_are_the_sources_real_rows_and_refused_on_several_devices(devices):
    features, labels = index_arrays(20)
    with fp.Feeder((features, labels), 8, devices=devices[:1]) as feeder:
        rows = [batch.real_rows() for batch in feeder]
    assert [len(x) for x, _ in rows] == [8, 8, 4]
    np.testing.assert_array_equal(np.concatenate([x.numpy() for x, _ in rows]), features)
    np.testing.assert_array_equal(np.concatenate([y.numpy() for _, y in rows]), labels)
    with fp.Feeder((features, labels), 8, devices=devices[:2]) as feeder:
        batch = next(iter(feeder))
        with pytest.raises(ValueError, match=r"spans 2 devices.*batch\.distributed\(\)"):
            batch.real_rows()


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("dataset_length", {"length": 17}),
        ("global_batch_size", {"global_batch": 8}),
        ("seed", {"seed": 4}),
    ],
)
def test_restoring_into_a_different_feeder_names_the_field(devices, field, changes):
    def build(length=16, global_batch=4, replicas=2, seed=3):
        return fp.Feeder(
            index_arrays(length), global_batch, devices=devices[:replicas], shuffle=True, seed=seed
        )

    with build() as original:
        take(original, 1)
        state = original.get_state()
    with build(**changes) as other:
        with pytest.raises(ValueError, match=f"{field}="):
            other.set_state(state)
        assert take(other, 1)[0][:2] == (0, 0), "a refused state must not move the feeder"


@pytest.mark.parametrize(("field", "value"), [("epoch", -1), ("step", -2), ("step", True)])
def test_a_state_whose_position_is_no_count_is_refused(devices, field, value):
    with fp.Feeder(index_arrays(16), 4, devices=devices[:1]) as feeder:
        state = feeder.get_state()
        with pytest.raises(
            ValueError,
            match=rf"`state\['{field}'\]`={value!r} must be an integer >= 0.*; pass a dict from "
            r"get_state\(\)",
        ):
            feeder.set_state({**state, field: value})
        assert take(feeder, 1)[0][:2] == (0, 0), "a refused state must not move the feeder"


def test_restoring_into_another_replica_count_continues_the_same_stream(devices):
    """The global order does not depend on how many replicas (or hosts) split each batch."""

    def build(replicas):
        return fp.Feeder(index_arrays(18), 4, devices=devices[:replicas], shuffle=True, seed=3)

    with build(4) as whole:
        stream = take(whole, 5)
    with build(2) as first:
        take(first, 2)
        state = first.get_state()
    with build(4) as resumed:
        resumed.set_state(state)
        assert take(resumed, 3) == stream[2:]


def test_set_state_during_a_loop_is_refused(devices):
    with fp.Feeder(index_arrays(16), 4, devices=devices[:1]) as feeder:
        state = feeder.get_state()
        for _ in feeder:
            with pytest.raises(RuntimeError, match="set_state"):
                feeder.set_state(state)
            break


def test_resume_of_a_generator_that_shuffles_by_epoch_gives_the_same_stream(devices):
    """A generator told the epoch (`fn(shard, num_shards, epoch)`) can seed its shuffle from it,
    so a restore into a new feeder repeats the epoch's order and skips exactly what was taken."""

    def shuffled(shard, num_shards, epoch):
        for index in np.random.default_rng(epoch).permutation(10)[shard::num_shards]:
            yield index_sample(int(index))

    def build():
        return fp.Feeder(fp.from_generator(shuffled), 4, devices=devices[:2])

    with build() as feeder:
        stream = take(feeder, 9)  # 3 batches per epoch, the last padded
    assert sorted(i for s in stream[3:5] for i in s[2]) != list(range(8))
    for stop in range(9):
        with build() as interrupted:
            take(interrupted, stop)
            state = interrupted.get_state()
        with build() as resumed:
            resumed.set_state(state)
            assert take(resumed, 9 - stop) == stream[stop:], f"resumed after {stop} steps"


@pytest.mark.parametrize("reshuffle", [True, False])
def test_a_tf_data_source_resumes_exactly_or_refuses_saying_why(devices, reshuffle):
    """Resuming skips the batches already taken of a new iteration: exact when the dataset
    repeats its order, and refused (never 16 of 64 samples twice and 16 never) when it does
    not."""

    def build():
        dataset = tf.data.Dataset.from_tensor_slices(index_arrays(64))
        dataset = dataset.shuffle(64, seed=7, reshuffle_each_iteration=reshuffle)
        return fp.Feeder(dataset, 16, devices=devices[:2])

    with build() as feeder:
        take(feeder, 1)
        state = feeder.get_state()
        rest = take(feeder, 3)
    with build() as resumed:
        if reshuffle:
            with pytest.raises(ValueError, match=r"reshuffle_each_iteration=True.*the 16 samples"):
                resumed.set_state(state)
            assert take(resumed, 1)[0][:2] == (0, 0), "a refused state must not move the feeder"
        else:
            resumed.set_state(state)
            assert take(resumed, 3) == rest
            assert sorted(i for s in rest for i in s[2]) == sorted(
                set(range(64)) - set(take(build(), 1)[0][2])
            )


def test_a_generator_state_restored_into_another_worker_count_names_num_shards(devices):
    """A generator's order is the rotation of its shards, one per worker."""

    def build(workers):
        return fp.Feeder(
            fp.from_generator(sharded_range(24)),
            4,
            devices=devices[:2],
            workers=workers,
            worker_mode="thread",
        )

    with build(2) as feeder:
        take(feeder, 2)
        state = feeder.get_state()
    assert state["num_shards"] == 2
    for workers in (0, 3):
        with build(workers) as other, pytest.raises(ValueError, match=r"num_shards=2 .*workers=2"):
            other.set_state(state)
    with build(2) as same:
        same.set_state(state)


def test_a_generator_that_ignores_its_shard_is_warned_about(devices):
    def unsharded(shard, num_shards):
        yield from sharded_range(8)(0, 1)

    with (
        pytest.warns(UserWarning, match=r"ignore \(shard, num_shards\).*each of the 2 workers"),
        fp.Feeder(
            fp.from_generator(unsharded), 4, devices=devices[:2], workers=2, worker_mode="thread"
        ),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp.Feeder(
            fp.from_generator(sharded_range(8)),
            4,
            devices=devices[:2],
            workers=2,
            worker_mode="thread",
        ).close()


def test_checkpoint_round_trips_the_position(devices, tmp_path):
    def build():
        return fp.Feeder(CountingSource(20), 4, devices=devices[:2], shuffle=True, seed=1)

    with build() as feeder:
        reference = take(feeder, 7)
    with build() as feeder:
        assert take(feeder, 3) == reference[:3]
        path = tf.train.Checkpoint(feeder=feeder).save(str(tmp_path / "ckpt"))
        assert take(feeder, 1) == reference[3:4]
    with build() as restored:
        tf.train.Checkpoint(feeder=restored).restore(path).assert_consumed()
        assert restored.get_state()["step"] == 3
        assert take(restored, 4) == reference[3:]


# ---- bounded memory -------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_host_slots_never_exceed_depth_plus_two(devices, depth):
    with fp.Feeder(index_arrays(60), 4, devices=devices[:2], depth=depth) as feeder:
        for _ in range(3):
            assert epoch_ids(feeder) == list(range(60))
        pool = feeder._assembly.pools[False]
        assert pool.allocated <= depth + 2
        assert pool.overflow_allocations == 0
        assert feeder.stats().overflow_slots == 0


@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_batches_wait_on_the_devices(devices, depth):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:2], depth=depth) as feeder:
        seen = []
        for _ in feeder:
            time.sleep(0.01)  # the producer runs ahead until the staged batches fill up
            seen.append(feeder._assembly.pipeline.handoff.staged)
    assert max(seen) == depth


def list_with_timeout(feeder, timeout_s=20.0):
    """`list(feeder)` in a helper thread, failing instead of hanging if it deadlocks."""
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("batches", list(feeder)), name="test-consumer", daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "list(feeder) deadlocked"
    return result["batches"]


def test_a_consumer_that_keeps_every_batch_gets_correct_data(devices):
    with fp.Feeder(
        CountingSource(50), 4, devices=devices[:2], depth=1, shuffle=True, seed=4
    ) as feeder:
        batches = list_with_timeout(feeder)
        assert [i for b in batches for i in real_ids(b)] == Sampler(
            50, 4, shuffle=True, seed=4
        ).order(0).tolist()
        assert feeder.stats().overflow_slots > 0
        again = list_with_timeout(feeder)
        assert [i for b in again for i in real_ids(b)] == Sampler(
            50, 4, shuffle=True, seed=4
        ).order(1).tolist()
        for batch in batches + again:
            assert_padding_is_masked_and_repeats_real_rows(batch, 4)


def test_a_kept_batch_keeps_its_values_while_later_batches_arrive(devices):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:2], depth=2) as feeder:
        kept = []
        for _ in range(3):
            for batch in feeder:
                if batch.step % 3 == 0:
                    kept.append((batch.step, batch.replicas[1][0]))
        assert len(kept) == 12
        for step, features in kept:
            expected = np.repeat(np.arange(step * 4 + 2, step * 4 + 4)[:, None], 3, axis=1)
            np.testing.assert_array_equal(features.numpy(), expected.astype(np.float32))


# ---- as_dataset -----------------------------------------------------------------------------


def test_as_dataset_weights_padding_zero_and_scales_real_rows(devices):
    with fp.Feeder(index_arrays(13), 8, devices=devices[:4]) as feeder:
        dataset = feeder.as_dataset(pad_last=True)
        assert int(dataset.cardinality()) == len(feeder) == 2
        for _ in range(2):  # each pass is the next epoch
            elements = [tuple(np.asarray(leaf) for leaf in e) for e in dataset]
            assert len(elements) == 2
            (_, _, w0), (_, _, w1) = elements
            np.testing.assert_array_equal(w0, np.ones(8, np.float32))
            np.testing.assert_allclose(w1, [8 / 5] * 5 + [0.0] * 3)
            ids = [host_batch_ids(e[:2]).tolist() for e in elements]
            assert ids == [list(range(8)), [8, 9, 10, 11, 12, 8, 9, 10]]
            assert float(w1.sum() / 8) == pytest.approx(1.0), "mean loss over real rows"
        assert take(feeder, 1)[0][:2] == (2, 0)


def test_as_dataset_scales_the_weights_of_an_x_y_w_source(devices):
    features, labels = index_arrays(13)
    weights = np.linspace(0.5, 2.0, 13).astype(np.float32)
    with fp.Feeder((features, labels, weights), 8, devices=devices[:2]) as feeder:
        elements = list(feeder.as_dataset(pad_last=True).as_numpy_iterator())
    assert len(elements) == 2 and all(len(e) == 3 for e in elements)
    np.testing.assert_allclose(elements[0][2], weights[:8])
    np.testing.assert_allclose(elements[1][2][:5], weights[8:] * 8 / 5, rtol=1e-6)
    np.testing.assert_array_equal(elements[1][2][5:], 0.0)


def test_as_dataset_of_dropped_remainder_adds_no_weights(devices):
    with pytest.warns(UserWarning, match="last 5 "):
        feeder = fp.Feeder(index_arrays(13), 8, devices=devices[:2], remainder="drop")
    with feeder:
        elements = list(feeder.as_dataset().as_numpy_iterator())
    assert len(elements) == 1 and len(elements[0]) == 2
    assert elements[0][1].tolist() == list(range(8))


def test_as_dataset_and_iteration_share_the_position(devices):
    with fp.Feeder(index_arrays(16), 4, devices=devices[:2]) as feeder:
        take(feeder, 2)
        rest = [host_batch_ids(e).tolist() for e in feeder.as_dataset()]
        assert rest == [list(range(8, 12)), list(range(12, 16))]
        assert [host_batch_ids(e).tolist() for e in feeder.as_dataset()] == [
            list(range(i, i + 4)) for i in range(0, 16, 4)
        ]
        assert take(feeder, 1) == [(2, 0, (0, 1, 2, 3))]


def test_as_dataset_of_a_feeder_restored_mid_epoch_serves_the_rest_of_it(devices):
    """Keras runs every epoch of a fit for the dataset's length: a dataset made mid-epoch is the
    rest of that epoch, and read again it refuses the full epoch with the fix."""
    with fp.Feeder(index_arrays(16), 4, devices=devices[:2]) as feeder:
        take(feeder, 3)
        state = feeder.get_state()
    with fp.Feeder(index_arrays(16), 4, devices=devices[:2]) as restored:
        restored.set_state(state)
        dataset = restored.as_dataset()
        assert int(dataset.cardinality()) == 1
        assert [host_batch_ids(e).tolist() for e in dataset] == [list(range(12, 16))]
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"make a new one"):
            list(dataset)
        assert len(list(restored.as_dataset())) == 4


def test_two_interleaved_dataset_iterators_are_refused_with_feedpipes_message(devices):
    with fp.Feeder(index_arrays(16), 4, devices=devices[:2]) as feeder:
        dataset = feeder.as_dataset()
        first, second = iter(dataset), iter(dataset)
        next(first)
        assert host_batch_ids(next(second)).tolist() == [0, 1, 2, 3]  # the first, superseded
        with pytest.raises(tf.errors.OpError, match=r"was superseded.*one consumer"):
            next(first)
        assert host_batch_ids(next(second)).tolist() == [4, 5, 6, 7]


def test_no_worker_thread_or_memory_left_after_dropping_a_feeder_and_its_dataset(devices):
    """The dataset holds its feeder, never the other way round: dropping both frees them,
    however long TensorFlow keeps the dataset's generator function."""
    feeder = fp.Feeder(
        index_arrays(40), 4, devices=devices[:2], workers=2, transform=lambda sample: sample
    )
    dataset = feeder.as_dataset()
    next(iter(dataset))
    assert len(feeder_processes := feedpipe_processes()) == 2, feeder_processes
    del feeder, dataset
    assert wait_for_no_feedpipe_threads() == []
    deadline = time.monotonic() + 5.0
    while feedpipe_processes() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert feedpipe_processes() == []


# ---- bad input ----------------------------------------------------------------------------


def test_global_batch_not_divisible_by_the_replicas_names_both_numbers(devices):
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size`=30 is not divisible by the 4 replicas; use a multiple of 4",
    ):
        fp.Feeder(index_arrays(40), 30, devices=devices)


def test_global_batch_not_divisible_by_the_strategy_replicas(strategy):
    with pytest.raises(ValueError, match=r"`global_batch_size`=6 .* 4 replicas"):
        fp.Feeder(index_arrays(40), 6, strategy=strategy)


@pytest.mark.parametrize("value", [0, -4, 2.5, True, "8"])
def test_bad_global_batch_size_names_the_value(value):
    with pytest.raises(ValueError, match=rf"`global_batch_size`={value!r} must be an integer"):
        fp.Feeder(index_arrays(40), value)


def test_arrays_of_unequal_length_name_each_length():
    with pytest.raises(
        ValueError,
        match=r"`source` have unequal lengths \(\[0\] has 10, \[1\] has 9\)",
    ):
        fp.Feeder((np.zeros((10, 3)), np.zeros(9)), 2)
    with pytest.raises(ValueError, match=r"\['x'\] has 10, \['y'\] has 11"):
        fp.Feeder({"x": np.zeros((10, 3)), "y": np.zeros(11)}, 2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.zeros((0, 3), np.float32), r"`source` is empty \(0 samples\)"),
        (lambda: CountingSource(0), r"`source` is empty \(0 samples\)"),
        (lambda: fp.from_generator(sharded_range(0)), r"empty.*generator yielded no sample"),
        (lambda: tf.data.Dataset.range(0), r"empty.*0 elements"),
        (lambda: index_pydataset(0, 4), r"empty.*0 batches"),
    ],
    ids=["array", "map", "generator", "tfdata", "pydataset"],
)
def test_empty_dataset_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        fp.Feeder(make(), 2)


class CountingStrings(CountingSource):
    def __init__(self):
        super().__init__(4)

    def __getitem__(self, index):
        return super().__getitem__(index)[0], "cat"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (np.array(["a", "b"]), r"Field sample of `source` has dtype <U1, which cannot be staged"),
        (np.array([object(), object()]), r"Field sample of `source` has dtype object"),
        (np.array([1, 2.5], dtype=object), r"Field sample of `source` has dtype object"),
        (
            {"x": np.zeros((2, 3)), "name": np.array([b"a", b"b"])},
            r"Field \['name'\] of `source` has dtype \|S1",
        ),
        (CountingStrings(), r"Field \[1\] of sample 0 has dtype <U3, which cannot be staged"),
        (
            fp.from_generator(lambda shard, num_shards: iter([(1.0, object())])),
            r"Field \[1\] of sample 0 has dtype object",
        ),
    ],
    ids=["str", "object", "object-of-numbers", "bytes-in-dict", "map", "generator"],
)
def test_object_and_string_dtypes_are_refused(source, message):
    with pytest.raises(TypeError, match=message):
        fp.Feeder(source, 2)


def test_string_arrays_are_read_by_a_transform(devices):
    """Paths (strings) are a source when a `transform` turns them into numbers; without one
    they are refused above."""
    paths = np.array([f"images/{i}.jpg" for i in range(6)])

    def read(sample):
        path, label = sample
        return np.float32(len(path)), label

    with fp.Feeder((paths, np.arange(6)), 3, devices=devices[:1], transform=read) as feeder:
        batch = next(iter(feeder))
    assert batch.replicas[0][0].numpy().tolist() == [12.0, 12.0, 12.0]
    assert batch.replicas[0][1].numpy().tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match=r"Field \[0\] of sample 0 has dtype <U12"):
        fp.Feeder((paths, np.arange(6)), 3, transform=lambda sample: sample)


@pytest.mark.parametrize("depth", [0, -1])
def test_depth_below_one_is_refused(depth):
    with pytest.raises(ValueError, match=rf"`depth`={depth} must be an integer >= 1"):
        fp.Feeder(index_arrays(8), 2, depth=depth)


def test_unknown_remainder_is_refused():
    with pytest.raises(
        ValueError,
        match=r"`remainder`='trim' is not a known policy; use one of 'pad', 'drop', 'error'",
    ):
        fp.Feeder(index_arrays(8), 2, remainder="trim")


@pytest.mark.parametrize(
    "device",
    [
        "/cpu:9",
        pytest.param("/gpu:0", marks=pytest.mark.skipif(HAS_GPU, reason="this machine has one")),
        "/gpu:99",
        "/tpu:0",
        "banana",
    ],
)
def test_unknown_device_is_refused(device, devices):
    with pytest.raises(ValueError, match=rf"`devices` names '{device}', which is not a device"):
        fp.Feeder(index_arrays(8), 2, devices=[devices[0], device])


def test_a_device_listed_twice_is_refused():
    with pytest.raises(ValueError, match=r"names a device twice"):
        fp.Feeder(index_arrays(8), 2, devices=["/cpu:0", "/CPU:0"])


def test_devices_as_one_string_is_refused():
    with pytest.raises(TypeError, match=r"`devices`='/cpu:0' must be a list"):
        fp.Feeder(index_arrays(8), 2, devices="/cpu:0")


def test_error_remainder_refuses_a_length_off_a_multiple():
    with pytest.raises(
        ValueError,
        match=r'`remainder`="error" .* 13 samples leave 5 over with `global_batch_size`=8',
    ):
        fp.Feeder(index_arrays(13), 8, remainder="error")
    with pytest.raises(ValueError, match=r'`remainder`="error" .* 13 samples leave 5 over'):
        fp.Feeder(tf.data.Dataset.from_tensor_slices(index_arrays(13)), 8, remainder="error")


def test_drop_remainder_refuses_a_dataset_smaller_than_a_batch():
    with pytest.raises(
        ValueError,
        match=r'`remainder`="drop" with 3 samples and `global_batch_size`=8 leaves no batch',
    ):
        fp.Feeder(index_arrays(3), 8, remainder="drop")


@pytest.mark.parametrize("workers", [-1, 1.5, True])
def test_workers_must_be_a_count(workers):
    with pytest.raises(ValueError, match=rf"`workers`={workers!r} must be an integer >= 0"):
        fp.Feeder(index_arrays(8), 2, workers=workers)


@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_shuffle_is_refused_for_sources_without_indices(kind):
    with pytest.raises(ValueError, match=r"`shuffle`=True, but a \w+ has no indices to shuffle"):
        fp.Feeder(make_source(kind, 8), 2, shuffle=True)


def test_a_bare_generator_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"fp\.from_generator\(fn\)"):
        fp.Feeder((index_sample(i) for i in range(4)), 2)


def test_a_transform_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"`transform` must be callable or None; got int"):
        fp.Feeder(index_arrays(8), 2, transform=3)


@pytest.mark.parametrize("seed", [-1, 1.5])
def test_a_bad_seed_is_refused(seed):
    with pytest.raises(ValueError, match=rf"`seed`={seed!r} must be an integer >= 0"):
        fp.Feeder(index_arrays(8), 2, seed=seed)


def test_a_seed_beyond_int64_is_refused_at_construction_naming_seed():
    """A transform taking `seed` gets it as an int64: a larger seed is refused when the feeder
    is built, not by the first sample's transform."""
    with pytest.raises(ValueError, match=r"`seed`=9223372036854775808 must be below 2\*\*63"):
        fp.Feeder(index_arrays(8), 2, seed=2**63, transform=lambda sample, seed: sample)
    with fp.Feeder(index_arrays(8), 2, seed=2**63 - 1) as feeder:
        assert feeder.options.seed == 2**63 - 1


def test_numpy_integer_settings_leave_a_state_that_json_and_checkpoints_take(devices, tmp_path):
    """A batch size or seed given as a numpy integer is kept as an `int`, so the state is the
    plain one a Python int gives."""
    with fp.Feeder(
        index_arrays(16), np.int64(4), devices=devices[:2], shuffle=True, seed=np.int32(3)
    ) as feeder:
        take(feeder, 1)
        state = feeder.get_state()
        assert json.loads(json.dumps(state)) == state
        assert [type(state[k]) for k in ("global_batch_size", "seed")] == [int, int]
        tf.train.Checkpoint(feeder=feeder).save(str(tmp_path / "ckpt"))


def test_repr_shows_the_settings(devices):
    with fp.Feeder(
        index_arrays(8), 4, devices=devices[:2], remainder="drop", shuffle=True, seed=3, depth=3
    ) as feeder:
        text = repr(feeder)
    for part in (
        "global_batch_size=4",
        "CPU:1",
        "remainder='drop'",
        "shuffle=True",
        "seed=3",
        "depth=3",
        "workers=0",
    ):
        assert part in text


def test_len_is_the_steps_per_epoch(devices):
    assert len(fp.Feeder(index_arrays(13), 4, devices=devices[:1])) == 4
    with pytest.warns(UserWarning):
        assert len(fp.Feeder(index_arrays(13), 4, devices=devices[:1], remainder="drop")) == 3
    generator = fp.Feeder(fp.from_generator(sharded_range(13)), 4, devices=devices[:1])
    with pytest.raises(TypeError, match="number of steps is unknown"):
        len(generator)
    dataset = fp.Feeder(tf.data.Dataset.from_tensor_slices(index_arrays(13)), 4)
    assert len(dataset) == 4
