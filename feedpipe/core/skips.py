"""Skips: what a feeder does with a sample whose reading or `transform` raises.

`errors="raise"` (the default) raises the user's error at the consumer. `errors="skip"` turns
the sample's row into a padding row of its batch (a copy of a real row, mask False, weight
zero), so no other sample moves and every replica keeps its shape, up to a budget of
`max_skipped` samples per epoch, in the spirit of tf.data's `ignore_errors` with a bound like
Grain's error budgets. `SkipLedger` names every skipped sample (epoch, index, step, the error's
type and message) for `stats()` and the state, where the skips of the batches taken count
against a restored feeder's budget. Skips belong to the batches that hold them: a batch made
ahead and not taken is made again from scratch by the next pipeline (after a `break`, a
restore), its samples read again, so a state gives one stream here and in a restored feeder.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

from feedpipe.core.state import Position

ERROR_POLICIES = ("raise", "skip")

DEFAULT_SKIP_FRACTION = 0.01
"""Samples `errors="skip"` may skip per epoch when `max_skipped` is not given: 1 in 100, room
for a few corrupt files in a large set while a `transform` broken for every sample stops in its
first batches."""

SHOWN_SKIPS = 10
"""Skipped samples an error names one by one; the rest are counted."""


class SkippedSample(NamedTuple):
    """One sample left out of its batch by `errors="skip"`."""

    epoch: int
    index: int
    """The sample's index in the source."""
    step: int
    """The batch of the epoch whose row it held (now a padding row)."""
    error: str
    """The type of the error it raised, as `module.Name`."""
    message: str

    def __str__(self) -> str:
        return f"sample {self.index} of epoch {self.epoch} ({self.error}: {self.message})"


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


def describe(error: BaseException) -> tuple[str, str]:
    """The type and first line of `error`, as a skip records them."""
    lines = shown(error).splitlines()
    return error_name(error), lines[0] if lines else ""


def over_budget(skipping: str, policy: ErrorPolicy, budget: int) -> str:
    """The note of an error that `errors="skip"` cannot skip: `skipping` (how many samples of
    which epoch, and which) would exceed the epoch's `budget`."""
    return (
        f'feedpipe: errors="skip" would skip {skipping}, more than {policy} allows ({budget} '
        "per epoch); fix the samples or the transform, or raise max_skipped (a count, or a "
        "fraction of the epoch like 0.05)."
    )


def named(skips: Iterable[SkippedSample]) -> str:
    """Skipped samples by index, the first `SHOWN_SKIPS` of them."""
    return listed(skip.index for skip in skips)


def listed(numbers: Iterable[int]) -> str:
    """`numbers` in order, the first `SHOWN_SKIPS` of them, and how many more."""
    numbers = sorted(numbers)
    first = ", ".join(map(str, numbers[:SHOWN_SKIPS]))
    return first + (f" and {len(numbers) - SHOWN_SKIPS} more" if len(numbers) > SHOWN_SKIPS else "")


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorPolicy:
    """What to do with a sample that raises: `errors` and its budget, checked by FeedOptions."""

    errors: str = "raise"
    max_skipped: int | float | None = None

    @property
    def skips(self) -> bool:
        return self.errors == "skip"

    def budget(self, length: int) -> int:
        """Samples an epoch of `length` may skip."""
        limit = DEFAULT_SKIP_FRACTION if self.max_skipped is None else self.max_skipped
        if isinstance(limit, float):  # rounded first: 0.1 * 30 is 3.0000000000000004
            return max(1, math.floor(round(limit * length, 6)))
        return limit

    def __str__(self) -> str:
        if self.max_skipped is None:
            return f"the default max_skipped={DEFAULT_SKIP_FRACTION}"
        return f"max_skipped={self.max_skipped!r}"


def check_error_policy(errors: object, max_skipped: object) -> None:
    """Refuses an unknown policy or budget, naming the value and the fix."""
    if errors not in ERROR_POLICIES:
        raise ValueError(f'`errors`={errors!r} must be "raise" or "skip".')
    if max_skipped is None:
        return
    if errors == "raise":
        raise ValueError(
            f'`max_skipped`={max_skipped!r} is the budget of errors="skip", but `errors`="raise"; '
            'pass errors="skip" to skip failing samples, or leave max_skipped out.'
        )
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, int | float):
        raise TypeError(
            f"`max_skipped`={max_skipped!r} must be a count of samples per epoch (an int >= 0) "
            "or a fraction of the epoch's samples (a float in (0, 1])."
        )
    if isinstance(max_skipped, int) and max_skipped < 0:
        raise ValueError(f"`max_skipped`={max_skipped} must be >= 0 samples per epoch.")
    if isinstance(max_skipped, float) and not 0 < max_skipped <= 1:
        raise ValueError(
            f"`max_skipped`={max_skipped!r} as a float is a fraction of an epoch's samples and "
            "must lie in (0, 1]; pass an int for a count, e.g. max_skipped=10."
        )


class SkipLedger:
    """Every sample skipped so far, by epoch and index, shared by the producer (which records
    them as it makes batches, in its own thread) and the consumer (which names the ones in the
    batches it took). Thread-safe.

    Invariant: no epoch holds more than `budget` skips; the one that would exceed it raises.
    """

    def __init__(self, policy: ErrorPolicy, length: int):
        self.policy = policy
        self.budget = policy.budget(length)
        self._lock = threading.Lock()
        self._epochs: dict[int, dict[int, SkippedSample]] = {}

    def record(self, skip: SkippedSample, error: BaseException) -> None:
        """Books a newly skipped sample; raises `error`, with a note naming the budget, the
        samples skipped and the fix, if the epoch's skips would exceed the budget."""
        with self._lock:
            epoch = self._epochs.setdefault(skip.epoch, {})
            if skip.index in epoch:
                return
            if len(epoch) + 1 > self.budget:
                skips = [*epoch.values(), skip]
                skipping = f"{len(skips)} samples of epoch {skip.epoch} (indices {named(skips)})"
                error.add_note(over_budget(skipping, self.policy, self.budget))
                raise error
            epoch[skip.index] = skip

    def before(self, position: Position) -> list[SkippedSample]:
        """The skips in the batches before `position`, in order: what a consumer there took."""
        with self._lock:
            skips = [s for e in self._epochs.values() for s in e.values()]
        taken = [s for s in skips if (s.epoch, s.step) < tuple(position)]
        return sorted(taken, key=lambda s: (s.epoch, s.step, s.index))

    def state(self, position: Position) -> list[list]:
        """The skips of `position`'s epoch before it, JSON-safe, for the state."""
        return [list(skip) for skip in self.before(position) if skip.epoch == position.epoch]

    def forget_from(self, position: Position) -> None:
        """Forgets the skips of the batches at and after `position`: a pipeline starting there
        makes them again and reads their samples again, as a feeder restored there does."""
        with self._lock:
            for epoch in self._epochs.values():
                for index in [i for i, s in epoch.items() if (s.epoch, s.step) >= position]:
                    del epoch[index]

    def restore(self, records: Iterable[Iterable]) -> None:
        """Forgets every skip and knows those of a state (see `state`)."""
        skips = [SkippedSample(*record) for record in records]
        with self._lock:
            self._epochs = {}
            for skip in skips:
                self._epochs.setdefault(skip.epoch, {})[skip.index] = skip
