"""The mistakes a newcomer makes first get a message that says what was read and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.core.source import as_source, from_generator


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
