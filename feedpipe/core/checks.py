"""Checks: the one rule for a count a user passes, and its one wording.

Every count in feedpipe (a batch size, a depth, workers, steps, threads, a seed) is checked here,
so a bad value reads the same wherever it was given: the argument's name, the rule, the value
received and the fix, e.g. "`depth`=0 must be an integer >= 1; use depth=2 to hide one step's
transfer." A bool is not a count: `True` is an `int` to Python, but `workers=True` is a mistake.
"""

from __future__ import annotations

import numbers
import os
import sys
from typing import Any

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def check_int(name: str, value: Any, fix: str, *, minimum: int = 1) -> int:
    """Returns `value` as an `int` if it is an integer (Python's or numpy's, not a bool) of at
    least `minimum`; otherwise raises a ValueError naming `name`, the rule, `value` and `fix`.

    Args:
        name: The argument as the user wrote it: `depth`, `--steps`, `state['step']`.
        value: What the user passed.
        fix: What to pass instead, as a clause: "use depth=2 to hide one step's transfer".
        minimum: The smallest value allowed; 1 for a size or a number of steps, 0 for an
            index, a seed, or a count where 0 means "none".
    """
    # numpy's integers register as numbers.Integral, so numpy need not be imported to take them.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum:
        return int(value)
    kind = " (a bool is not an integer)" if isinstance(value, bool) else ""
    raise ValueError(f"`{name}`={value!r} must be an integer >= {minimum}{kind}; {fix}.")


def user_stacklevel() -> int:
    """The `stacklevel` at which a warning raised by the caller of this function names the
    first line outside feedpipe: the user's own call, however deep inside feedpipe it warns."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
