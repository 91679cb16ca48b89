"""The remainder rule on the last, partial global batch: "pad" delivers it, "drop" leaves its
samples out and says how many, "error" refuses it, each with the fix in its message."""

from __future__ import annotations

import re
import warnings

import pytest

from feedpipe.core.remainder import Remainder, warn_dropped


@pytest.mark.parametrize(
    ("policy", "length", "steps", "dropped"),
    [
        ("pad", 13, 4, 0),
        ("drop", 13, 3, 1),
        ("pad", 12, 3, 0),
        ("drop", 12, 3, 0),
        ("error", 12, 3, 0),
        ("pad", 3, 1, 0),
        ("drop", 15, 3, 3),
    ],
)
def test_pad_delivers_the_partial_batch_and_drop_leaves_out_exactly_its_samples(
    policy, length, steps, dropped
):
    rule = Remainder(policy, 4)
    assert rule.steps(length) == steps
    assert rule.dropped(length) == dropped
    assert rule.pads == (policy == "pad")


def test_an_unknown_policy_is_refused_with_the_ones_there_are():
    with pytest.raises(ValueError, match="`remainder`='trim' is not a known policy; use one of "):
        Remainder("trim", 4)


def test_error_refuses_a_length_off_a_multiple_naming_both_numbers_and_the_fix():
    message = (
        '`remainder`="error" needs the dataset length to be a multiple of `global_batch_size`: '
        '13 samples leave 1 over with `global_batch_size`=4; use remainder="pad" or "drop", or '
        "a global batch size that divides 13."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Remainder("error", 4).check_length(13)


def test_drop_refuses_a_dataset_smaller_than_one_batch_with_the_fix():
    with pytest.raises(
        ValueError,
        match=re.escape(
            '`remainder`="drop" with 3 samples and `global_batch_size`=4 leaves no batch at all; '
            'use remainder="pad" or a global batch of at most 3.'
        ),
    ):
        Remainder("drop", 4).check_length(3)


def test_drop_warns_how_many_samples_each_epoch_leaves_out():
    with pytest.warns(UserWarning) as caught:
        Remainder("drop", 4).check_length(15)
    assert [str(w.message) for w in caught] == [
        'remainder="drop" leaves out the last 3 of 15 samples of every epoch\'s order '
        "(global batch 4)."
    ]


def test_pad_warns_when_the_global_batch_is_larger_than_the_dataset():
    with pytest.warns(UserWarning) as caught:
        Remainder("pad", 64).check_length(37)
    assert [str(w.message) for w in caught] == [
        "`global_batch_size`=64 is larger than the dataset (37 samples): every epoch is one "
        "batch of 37 real rows and 27 padding rows, computed on for nothing; use a global "
        "batch of at most 37."
    ]


@pytest.mark.parametrize(
    ("policy", "length"), [("drop", 16), ("pad", 15), ("error", 16), ("pad", 4)]
)
def test_a_length_every_policy_can_serve_passes_silently(policy, length):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Remainder(policy, 4).check_length(length)


def test_a_stream_that_ends_off_a_multiple_is_refused_under_error_with_the_fix():
    message = (
        '`remainder`="error", but epoch 2 of the stream ended with 10 samples, 2 past a '
        'multiple of `global_batch_size`=4; use remainder="pad" or "drop".'
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Remainder("error", 4).check_stream_end(2, epoch=2, read=10)


@pytest.mark.parametrize(("policy", "count"), [("pad", 2), ("drop", 2), ("error", 0)])
def test_a_stream_end_the_policy_serves_is_accepted(policy, count):
    Remainder(policy, 4).check_stream_end(count, epoch=0, read=8 + count)


def test_the_samples_a_stream_dropped_are_counted_in_a_warning_at_the_callers_line():
    with pytest.warns(UserWarning) as caught:
        warn_dropped(epoch=3, dropped=2)
    (warning,) = caught
    assert str(warning.message) == 'remainder="drop" left out the last 2 samples of epoch 3.'
    assert warning.filename == __file__  # the first line outside feedpipe: this test's
