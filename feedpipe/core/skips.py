"""Skips: what a feeder does with a sample whose reading or `transform` raises.

`errors="raise"` (the default) raises the user's error at the consumer. `errors="skip"` turns
the sample's row into a padding row of its batch (a copy of a real row, mask False, weight
zero), so no other sample moves and every replica keeps its shape, up to a budget of
`max_skipped` samples per epoch, in the spirit of tf.data's `ignore_errors` with a bound like
Grain's error budgets. `SkipLedger` names the skipped samples (epoch, index, step, the error's
type and message) for `stats()` and the state, where the skips of the batches taken count
against a restored feeder's budget. Skips belong to the batches that hold them: a batch made
ahead and not taken is made again from scratch by the next pipeline (after a `break`, a
restore), its samples read again, so a state gives one stream here and in a restored feeder.

An epoch names its first `RECORDS_KEPT` skips (by step, then index) in full and counts the rest,
with an order-independent digest (`skip_digest`), so that a state stays small at any budget:
1 % of 1e9 samples is 1e7 skips, whose records would weigh about 1.3 GB.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
import threading
from collections.abc import Iterable
from typing import NamedTuple

from feedpipe.core.checks import check_int
from feedpipe.core.state import Position
from feedpipe.core.text import clipped, error_name, listed, shown

ERROR_POLICIES = ("raise", "skip")

DEFAULT_SKIP_FRACTION = 0.01
"""Samples `errors="skip"` may skip per epoch when `max_skipped` is not given: 1 in 100, room
for a few corrupt files in a large set while a `transform` broken for every sample stops in its
first batches."""

RECORDS_KEPT = 100
"""Skips of an epoch kept in full, in the ledger and the state: the first by step, then index;
the rest are a count and a digest. With `MESSAGE_CHARS` a record's JSON is at most ~4.9 KB
(every character escaped as a surrogate pair), so the records of a state stay under 0.5 MB,
whatever the messages and the budget; a typical one is ~130 bytes."""

MESSAGE_CHARS = 200
"""Characters of an error's first line (and type name) that a skip records: a message that
embeds a whole sample would otherwise weigh on every state."""

_MASK = 2**64 - 1
_HEX = re.compile("[0-9a-f]{16}")


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


def describe(error: BaseException) -> tuple[str, str]:
    """The type and first line of `error`, as a skip records them (`MESSAGE_CHARS` at most)."""
    lines = shown(error).splitlines()
    first = lines[0] if lines else ""
    return clipped(error_name(error), MESSAGE_CHARS), clipped(first, MESSAGE_CHARS)


def _mixed(x):
    """splitmix64's finalizer, on an int or a numpy uint64 array alike (both wrap at 2**64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def skip_digest(epoch, step, index):
    """The digest of one skip, a 64-bit hash of (epoch, step, index); an epoch's digest is
    their sum mod 2**64, the same whatever order parallel workers booked them in. Ints or
    numpy uint64 arrays (a benchmark digests 1e7 skips at once)."""
    return _mixed((_mixed((_mixed(epoch) + step) & _MASK) + index) & _MASK)


def over_budget(skipping: str, policy: ErrorPolicy, budget: int) -> str:
    """The note of an error that `errors="skip"` cannot skip: `skipping` (how many samples of
    which epoch, and which) would exceed the epoch's `budget`."""
    return (
        f'feedpipe: errors="skip" would skip {skipping}, more than {policy} allows ({budget} '
        "per epoch); fix the samples or the transform, or raise max_skipped (a count, or a "
        "fraction of the epoch like 0.05)."
    )


def named(skips: Iterable[SkippedSample], unlisted: int = 0) -> str:
    """Skipped samples by index, the first `SHOWN_NUMBERS` of them, and how many more (`unlisted`:
    those counted, past the records an epoch keeps)."""
    return listed((skip.index for skip in skips), unlisted)


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


class _EpochSkips:
    """One epoch's skips: the first `RECORDS_KEPT` in full, the rest as counts and digests.

    `steps` keeps the rest per step, since a pipeline restarting at a step forgets the skips
    from there on (`SkipLedger.forget_from`); `count` and `digest` hold the ones folded below
    the ledger's floor, which no pipeline goes back before.
    """

    __slots__ = ("beyond", "count", "digest", "first", "last", "steps")

    def __init__(self) -> None:
        self.first: dict[int, SkippedSample] = {}
        """The first skips by (step, index), by index."""
        self.last: list[tuple[int, int]] = []
        """A heap of `first`'s (-step, -index): its top is the last record kept."""
        self.steps: dict[int, list[int]] = {}
        """Per step at or after the floor: the count and digest of its skips past `first`."""
        self.count = 0
        self.digest = 0
        """The skips past `first` before the floor (or restored), and their digest."""
        self.beyond = 0
        """The skips past `first`: `count` and those of `steps`."""

    def keep(self, skip: SkippedSample) -> None:
        self.first[skip.index] = skip
        heapq.heappush(self.last, (-skip.step, -skip.index))

    def add_beyond(self, epoch: int, step: int, index: int) -> None:
        counted = self.steps.setdefault(step, [0, 0])
        counted[0] += 1
        counted[1] = (counted[1] + skip_digest(epoch, step, index)) & _MASK
        self.beyond += 1

    def add(self, skip: SkippedSample) -> None:
        """Books `skip`: kept while it is among the first `RECORDS_KEPT`, else counted."""
        key = (skip.step, skip.index)
        top = (-self.last[0][0], -self.last[0][1]) if self.last else None
        if (not self.beyond and len(self.first) < RECORDS_KEPT) or (top is not None and key < top):
            self.keep(skip)
            if len(self.first) > RECORDS_KEPT:
                step, index = (-v for v in heapq.heappop(self.last))
                self.add_beyond(skip.epoch, step, index)
                del self.first[index]
        else:
            self.add_beyond(skip.epoch, skip.step, skip.index)

    def fold(self, below: int | None) -> None:
        """Folds the counts of the steps before `below` (None: every step) into `count`."""
        for step in [s for s in self.steps if below is None or s < below]:
            count, digest = self.steps.pop(step)
            self.count += count
            self.digest = (self.digest + digest) & _MASK

    def forget_from(self, step: int) -> None:
        dropped = [i for i, s in self.first.items() if s.step >= step]
        for index in dropped:
            del self.first[index]
        if dropped:
            self.last = [(-s.step, -s.index) for s in self.first.values()]
            heapq.heapify(self.last)
        for later in [s for s in self.steps if s >= step]:
            self.beyond -= self.steps.pop(later)[0]

    def before(self, step: int | None) -> tuple[list[SkippedSample], int, int]:
        """The records before `step` (None: all) in order, how many skips lie there past them,
        and the digest of all of them."""
        records = sorted(
            (s for s in self.first.values() if step is None or s.step < step),
            key=lambda s: (s.step, s.index),
        )
        count, digest = self.count, self.digest
        for at, (n, d) in self.steps.items():
            if step is None or at < step:
                count, digest = count + n, digest + d
        for s in records:
            digest += skip_digest(s.epoch, s.step, s.index)
        return records, count, digest & _MASK


class SkipLedger:
    """The samples skipped so far, by epoch, shared by the producer (which records them as it
    makes batches, in its own thread) and the consumer (which names the ones in the batches it
    took). Thread-safe.

    Invariants: no epoch holds more than `budget` skips; the one that would exceed it raises.
    An epoch keeps its first `RECORDS_KEPT` skips by (step, index) as records and every later
    one as a count and a digest per step; the steps before the floor (`fold_before`: where no
    pipeline starts again) are folded into one count and digest. So the ledger holds at most
    `RECORDS_KEPT` records and one count per step since the floor an epoch, and the state's
    count, digest and records before a position do not depend on how the skips were booked:
    in order or not, in one feeder or across a restore.
    """

    def __init__(self, policy: ErrorPolicy, length: int):
        self.policy = policy
        self.budget = policy.budget(length)
        self._lock = threading.Lock()
        self._epochs: dict[int, _EpochSkips] = {}

    def record(self, skip: SkippedSample, error: BaseException) -> None:
        """Books a newly skipped sample; raises `error`, with a note naming the budget, the
        samples skipped and the fix, if the epoch's skips would exceed the budget."""
        with self._lock:
            epoch = self._epochs.setdefault(skip.epoch, _EpochSkips())
            if skip.index in epoch.first:
                return
            if len(epoch.first) + epoch.beyond + 1 > self.budget:
                skips = [*epoch.first.values(), skip]
                indices = named(skips, epoch.beyond)
                skipping = (
                    f"{len(skips) + epoch.beyond} samples of epoch {skip.epoch} (indices {indices})"
                )
                error.add_note(over_budget(skipping, self.policy, self.budget))
                raise error
            epoch.add(skip)

    def before(self, position: Position) -> tuple[list[SkippedSample], int]:
        """The skips in the batches before `position`: what a consumer there took, as the
        records kept, in order, and the count of the others."""
        records, unlisted = [], 0
        with self._lock:
            for number in sorted(self._epochs):
                if number > position.epoch:
                    break
                step = position.step if number == position.epoch else None
                kept, count, _ = self._epochs[number].before(step)
                records += kept
                unlisted += count
        return records, unlisted

    def state(self, position: Position) -> dict:
        """The skips of `position`'s epoch before it, JSON-safe, for the state: the records
        kept, and the count and digest of them all."""
        with self._lock:
            epoch = self._epochs.get(position.epoch, _EpochSkips())
            records, count, digest = epoch.before(position.step)
        return {
            "skipped": [list(skip) for skip in records],
            "skipped_count": len(records) + count,
            "skipped_digest": f"{digest:016x}",
        }

    def fold_before(self, floor: Position) -> None:
        """Folds the counts of the batches before `floor` into their epoch's: no pipeline will
        start before it, so none of them will be forgotten."""
        with self._lock:
            for number, epoch in self._epochs.items():
                if number <= floor.epoch:
                    epoch.fold(floor.step if number == floor.epoch else None)

    def forget_from(self, position: Position) -> None:
        """Forgets the skips of the batches at and after `position`: a pipeline starting there
        makes them again and reads their samples again, as a feeder restored there does."""
        with self._lock:
            for number in [n for n in self._epochs if n > position.epoch]:
                self._epochs[number].forget_from(0)
            if position.epoch in self._epochs:
                self._epochs[position.epoch].forget_from(position.step)

    def restore(self, state: dict) -> None:
        """Forgets every skip and knows those of a state (see `state`); a state written before
        skips were counted holds every record, and nothing more."""
        records = state.get("skipped", [])
        skips = [SkippedSample(*record) for record in records]
        count = state.get("skipped_count", len(skips))
        check_int(
            "state['skipped_count']", count, "pass a dict from get_state()", minimum=len(skips)
        )
        digest = sum(skip_digest(s.epoch, s.step, s.index) for s in skips) & _MASK
        written = state.get("skipped_digest", f"{digest:016x}")
        if not isinstance(written, str) or not _HEX.fullmatch(written):
            raise ValueError(
                f"The state's skipped_digest={written!r} must be 16 hex digits; pass a dict "
                "from get_state()."
            )
        if count == len(skips) and int(written, 16) != digest:
            raise ValueError(
                f"The state's skipped_digest={written!r} is not that of its {count} skipped "
                f"records ({digest:016x}); pass a dict from get_state(), unchanged."
            )
        with self._lock:
            self._epochs = {}
            for skip in skips:
                epoch = self._epochs.setdefault(skip.epoch, _EpochSkips())
                epoch.keep(skip)
            if count > len(skips):
                epoch = self._epochs.setdefault(state["epoch"], _EpochSkips())
                epoch.count = epoch.beyond = count - len(skips)
                epoch.digest = (int(written, 16) - digest) & _MASK
