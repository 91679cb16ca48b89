"""The sampler: each epoch's order is a pure function of (seed, epoch, length, block size), and
the remainder policy shapes the last batch exactly as promised."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.remainder import check_remainder
from feedpipe.sampler import Sampler


def test_without_shuffle_the_order_is_the_dataset_order():
    sampler = Sampler(10, 4)
    for epoch in range(3):
        assert sampler.order(epoch).tolist() == list(range(10))


def test_shuffled_order_is_a_permutation_of_the_dataset():
    order = Sampler(101, 8, shuffle=True, seed=3).order(0)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(101))
    assert order.tolist() != list(range(101))


def test_same_seed_and_epoch_give_the_same_order():
    a = Sampler(50, 8, shuffle=True, seed=3)
    b = Sampler(50, 8, shuffle=True, seed=3)
    assert a.order(4).tolist() == b.order(4).tolist()
    assert a.order(4).tolist() == a.order(4).tolist()


def test_next_epoch_gives_another_order():
    sampler = Sampler(50, 8, shuffle=True, seed=3)
    orders = {tuple(sampler.order(epoch).tolist()) for epoch in range(5)}
    assert len(orders) == 5


def test_different_seed_gives_another_order():
    assert (
        Sampler(50, 8, shuffle=True, seed=3).order(0).tolist()
        != Sampler(50, 8, shuffle=True, seed=4).order(0).tolist()
    )


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_order_does_not_depend_on_the_batch_size_or_remainder(remainder):
    reference = Sampler(48, 4, shuffle=True, seed=1).order(2)
    other = Sampler(48, 16, remainder=remainder, shuffle=True, seed=1).order(2)
    assert other.tolist() == reference.tolist()


def test_block_shuffle_keeps_each_block_whole_and_in_order():
    sampler = Sampler(14, 4, shuffle=True, seed=2, block_size=3)
    order = sampler.order(0).tolist()
    assert sorted(order) == list(range(14))
    blocks = []
    position = 0
    while position < len(order):
        start = order[position]
        assert start % 3 == 0, f"a block must start at a multiple of 3, got {start}"
        size = min(3, 14 - start)
        assert order[position : position + size] == list(range(start, start + size))
        blocks.append(start // 3)
        position += size
    assert sorted(blocks) == list(range(5))
    assert blocks != sorted(blocks) or sampler.order(1).tolist() != order


@pytest.mark.parametrize(
    ("length", "remainder", "steps", "last_valid"),
    [
        (13, "pad", 4, 1),
        (13, "drop", 3, 4),
        (12, "error", 3, 4),
        (12, "pad", 3, 4),
        (3, "pad", 1, 3),
        (1, "pad", 1, 1),
    ],
)
@pytest.mark.filterwarnings("ignore:remainder=.drop. leaves out")
def test_steps_cover_the_order_in_global_batches(length, remainder, steps, last_valid):
    sampler = Sampler(length, 4, remainder=remainder, shuffle=True, seed=5)
    planned = list(sampler.steps(1))
    assert len(planned) == len(sampler) == steps
    assert [s.index for s in planned] == list(range(steps))
    assert all(s.epoch == 1 for s in planned)
    assert [s.num_valid for s in planned] == [4] * (steps - 1) + [last_valid]
    rows = np.concatenate([s.rows for s in planned]).tolist()
    kept = length - (length % 4 if remainder == "drop" else 0)
    assert rows == sampler.order(1)[:kept].tolist()


def test_steps_can_start_mid_epoch():
    sampler = Sampler(13, 4, shuffle=True, seed=5)
    assert [s.rows.tolist() for s in sampler.steps(0, start=2)] == [
        s.rows.tolist() for s in list(sampler.steps(0))[2:]
    ]
    assert list(sampler.steps(0, start=len(sampler))) == []


def test_drop_warns_how_many_samples_each_epoch_loses():
    with pytest.warns(UserWarning, match=r'remainder="drop" leaves out the last 3 of 13 samples'):
        sampler = Sampler(13, 5, remainder="drop")
    assert sampler.dropped_per_epoch == 3


def test_drop_of_a_multiple_does_not_warn(recwarn):
    Sampler(15, 5, remainder="drop")
    assert not [w for w in recwarn if "drop" in str(w.message)]


def test_error_remainder_refuses_a_length_off_a_multiple():
    with pytest.raises(ValueError, match=r"13 samples leave 3 over with `global_batch_size`=5"):
        Sampler(13, 5, remainder="error")


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match=r"empty \(0 samples\)"):
        Sampler(0, 4)


def test_unknown_remainder_is_refused():
    with pytest.raises(ValueError, match=r"`remainder`='last' is not a known policy"):
        check_remainder("last")
    with pytest.raises(ValueError, match=r"`remainder`='last'"):
        Sampler(10, 2, remainder="last")


def test_repr_shows_the_settings():
    text = repr(Sampler(10, 2, shuffle=True, seed=4, block_size=3))
    for part in ("length=10", "global_batch_size=2", "shuffle=True", "seed=4", "block_size=3"):
        assert part in text
