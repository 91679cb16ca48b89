"""Sources: every kind of input is adapted, checked against the first sample's spec, and
refused with an error that names the field, the sample and the value when it cannot be fed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import feedpipe as fp
from feedpipe.core.skips import ErrorPolicy
from feedpipe.core.sources import (
    ArraySource,
    GeneratorSource,
    MapSource,
    PyDatasetSource,
    SampleSpec,
    TFDatasetSource,
    as_source,
)
from tests.fakes import CountingSource, SourceBroke, index_arrays, index_pydataset, sharded_range


def test_spec_reads_structure_shapes_and_dtypes():
    spec = SampleSpec.of({"image": np.zeros((2, 3), np.uint8), "label": np.int64(1)})
    assert [(leaf.name, leaf.shape, leaf.dtype) for leaf in spec.leaves] == [
        ("['image']", (2, 3), np.dtype(np.uint8)),
        ("['label']", (), np.dtype(np.int64)),
    ]
    assert spec.row_bytes == 6 + 8


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.int8, np.uint16, np.float16, np.complex64, ml_dtypes.bfloat16]
)
def test_numeric_and_bool_dtypes_are_accepted(dtype):
    SampleSpec.of(np.zeros(2, dtype))


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (np.array("text"), "<U4"),
        (np.array(b"raw"), "|S3"),
        (np.array(object()), "object"),
        (np.array("2024-01-01", dtype="datetime64[D]"), "datetime64"),
    ],
)
def test_object_string_and_time_dtypes_are_refused(value, dtype):
    with pytest.raises(TypeError, match=rf"Field \['name'\] of sample 7 has dtype {dtype}"):
        SampleSpec.of({"name": value, "x": np.zeros(1)}, index=7)


def test_a_sample_without_fields_is_refused():
    with pytest.raises(ValueError, match=r"Sample 0 has no fields"):
        SampleSpec.of(())


def test_a_sample_of_another_shape_names_field_index_and_both_shapes():
    spec = SampleSpec.of((np.zeros((2, 3), np.float32), np.int64(0)))
    with pytest.raises(
        ValueError,
        match=r"Field \[0\] of sample 42 has shape \(3, 2\) and dtype float32, but the first "
        r"sample had shape \(2, 3\) and dtype float32",
    ):
        spec.flatten((np.zeros((3, 2), np.float32), np.int64(0)), 42)


def test_a_sample_of_another_dtype_names_both_dtypes():
    spec = SampleSpec.of((np.zeros(2, np.float32),))
    with pytest.raises(ValueError, match=r"sample 3 has shape \(2,\) and dtype float64.*float32"):
        spec.flatten((np.zeros(2, np.float64),), 3)


def test_a_sample_of_another_structure_is_refused():
    spec = SampleSpec.of({"x": np.zeros(2)})
    with pytest.raises(ValueError, match=r"Sample 5 has structure .* but the first sample had"):
        spec.flatten({"x": np.zeros(2), "y": np.zeros(2)}, 5)


def test_spec_round_trips_a_sample():
    sample = {"b": (np.ones(2), np.int32(4)), "a": np.zeros((1, 2))}
    spec = SampleSpec.of(sample)
    rebuilt = spec.unflatten(spec.flatten(sample, 0))
    assert set(rebuilt) == {"a", "b"}
    np.testing.assert_array_equal(rebuilt["b"][0], np.ones(2))


def test_array_source_samples_and_gathers_rows():
    features, labels = index_arrays(6)
    source = ArraySource({"f": features, "y": labels})
    assert source.length == 6
    np.testing.assert_array_equal(source.sample(4)["f"], features[4])
    outs = [np.empty((3, 3), np.float32), np.empty(3, np.int64)]
    source.take(np.array([5, 0, 2]), outs)
    np.testing.assert_array_equal(outs[1], [5, 0, 2])
    np.testing.assert_array_equal(outs[0], features[[5, 0, 2]])


def test_arrays_of_unequal_length_name_each_field_and_length():
    with pytest.raises(ValueError, match=r"unequal lengths \(\['a'\] has 4, \['b'\] has 5\)"):
        ArraySource({"a": np.zeros(4), "b": np.zeros(5)})


@pytest.mark.parametrize("count", [8, 1000])
def test_a_list_of_arrays_as_a_field_is_refused_in_a_few_words_with_the_fix(count):
    images = [np.zeros((8, 8, 3), np.float32) for _ in range(count)]
    with pytest.raises(TypeError, match=r"Field \[0\] of `source` is a list of .* items") as info:
        ArraySource((images, np.zeros(count, np.int64)))
    message = str(info.value)
    assert "np.stack(images)" in message and "list(zip(images, labels))" in message
    assert len(message) < 300


def test_a_scalar_array_is_refused():
    with pytest.raises(ValueError, match=r"Field \[1\] of `source` is a scalar"):
        ArraySource((np.zeros(3), np.float32(1.0)))


def test_an_object_array_is_refused_before_it_is_cast_silently():
    with pytest.raises(TypeError, match=r"Field \['y'\] of `source` has dtype object"):
        ArraySource({"x": np.zeros(3), "y": np.array([1, 2.5, 3], dtype=object)})


def test_pydataset_rows_are_its_batches_rows():
    dataset = index_pydataset(11, 4)
    source = PyDatasetSource(dataset)
    assert (source.length, source.block_size, source.num_batches) == (11, 4, 3)
    for index in (0, 3, 4, 10):
        features, label = source.sample(index)
        assert int(label) == index and features.tolist() == [index] * 3


def test_pydataset_source_reads_each_batch_once_for_consecutive_rows():
    dataset = index_pydataset(11, 4)
    source = PyDatasetSource(dataset)
    source.measure()
    dataset.batch_reads.clear()
    for index in range(11):
        source.sample(index)
    assert max(dataset.batch_reads.values()) == 1
    source.on_epoch_end()
    assert dataset.epochs_ended == 1


def test_a_pydataset_batch_read_to_learn_the_length_raises_with_a_note_saying_so():
    for broken, why in ((0, "learn its batch size"), (2, "count its rows")):
        with pytest.raises(SourceBroke) as info:
            PyDatasetSource(index_pydataset(11, 4, broken={broken})).measure()
        assert f"while reading batch {broken} of the PyDataset, to {why}" in info.value.__notes__[0]


def test_under_skip_a_pydataset_batch_that_raises_is_passed_over_within_the_budget():
    def measure(broken, max_skipped):
        dataset = index_pydataset(11, 4, broken=broken)
        return PyDatasetSource(dataset).measure(ErrorPolicy("skip", max_skipped))

    assert measure({0}, 4) == (4, 11)  # its 4 rows will be skipped in each epoch
    with pytest.raises(SourceBroke) as info:
        measure({0}, 3)
    assert 'errors="skip" would skip 4 samples of epoch 0 (batches 0)' in info.value.__notes__[-1]
    with pytest.raises(SourceBroke) as info:
        measure({0, 1}, 8)  # every batch but the last raises: none tells the batch size
    assert "passed over PyDataset batches 0, 1, which all raised" in info.value.__notes__[-1]
    with pytest.raises(SourceBroke) as info:
        measure({2}, 4)  # the last batch: its rows are the length
    assert 'which the length depends on (errors="skip" cannot pass over it)' in "\n".join(
        info.value.__notes__
    )


def test_pydataset_with_uneven_inner_batches_is_refused():
    import keras

    class Uneven(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, number):
            return np.zeros((4 if number != 1 else 2, 1)), np.zeros(4)

    source = PyDatasetSource(Uneven())
    with pytest.raises(ValueError, match=r"PyDataset batch 1 has fields with \[2, 4\] rows"):
        source.sample(5)


def test_generator_source_calls_fn_once_per_epoch_with_one_shard():
    calls = []

    def generate(shard, num_shards):
        calls.append((shard, num_shards))
        yield from sharded_range(3)(shard, num_shards)

    source = fp.from_generator(generate)
    assert [int(s[1]) for s in source.samples(0)] == [0, 1, 2]
    assert [int(s[1]) for s in source.samples(1)] == [0, 1, 2]
    assert calls == [(0, 1), (0, 1)]


def test_a_generator_that_takes_three_arguments_is_told_the_epoch():
    calls = []

    def generate(shard, num_shards, epoch):
        calls.append((shard, num_shards, epoch))
        yield from sharded_range(3)(shard, num_shards)

    source = fp.from_generator(generate)
    for epoch in (0, 5):
        assert [int(s[1]) for s in source.samples(epoch)] == [0, 1, 2]
    assert calls == [(0, 1, 0), (0, 1, 5)]


def test_from_generator_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match=r"needs a callable fn\(shard, num_shards\).*got list"):
        fp.from_generator([1, 2, 3])


def test_empty_generator_is_refused():
    with pytest.raises(ValueError, match="generator yielded no sample"):
        fp.from_generator(sharded_range(0)).first_sample()


@pytest.mark.parametrize(
    ("shuffle", "why"),
    [
        ({}, r"anew on each iteration \(reshuffle_each_iteration=True\)"),
        ({"seed": 3}, r"anew on each iteration"),
        ({"reshuffle_each_iteration": False}, "without a seed"),
    ],
)
def test_a_tf_dataset_whose_order_changes_between_iterations_cannot_resume_mid_epoch(shuffle, why):
    tf.random.set_seed(None)  # a global seed left by another test would seed the shuffle
    dataset = tf.data.Dataset.from_tensor_slices(index_arrays(64)).shuffle(64, **shuffle)
    source = TFDatasetSource(dataset.map(lambda x, y: (x, y)).batch(1).unbatch())
    with pytest.raises(ValueError, match=rf"Cannot restore mid-epoch.*{why}.*skipping the 16"):
        source.check_resumable(16)


def test_a_tf_dataset_shuffled_the_same_way_every_iteration_can_resume_mid_epoch():
    dataset = tf.data.Dataset.from_tensor_slices(index_arrays(64))
    TFDatasetSource(dataset.shuffle(64, seed=3, reshuffle_each_iteration=False)).check_resumable(16)
    TFDatasetSource(dataset).check_resumable(16)


def test_tf_dataset_blocks_are_batched_by_tensorflow():
    source = TFDatasetSource(tf.data.Dataset.from_tensor_slices(index_arrays(7)))
    assert source.length == 7
    blocks = list(source.blocks(3))
    assert [len(b[1]) for b in blocks] == [3, 3, 1]
    assert np.concatenate([b[1] for b in blocks]).tolist() == list(range(7))


def test_infinite_tf_dataset_is_refused():
    with pytest.raises(ValueError, match=r"infinite tf.data.Dataset.*dataset.take\(n\)"):
        TFDatasetSource(tf.data.Dataset.range(3).repeat())


def test_tf_dataset_of_unknown_shape_is_refused():
    ragged = tf.data.Dataset.range(1, 4).map(lambda n: tf.zeros([n]))
    with pytest.raises(
        ValueError,
        match=r"Field sample of the tf.data.Dataset's elements is "
        r"TensorSpec\(shape=\(None,\)",
    ):
        TFDatasetSource(ragged)


def test_tf_dataset_of_unknown_length_is_a_stream():
    filtered = tf.data.Dataset.range(10).filter(lambda i: i % 2 == 0)
    assert TFDatasetSource(filtered).length is None


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: np.zeros((3, 2)), ArraySource),
        (lambda: index_arrays(3), ArraySource),
        (lambda: {"a": np.zeros(3)}, ArraySource),
        (lambda: tf.zeros((3, 2)), ArraySource),
        (lambda: CountingSource(3), MapSource),
        (lambda: index_pydataset(3, 2), PyDatasetSource),
        (lambda: fp.from_generator(sharded_range(3)), GeneratorSource),
        (lambda: tf.data.Dataset.range(3), TFDatasetSource),
    ],
    ids=["array", "tuple", "dict", "tensor", "map", "pydataset", "generator", "tfdata"],
)
def test_each_kind_of_input_gets_its_source(make, kind):
    assert isinstance(as_source(make()), kind)


def test_a_generator_function_passed_bare_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"wrap a generator function as fp.from_generator\(fn\)"):
        as_source(sharded_range(3))


def test_an_unsupported_source_is_refused():
    with pytest.raises(TypeError, match=r"`source` of type int is not supported"):
        as_source(5)
