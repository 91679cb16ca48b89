"""Text for messages: an error's type by name, a value shown even where its `__str__` raises,
a text clipped to a length, and numbers listed with how many more.

Every message that names a user's error or a run of samples, batches or indices (skips,
worker failures, a source whose first samples all raise) writes them here, one way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

SHOWN_NUMBERS = 10
"""Numbers a message lists one by one (skipped samples, batches, indices); the rest are
counted."""


def error_name(error: BaseException) -> str:
    """`error`'s type as `module.Name` (builtins by name alone)."""
    kind = type(error)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def shown(value: object, show: Callable[[object], str] = str) -> str:
    """`show(value)` (`str` or `repr`), or the name of `value`'s type where that raises: a
    user's exception whose `__str__` is broken must reach the user as itself, not as the error
    its `__str__` raised while feedpipe described it."""
    try:
        return show(value)
    except Exception:
        return type(value).__qualname__


def clipped(text: str, chars: int) -> str:
    """`text` cut to `chars` characters, an ellipsis saying where."""
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def listed(numbers: Iterable[int], unlisted: int = 0) -> str:
    """`numbers` in order, the first `SHOWN_NUMBERS` of them, and how many more (with `unlisted`
    more, known by count alone)."""
    numbers = sorted(numbers)
    first = ", ".join(map(str, numbers[:SHOWN_NUMBERS]))
    more = max(len(numbers) - SHOWN_NUMBERS, 0) + unlisted
    return first + (f" and {more} more" if more else "")
