"""Split: each replica takes its own contiguous rows; sizes that cannot be split are refused."""

from __future__ import annotations

import pytest

from feedpipe.split import ReplicaSplit


def test_each_replica_takes_its_own_contiguous_rows():
    split = ReplicaSplit(12, 4)
    assert split.per_replica == 3
    assert [list(split.rows(r)) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_global_batch_not_divisible_by_the_replicas_names_both_numbers():
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size`=30 is not divisible by the 4 "
        r"replicas; use a multiple of 4 \(for example 28\)",
    ):
        ReplicaSplit(30, 4)


@pytest.mark.parametrize(
    ("name", "args"),
    [("global_batch_size", (0, 1)), ("num_replicas", (4, 0)), ("global_batch_size", (True, 1))],
)
def test_non_positive_sizes_are_refused(name, args):
    with pytest.raises(ValueError, match=rf"`{name}`=.* must be a positive integer"):
        ReplicaSplit(*args)
