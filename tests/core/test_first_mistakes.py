"""The mistakes a newcomer makes first get a message that says what was read and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.core.sources import as_source, from_generator


def test_a_list_of_field_arrays_is_told_a_tuple_holds_fields():
    x, y = np.zeros((1000, 32), np.float32), np.zeros(1000, np.int64)
    with pytest.raises(
        ValueError,
        match=r"list, which is read as samples.*\(\(1000, 32\), "
        r"\(1000,\)\).*fp\.Feeder\(\(x, y\), \.\.\.\)",
    ):
        as_source([x, y])


def test_a_list_of_samples_of_one_shape_is_still_samples():
    source = as_source([np.zeros(3), np.ones(3)])
    assert len(source.data) == 2


@pytest.mark.parametrize(
    "fields",
    [
        [np.zeros((1000, 10), np.float32), np.eye(10, dtype=np.float32)[np.arange(1000) % 10]],
        [np.zeros((500, 28, 28), np.float32), np.ones((500, 28, 28), np.float32)],  # siamese
    ],
    ids=["x and one-hot y", "siamese pair"],
)
def test_a_list_of_same_shaped_field_arrays_smaller_than_the_batch_is_told_the_tuple_form(
    fields,
):
    n = len(fields[0])
    with pytest.raises(
        ValueError,
        match=rf"list of 2 arrays of shape \({n}, .*read as 2 samples, fewer than "
        rf"`global_batch_size`=64.*fields of {n} samples.*tuple, fp\.Feeder\(\(x, y\), 64\)"
        r".*np\.stack",
    ):
        as_source(fields, global_batch_size=64)


def test_a_list_of_as_many_same_shaped_samples_as_the_batch_is_still_samples():
    samples = [np.full((100, 3), i, np.float32) for i in range(64)]
    assert len(as_source(samples, global_batch_size=64).data) == 64


def test_a_short_list_of_small_samples_is_still_samples():
    # Each array's first dimension (3) is no longer than the list: these read as samples.
    samples = [np.full(3, i, np.float32) for i in range(5)]
    assert len(as_source(samples, global_batch_size=64).data) == 5


@pytest.mark.parametrize(
    "fn", [lambda: iter([1]), lambda rows: iter(rows)], ids=["0 args", "1 arg"]
)
def test_a_generator_function_without_the_shard_arguments_is_told_its_signature(fn):
    with pytest.raises(
        TypeError,
        match=r"must take fn\(shard, num_shards\).*worker i calls "
        r"fn\(i, N\).*itertools\.islice",
    ):
        from_generator(fn)


def test_a_generator_function_taking_the_epoch_too_is_accepted():
    source = from_generator(lambda shard, num_shards, epoch: iter([epoch]))
    assert list(source.samples(3)) == [3]
