"""The sampler: each epoch's order is a pure function of (seed, epoch, length, block size), and
the remainder policy shapes the last batch exactly as promised. The tests of the order run with
the full permutation and again with the lazy one, which a threshold of 0 gives every length."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.core import sampler as sampler_module
from feedpipe.core.remainder import check_remainder
from feedpipe.core.sampler import LAZY_SHUFFLE_ABOVE, LazyPermutation, Sampler


@pytest.fixture(params=["full", "lazy"])
def either_shuffle(request, monkeypatch):
    """Runs a test with the full permutation of each epoch, then with the lazy one."""
    if request.param == "lazy":
        monkeypatch.setattr(sampler_module, "LAZY_SHUFFLE_ABOVE", 0)
    return request.param


@pytest.fixture
def lazy(monkeypatch):
    """Samplers made in the test shuffle lazily at any length."""
    monkeypatch.setattr(sampler_module, "LAZY_SHUFFLE_ABOVE", 0)


def test_without_shuffle_the_order_is_the_dataset_order():
    sampler = Sampler(10, 4)
    for epoch in range(3):
        assert sampler.order(epoch).tolist() == list(range(10))


@pytest.mark.usefixtures("either_shuffle")
def test_shuffled_order_is_a_permutation_of_the_dataset():
    order = Sampler(101, 8, shuffle=True, seed=3).order(0)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(101))
    assert order.tolist() != list(range(101))


@pytest.mark.usefixtures("either_shuffle")
def test_same_seed_and_epoch_give_the_same_order():
    a = Sampler(50, 8, shuffle=True, seed=3)
    b = Sampler(50, 8, shuffle=True, seed=3)
    assert a.order(4).tolist() == b.order(4).tolist()
    assert a.order(4).tolist() == a.order(4).tolist()


@pytest.mark.usefixtures("either_shuffle")
def test_next_epoch_gives_another_order():
    sampler = Sampler(50, 8, shuffle=True, seed=3)
    orders = {tuple(sampler.order(epoch).tolist()) for epoch in range(5)}
    assert len(orders) == 5


@pytest.mark.usefixtures("either_shuffle")
def test_different_seed_gives_another_order():
    assert (
        Sampler(50, 8, shuffle=True, seed=3).order(0).tolist()
        != Sampler(50, 8, shuffle=True, seed=4).order(0).tolist()
    )


@pytest.mark.usefixtures("either_shuffle")
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_order_does_not_depend_on_the_batch_size_or_remainder(remainder):
    reference = Sampler(48, 4, shuffle=True, seed=1).order(2)
    other = Sampler(48, 16, remainder=remainder, shuffle=True, seed=1).order(2)
    assert other.tolist() == reference.tolist()


@pytest.mark.usefixtures("either_shuffle")
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


@pytest.mark.usefixtures("either_shuffle")
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


@pytest.mark.usefixtures("either_shuffle")
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


# ---- the lazy shuffle of large sources ------------------------------------------------------


def test_lengths_above_the_threshold_shuffle_lazily():
    assert Sampler(LAZY_SHUFFLE_ABOVE + 1, 8, shuffle=True).lazy
    assert not Sampler(LAZY_SHUFFLE_ABOVE, 8, shuffle=True).lazy
    assert not Sampler(LAZY_SHUFFLE_ABOVE + 1, 8).lazy


def test_orders_up_to_the_threshold_stay_the_full_permutation():
    """A run resumed on this version sees the order it started with."""
    order = Sampler(50, 8, shuffle=True, seed=3).order(2)
    np.testing.assert_array_equal(order, np.random.default_rng([3, 2]).permutation(50))


@pytest.mark.parametrize("length", [1, 2, 3, 4, 15, 16, 17, 255, 256, 257, 4099, 65_537, 1_000_003])
def test_lazy_permutation_takes_every_index_exactly_once(length):
    permutation = LazyPermutation(length, (3, 1))
    values = permutation(np.arange(length))
    assert values.dtype == np.int64
    np.testing.assert_array_equal(np.sort(values), np.arange(length))
    np.testing.assert_array_equal(permutation.inverse(values), np.arange(length))


def test_lazy_permutation_is_a_bijection_at_every_short_length():
    for length in range(1, 300):
        values = LazyPermutation(length, (length, 7))(np.arange(length))
        assert np.array_equal(np.sort(values), np.arange(length)), f"length {length}"


def test_lazy_permutation_gives_each_position_alone_what_the_whole_gives():
    permutation = LazyPermutation(1000, (2, 5))
    whole = permutation(np.arange(1000))
    positions = np.array([999, 0, 500, 500, 17])
    np.testing.assert_array_equal(permutation(positions), whole[positions])
    assert permutation(np.array([], dtype=np.int64)).tolist() == []


def test_lazy_permutation_is_a_pure_function_of_length_and_key():
    """Pinned: the same (seed, epoch) gives the same stream on any machine and version."""
    assert LazyPermutation(10, (1, 2))(np.arange(10)).tolist() == [0, 3, 9, 2, 7, 5, 4, 8, 1, 6]
    other_keys = {
        tuple(LazyPermutation(10, key)(np.arange(10)).tolist()) for key in ((1, 2), (1, 3), (2, 2))
    }
    assert len(other_keys) == 3


def test_lazy_permutation_refuses_positions_outside_its_length():
    with pytest.raises(
        IndexError, match=r"positions must lie in \[0, 10\); got values from 3 to 10"
    ):
        LazyPermutation(10, (0, 0))(np.array([3, 10]))
    with pytest.raises(ValueError, match=r"`length`=0 leaves nothing to permute"):
        LazyPermutation(0, (0, 0))


@pytest.mark.usefixtures("lazy")
def test_lazy_order_is_pinned_for_its_seed_and_epoch():
    sampler = Sampler(20, 4, shuffle=True, seed=3)
    assert sampler.lazy
    expected = [10, 13, 16, 6, 0, 19, 14, 17, 12, 15, 4, 1, 11, 7, 2, 5, 9, 3, 8, 18]
    assert sampler.order(1).tolist() == expected


def whole_blocks(order: list[int], length: int, block_size: int) -> list[int]:
    """The block numbers in `order`, checking that each block comes whole and in order."""
    blocks, position = [], 0
    while position < len(order):
        start = order[position]
        assert start % block_size == 0, f"a block must start at a multiple of {block_size}"
        size = min(block_size, length - start)
        assert order[position : position + size] == list(range(start, start + size))
        blocks.append(start // block_size)
        position += size
    return blocks


@pytest.mark.usefixtures("lazy")
def test_lazy_steps_are_the_order_in_blocks_for_every_short_length():
    """Including a short last block anywhere in the order, and steps that start mid-epoch."""
    for length in range(1, 41):
        for block_size in (1, 2, 3, 5, 8):
            sampler = Sampler(length, 6, shuffle=True, seed=length, block_size=block_size)
            order = sampler.order(2)
            assert sorted(order.tolist()) == list(range(length))
            blocks = whole_blocks(order.tolist(), length, block_size)
            assert sorted(blocks) == list(range(-(-length // block_size)))
            steps = list(sampler.steps(2))
            assert np.concatenate([s.rows for s in steps]).tolist() == order.tolist()
            assert [s.num_valid for s in steps] == [len(s.rows) for s in steps]
            later = [s.rows.tolist() for s in sampler.steps(2, start=len(steps) // 2)]
            assert later == [s.rows.tolist() for s in steps[len(steps) // 2 :]]


@pytest.mark.usefixtures("either_shuffle")
@pytest.mark.parametrize("block_size", [1, 3])
@pytest.mark.parametrize("length", [36, 37, 11, 1])
def test_hosts_shares_of_each_step_are_the_padded_one_host_batch(length, block_size):
    global_batch, hosts = 12, 3
    options = {"shuffle": True, "seed": 4, "block_size": block_size}
    one_host = list(Sampler(length, global_batch, **options).steps(1))
    per_host = global_batch // hosts
    plans = [
        list(
            Sampler(
                length, global_batch, share=range(h * per_host, (h + 1) * per_host), **options
            ).steps(1)
        )
        for h in range(hosts)
    ]
    for index, want in enumerate(one_host):
        padded = want.rows[np.arange(global_batch) % want.num_valid]
        mine = [plan[index] for plan in plans]
        np.testing.assert_array_equal(np.concatenate([step.rows for step in mine]), padded)
        assert [step.first_row for step in mine] == [h * per_host for h in range(hosts)]
        assert {step.num_valid for step in mine} == {want.num_valid}


def test_a_huge_source_plans_a_batch_without_building_its_order():
    """800 GB of order at 10**11 samples: only the batch asked for is computed."""
    sampler = Sampler(10**11, 4096, shuffle=True, seed=1, block_size=7, share=range(1024, 2048))
    assert sampler.lazy
    step = next(sampler.steps(3, start=len(sampler) // 2))
    assert len(step.rows) == 1024 and step.num_valid == 4096 and step.first_row == 1024
    assert len(set(step.rows.tolist())) == 1024
    assert step.rows.min() >= 0 and step.rows.max() < 10**11
    again = next(sampler.steps(3, start=len(sampler) // 2))
    np.testing.assert_array_equal(step.rows, again.rows)


@pytest.mark.usefixtures("lazy")
def test_lazy_shuffle_sends_each_sample_to_every_position_evenly():
    """Over 2,000 epochs, how often each of 64 samples lands at each position fits a uniform
    draw by chi-square within 5 standard deviations, neither too uneven nor too regular (a
    rotation of the dataset by the epoch would give 0)."""
    length, epochs = 64, 2000
    sampler = Sampler(length, 8, shuffle=True, seed=11)
    counts = np.zeros((length, length))
    for epoch in range(epochs):
        counts[np.arange(length), sampler.order(epoch)] += 1
    expected = epochs / length
    chi_square = ((counts - expected) ** 2 / expected).sum()
    dof = (length - 1) ** 2
    assert abs(chi_square - dof) < 5 * np.sqrt(2 * dof), chi_square


@pytest.mark.usefixtures("lazy")
def test_lazy_shuffle_has_no_stride_and_no_trend():
    length = 100_003
    order = Sampler(length, 8, shuffle=True, seed=4).order(0)
    positions = np.arange(length)
    assert (order == positions).sum() < 10  # 1 expected
    assert abs(np.corrcoef(positions, order)[0, 1]) < 0.02  # 0.003 is one standard deviation
    strides = np.diff(order)
    assert len(np.unique(strides)) > length // 2  # 74% for a uniform shuffle
    assert (np.abs(strides) == 1).sum() < 10  # 2 expected
    # Where each sixteenth of the dataset lands, by sixteenths of the order.
    cells = np.zeros((16, 16))
    np.add.at(cells, (positions * 16 // length, order * 16 // length), 1)
    expected = np.outer(cells.sum(1), cells.sum(0)) / length
    chi_square = ((cells - expected) ** 2 / expected).sum()
    assert abs(chi_square - 225) < 5 * np.sqrt(2 * 225), chi_square


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("length", "remainder"), [(37, "pad"), (40, "pad"), (37, "drop")])
@pytest.mark.parametrize("chunk_rows", [1, 16, 24, 1 << 16])
@pytest.mark.filterwarnings('ignore:remainder="drop" leaves out')
def test_padded_chunks_are_the_padded_rows_a_few_steps_at_a_time(
    monkeypatch, shuffle, length, remainder, chunk_rows
):
    """At every start, chunks of any size (down to one step) give the whole epoch's padded
    rows and counts; `real_samples` of any range of steps is the sum of their counts."""
    monkeypatch.setattr("feedpipe.core.sampler.PADDED_CHUNK_ROWS", chunk_rows)
    sampler = Sampler(length, 8, remainder=remainder, shuffle=shuffle, seed=4)
    whole, counts = sampler.padded_rows(3)
    for start in range(len(sampler)):
        chunks = list(sampler.padded_chunks(3, start))
        steps = max(1, chunk_rows // 8)
        assert [first for first, _, _ in chunks] == list(range(start, len(sampler), steps))
        np.testing.assert_array_equal(
            np.concatenate([rows for _, rows, _ in chunks]), whole[start:]
        )
        np.testing.assert_array_equal(np.concatenate([v for _, _, v in chunks]), counts[start:])
        for stop in range(start, len(sampler) + 1):
            assert sampler.real_samples(start, stop) == counts[start:stop].sum()


def test_a_lazy_epochs_chunks_are_its_steps_rows_padded():
    """Above `LAZY_SHUFFLE_ABOVE` the chunks come from the lazy order, as `steps` does."""
    sampler = Sampler(LAZY_SHUFFLE_ABOVE + 5, 4096, shuffle=True, seed=2)
    start = len(sampler) - 3
    (first, rows, valid), *_ = sampler.padded_chunks(1, start)
    assert sampler.lazy and first == start and rows.shape == (3, 4096)
    for step, mine, count in zip(sampler.steps(1, start), rows, valid, strict=True):
        assert step.num_valid == count
        np.testing.assert_array_equal(mine, step.rows[np.arange(4096) % count])
