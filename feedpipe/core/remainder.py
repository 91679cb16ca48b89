"""Remainder: the one rule for the last, partial global batch of an epoch.

"pad" fills it to full size by repeating its real rows, masked, so every replica runs the same
steps with the same shapes (no collective can deadlock, nothing recompiles); "drop" leaves its
samples out and says how many; "error" refuses a length that the global batch does not divide,
at construction where the length is known and at the end of the epoch for a stream.
"""

from __future__ import annotations

import dataclasses
import warnings

from feedpipe.core.checks import user_stacklevel

REMAINDERS = ("pad", "drop", "error")


def check_remainder(remainder: str) -> None:
    """Raises a ValueError naming the accepted policies when `remainder` is unknown."""
    if remainder not in REMAINDERS:
        raise ValueError(
            f"`remainder`={remainder!r} is not a known policy; use one of "
            f"{', '.join(repr(r) for r in REMAINDERS)}."
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Remainder:
    """The remainder policy of a feeder, applied to a known length or to a stream's end."""

    policy: str
    """"pad", "drop" or "error"."""
    global_batch_size: int

    def __post_init__(self):
        check_remainder(self.policy)

    @property
    def pads(self) -> bool:
        """Whether a partial last batch is delivered (padded) rather than left out."""
        return self.policy == "pad"

    def padding(self, length: int | None) -> int | None:
        """Padding rows an epoch of `length` samples gets: 0 where every batch is whole or
        the partial one is not delivered; None where the length is unknown (a stream)."""
        if not self.pads:
            return 0
        return None if length is None else -length % self.global_batch_size

    def steps(self, length: int) -> int:
        """Global batches in an epoch of `length` samples."""
        full, leftover = divmod(length, self.global_batch_size)
        return full + (1 if leftover and self.pads else 0)

    def dropped(self, length: int) -> int:
        """Samples of an epoch of `length` left out by the policy."""
        return length % self.global_batch_size if self.policy == "drop" else 0

    def check_length(self, length: int) -> None:
        """Refuses a length the policy cannot serve; warns once of what "drop" leaves out, and
        of a "pad" batch larger than the whole dataset."""
        size = self.global_batch_size
        leftover = length % size
        if self.policy == "error" and leftover:
            raise ValueError(
                f'`remainder`="error" needs the dataset length to be a multiple of '
                f"`global_batch_size`: {length} samples leave {leftover} over with "
                f'`global_batch_size`={size}; use remainder="pad" or "drop", or a global '
                f"batch size that divides {length}."
            )
        if self.policy == "drop" and length < size:
            raise ValueError(
                f'`remainder`="drop" with {length} samples and `global_batch_size`={size} '
                f'leaves no batch at all; use remainder="pad" or a global batch of at most '
                f"{length}."
            )
        if self.pads and length < size:
            warnings.warn(
                f"`global_batch_size`={size} is larger than the dataset ({length} "
                f"sample{'s' if length > 1 else ''}): every epoch is one batch of {length} real "
                f"row{'s' if length > 1 else ''} and {size - length} padding "
                f"row{'s' if size - length > 1 else ''}, computed on for nothing; use a global "
                f"batch of at most {length}.",
                stacklevel=user_stacklevel(),
            )
        if self.dropped(length):
            warnings.warn(
                f'remainder="drop" leaves out the last {leftover} of {length} samples of every '
                f"epoch's order (global batch {size}).",
                stacklevel=user_stacklevel(),
            )

    def check_stream_end(self, count: int, epoch: int, read: int) -> None:
        """Refuses, for "error", a stream's epoch that ended `count` rows past a whole batch
        (after `read` in all)."""
        if count and self.policy == "error":
            raise ValueError(
                f'`remainder`="error", but epoch {epoch} of the stream ended with {read} '
                f"samples, {count} past a multiple of `global_batch_size`="
                f'{self.global_batch_size}; use remainder="pad" or "drop".'
            )


def warn_dropped(epoch: int, dropped: int) -> None:
    """Says how many samples "drop" left out of a stream's epoch (its length was unknown)."""
    warnings.warn(
        f'remainder="drop" left out the last {dropped} samples of epoch {epoch}.',
        stacklevel=user_stacklevel(),
    )
