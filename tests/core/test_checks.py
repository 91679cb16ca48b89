"""Checks: a count is an integer of at least its minimum (a bool is not one), and a bad one is
refused naming the argument, the rule, the value and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from feedpipe.core.checks import check_int


@pytest.mark.parametrize("value", [0, -3, 0.5, 2.0, "4", None, np.float32(3)])
def test_a_bad_count_names_the_argument_the_rule_the_value_and_the_fix(value):
    with pytest.raises(ValueError) as refused:
        check_int("depth", value, "use depth=2")
    assert str(refused.value) == f"`depth`={value!r} must be an integer >= 1; use depth=2."


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_not_an_integer(value):
    with pytest.raises(ValueError, match=r"`workers`=\w+ must be an integer >= 0 \(a bool is not"):
        check_int("workers", value, "use 0", minimum=0)


def test_the_minimum_is_allowed_and_numpy_integers_come_back_as_ints():
    assert check_int("workers", 0, "use 0", minimum=0) == 0
    count = check_int("depth", np.int64(3), "use depth=2")
    assert (count, type(count)) == (3, int)
    with pytest.raises(ValueError, match=r"`seed`=-1 must be an integer >= 0; pass seed=0"):
        check_int("seed", -1, "pass seed=0", minimum=0)
