"""Sampler: which samples make each global batch, in what order, for every epoch.

The order is a pure function of (seed, epoch, length, block size), so it does not depend on who
produces the samples or how many producers there are, and a resumed run sees the same stream.
A full permutation costs time and memory in proportion to the length before an epoch's first
batch, so above `LAZY_SHUFFLE_ABOVE` samples the order comes from a `LazyPermutation`, which
holds about 8 * sqrt(length) numbers and computes only the rows of the batch being planned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from feedpipe.core.remainder import Remainder

LAZY_SHUFFLE_ABOVE = 10_000_000
"""Samples above which a shuffled epoch is computed per batch (`LazyPermutation`) instead of
from a full permutation built before its first batch. Measured on 2 cores: the full one stalls
each epoch's planning for 1 ms, 20-40 ms, 0.5-0.8 s and 6-7 s at 1e5, 1e6, 1e7 and 1e8 samples,
and holds 8 bytes a sample (76 MiB at 1e7, 763 MiB at 1e8), on every host; the lazy one sets
up in under 1 ms and 2 MiB at any of those lengths, then costs 40-65 us a step of 256 samples
and 180-210 us a step of 4096. At 1e7 its steps add up to about the full one's time per epoch
(0.5 s at 4096 a step, 2.5 s at 256), spread over the steps; at 1e6 and below the full one
costs less than 40 ms and 8 MiB, nothing the lazy one's cost on every step would save. The
number is part of the order: a length at or under it gets the same order as before lazy
shuffles existed, and changing it changes the order of the lengths in between."""

PADDED_CHUNK_ROWS = 1 << 16
"""Rows a chunk of `Sampler.padded_chunks` holds at most (one step where a global batch is
larger): each chunk is one Python call of the framework's threads (~50 us of hand-offs), and
the first batch of a pass waits for one. 64K rows take 0.5 MiB of sample indices and, on a
lazy order, ~3 ms (190 us a step of 4096, see `LAZY_SHUFFLE_ABOVE`): the call is a few
percent of a chunk, and a pass starts in milliseconds and a few MiB at any length
(kernels_bench/gathered_plan.py)."""

LAZY_ROWS_PER_CALL = 4096
"""Rows a lazy order is asked for at once, several steps' worth where steps are small: a call
costs ~25 us for 1 row, ~30 us for 64 and ~190 us for 4096 (kernels_bench/multi_worker.py)."""

FEISTEL_ROUNDS = 8
"""Feistel rounds of `LazyPermutation`. 4 make a strong pseudorandom permutation out of random
round functions (Luby-Rackoff) when the halves are large; on the small halves of short lengths
(3 to 257), the positions each sample landed at over 10,000 epochs were still uneven at 4 and 6
rounds (chi-square z of 3.3 and 0.9 on average over 12 lengths and seeds) and even at 8 (0.4).
A round is only a lookup, an addition and a remainder."""

FEISTEL_MIN_SIDE = 4
"""The smallest half holds 4 values, so the rounds have something to mix even at lengths 2
and 3 (with halves of 1 value those would always come out in order)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One global batch of an epoch, before it is made."""

    epoch: int
    """The epoch this batch belongs to, counted from 0."""
    index: int
    """Its position within the epoch, counted from 0."""
    rows: np.ndarray | None
    """Sample indices of the rows to read, in order: the real rows of the global batch (the
    rest is padding that repeats them), or a host's share of the padded global batch;
    `None` for stream sources (their own order)."""
    num_valid: int
    """Real samples in the global batch; the rest of it is padding."""
    replica_valid: tuple[int, ...] | None = None
    """Real rows of each replica, first in its rows, for sources that fill each replica from
    its own shard (DALI); None when the real rows come first in the global batch."""
    first_row: int = 0
    """The row of the global batch where this host's rows begin (0 on one host)."""
    skipped: tuple[int, ...] = ()
    """Rows whose sample `errors="skip"` left out: padding rows among the real ones, which
    `num_valid` does not count (see `feedpipe.core.skips`)."""

    def real_rows(self, num_replicas: int, per_replica: int) -> np.ndarray:
        """One bool per row this host makes (all of the global batch on one host): True for a
        real sample, False for padding and skipped rows."""
        if self.replica_valid is None:
            read = self.num_valid + len(self.skipped)
            real = self.first_row + np.arange(num_replicas * per_replica) < read
        else:
            offsets = np.arange(per_replica)
            real = np.concatenate([offsets < valid for valid in self.replica_valid])
        real[list(self.skipped)] = False
        return real

    def skipping(self, rows: list[int]) -> Step:
        """This step with `rows` (of this host's) skipped as well."""
        skipped = tuple(sorted({*self.skipped, *rows}))
        added = len(skipped) - len(self.skipped)
        return dataclasses.replace(self, num_valid=self.num_valid - added, skipped=skipped)


@dataclasses.dataclass(frozen=True, slots=True)
class EpochEnd:
    """Marks that every batch of `epoch` has been produced."""

    epoch: int
    dropped: int = 0
    """Samples left out by `remainder="drop"` at the end of this epoch."""


class Sampler:
    """Plans the global batches of every epoch of an indexed source.

    With `shuffle`, the order is a permutation of blocks of `block_size` consecutive samples
    (1 for most sources; a `PyDataset`'s batch size, so that each of its batches is read once),
    drawn from `(seed, epoch)`: a full permutation built before the epoch's first batch up to
    `LAZY_SHUFFLE_ABOVE` samples, and above it a `LazyPermutation` that `steps` evaluates at
    each batch's rows alone, so no host ever holds the whole order. The last global batch of
    an epoch is padded, dropped or refused according to `remainder`. With `share`, one host's
    rows of each global batch, its steps hold only those rows, padding rows included (they
    repeat the batch's real rows in order, as one host pads), so the hosts' steps together are
    the one-host batches.
    """

    def __init__(
        self,
        length: int,
        global_batch_size: int,
        *,
        remainder: str = "pad",
        shuffle: bool = False,
        seed: int = 0,
        block_size: int = 1,
        share: range | None = None,
    ):
        if length < 1:
            raise ValueError(
                "The dataset is empty (0 samples); give the feeder at least one sample."
            )
        self.rule = Remainder(remainder, global_batch_size)
        self.rule.check_length(length)
        self.length = length
        self.global_batch_size = global_batch_size
        self.remainder = remainder
        self.shuffle = shuffle
        self.seed = seed
        self.block_size = block_size
        self.share = None if share == range(global_batch_size) else share
        self.dropped_per_epoch = self.rule.dropped(length)
        self.lazy = shuffle and length > LAZY_SHUFFLE_ABOVE
        """Whether each batch's rows come from a permutation computed per batch
        (`LazyPermutation`) rather than from a full permutation built for the epoch."""
        self._located: tuple[int, Callable[[np.ndarray], np.ndarray]] | None = None

    def __getstate__(self) -> dict:
        """Pickled without the kept order: a copy sent elsewhere builds its own."""
        return {**self.__dict__, "_located": None}

    def __len__(self) -> int:
        """Global batches per epoch."""
        return self.rule.steps(self.length)

    def __repr__(self) -> str:
        return (
            f"Sampler(length={self.length}, global_batch_size={self.global_batch_size}, "
            f"remainder={self.remainder!r}, shuffle={self.shuffle}, seed={self.seed}, "
            f"block_size={self.block_size}"
            + ("" if self.share is None else f", share={self.share}")
            + ")"
        )

    def order(self, epoch: int) -> np.ndarray:
        """Every sample index of `epoch`, in the order they are delivered (built whole, even
        where `steps` computes each batch's rows alone)."""
        if self.shuffle and not self.lazy:
            return self._permuted(epoch)
        return self.locator(epoch)(np.arange(self.length, dtype=np.int64))

    def steps(self, epoch: int, start: int = 0) -> Iterator[Step]:
        """The global batches of `epoch` from step `start` on."""
        locate = self.locator(epoch)
        size, share = self.global_batch_size, self.share
        mine = None if share is None else np.arange(share.start, share.stop, dtype=np.int64)
        rows_of_batch = np.arange(size, dtype=np.int64)
        first_row = 0 if share is None else share.start
        # A lazy order costs ~25 us a call whatever its size: plan several steps per call.
        rows = size if share is None else len(share)
        chunk = max(1, LAZY_ROWS_PER_CALL // rows) if self.lazy else 1
        for lo in range(start, len(self), chunk):
            indices = np.arange(lo, min(lo + chunk, len(self)), dtype=np.int64)
            counts = np.minimum(size, self.length - indices * size)
            wanted = rows_of_batch if mine is None else mine
            positions = self._positions(indices[:, None], counts[:, None], wanted).ravel()
            # One host reads a batch's real rows alone: fewer than `size` only in the epoch's
            # last batch, which comes last in its chunk. A share is read whole.
            ends = np.cumsum(counts if mine is None else np.full(len(indices), len(mine)))
            located = locate(positions[: ends[-1]])
            begin = 0
            for index, count, end in zip(
                indices.tolist(), counts.tolist(), ends.tolist(), strict=True
            ):
                yield Step(epoch, index, located[begin:end], count, first_row=first_row)
                begin = end

    def padded_rows(
        self,
        epoch: int,
        start: int = 0,
        stop: int | None = None,
        *,
        locate: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The global batches of steps [`start`, `stop`) of `epoch` (`stop` None: to its end),
        at once: the sample indices of each batch's rows, `[steps, global_batch_size]`, padded
        as `steps` pads a host's share, and each batch's count of real samples. `locate` is the
        epoch's `locator`, where the caller keeps it from one call to the next."""
        size = self.global_batch_size
        stop = len(self) if stop is None else min(stop, len(self))
        indices = np.arange(start, max(start, stop), dtype=np.int64)
        counts = np.minimum(size, self.length - indices * size)
        rows = np.arange(size, dtype=np.int64)
        positions = self._positions(indices[:, None], counts[:, None], rows)
        locate = self.locator(epoch) if locate is None else locate
        return locate(positions.ravel()).reshape(positions.shape), counts

    def padded_chunks(
        self, epoch: int, start: int = 0
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """`padded_rows` of `epoch` from step `start` on, a chunk of steps at a time (about
        `PADDED_CHUNK_ROWS` rows), each as its first step, rows and counts: a pass plans only
        the steps its reader reaches, and its first batch waits for one chunk whatever the
        epoch's length. The epoch's order is set up once, at the first chunk."""
        locate = self.locator(epoch)
        steps = max(1, PADDED_CHUNK_ROWS // self.global_batch_size)
        for lo in range(start, len(self), steps):
            yield lo, *self.padded_rows(epoch, lo, lo + steps, locate=locate)

    def real_samples(self, start: int, stop: int) -> int:
        """Real samples in steps [`start`, `stop`) of an epoch: every step is full but the
        epoch's last, which `remainder="pad"` leaves short."""
        size, stop = self.global_batch_size, min(stop, len(self))
        return max(0, min(self.length, stop * size) - min(self.length, start * size))

    def _positions(self, index: Any, count: Any, rows: np.ndarray) -> np.ndarray:
        """The positions in the epoch's order of `rows` (int64) of batch `index`, which holds
        `count` real samples: a padding row (`rows` past `count`) repeats the real rows in
        order."""
        return index * self.global_batch_size + rows % count

    def locator(self, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
        """What gives the sample indices at positions of `epoch`'s order. The last epoch's is
        kept: a process that plans one step at a time (a Ray task) builds an epoch's full
        permutation once, not once a step."""
        if self._located is not None and self._located[0] == epoch:
            return self._located[1]
        if not self.shuffle:
            locate = _unmoved
        elif self.lazy:
            locate = _LazyOrder(self.length, self.block_size, (self.seed, epoch))
        else:
            locate = self._permuted(epoch).__getitem__
        self._located = (epoch, locate)
        return locate

    def _permuted(self, epoch: int) -> np.ndarray:
        """`epoch`'s shuffled order, built whole from a full permutation of the blocks."""
        rng = np.random.default_rng([self.seed, epoch])
        if self.block_size == 1:
            return rng.permutation(self.length).astype(np.int64, copy=False)
        starts = rng.permutation(-(-self.length // self.block_size)) * self.block_size
        rows = (starts[:, None] + np.arange(self.block_size, dtype=np.int64)).ravel()
        return rows[rows < self.length] if self.length % self.block_size else rows


def _unmoved(positions: np.ndarray) -> np.ndarray:
    """An unshuffled epoch's order: each position holds its own sample."""
    return positions


class _LazyOrder:
    """An epoch's shuffled order of blocks, computed only at the positions asked for.

    Slot k of the order holds block `permutation(k)`, as a full permutation of the blocks
    would; only the last block can be short, so the positions past it sit
    `block_size - short` earlier than whole blocks would put them.
    """

    def __init__(self, length: int, block_size: int, key: tuple[int, int]):
        blocks = -(-length // block_size)
        self.block_size = block_size
        self.permutation = LazyPermutation(blocks, key)
        self.short = length - (blocks - 1) * block_size
        """Samples in the last block."""
        self.past_short = length
        """The first position of the order past the short block (none when it is whole)."""
        if self.short < block_size:
            slot = int(self.permutation.inverse(np.array([blocks - 1]))[0])
            self.past_short = slot * block_size + self.short

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The sample indices at `positions` of the order."""
        if self.block_size == 1:
            return self.permutation(positions)
        shifted = np.where(
            positions >= self.past_short, positions + self.block_size - self.short, positions
        )
        slots, offsets = np.divmod(shifted, self.block_size)
        if not slots.size:
            return slots
        # A batch's positions span few slots: permute each of them once, not once per row.
        first = slots.min()
        blocks = self.permutation(np.arange(first, slots.max() + 1))
        return blocks[slots - first] * self.block_size + offsets


class LazyPermutation:
    """A pseudorandom bijection of [0, `length`) drawn from `key`, computed per position.

    A Feistel network permutes the grid [0, a*b) of two halves of about sqrt(`length`) values
    each, with fewer than `a` values past `length`: each round adds to one half a random
    function of the other (a table of random values drawn from `key`), modulo its size. A
    position whose image falls at `length` or past it takes the network again (cycle walking)
    until it lands inside, which keeps the map a bijection of [0, `length`); with so little
    to spare, nearly every batch needs one pass. The tables come from the PCG64 bit stream,
    which numpy keeps the same across versions, so the permutation is a pure function of
    `length` and `key`.
    """

    def __init__(self, length: int, key: Sequence[int]):
        if length < 1:
            raise ValueError(f"`length`={length} leaves nothing to permute; use at least 1.")
        self.length = length
        self.key = tuple(key)
        left = max(FEISTEL_MIN_SIDE, math.isqrt(length - 1) + 1)
        sides = (left, max(FEISTEL_MIN_SIDE, -(-length // left)))
        self._sides = [sides[::-1] if r % 2 else sides for r in range(FEISTEL_ROUNDS)]
        """Sizes of the (left, right) halves that each round reads; each round swaps them."""
        raw = np.random.PCG64(np.random.SeedSequence(self.key)).random_raw(
            FEISTEL_ROUNDS * sum(sides)
        )
        self._tables: list[np.ndarray] = []
        """For each round, a random value below the left size for each value of the right."""
        used = 0
        for left_size, right_size in self._sides:
            words = raw[used : used + right_size]
            self._tables.append((words % np.uint64(left_size)).astype(np.int64))
            used += right_size

    def __repr__(self) -> str:
        return f"LazyPermutation(length={self.length}, key={self.key})"

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The values at `positions` (each in [0, `length`)), as int64."""
        return self._walk(positions, self._forward)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """The positions that hold `values` (each in [0, `length`)), as int64."""
        return self._walk(values, self._backward)

    def _walk(self, points: np.ndarray, network: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """`network` applied to each point until it lands inside [0, `length`)."""
        points = np.asarray(points, dtype=np.int64)
        if points.size and (points.min() < 0 or points.max() >= self.length):
            raise IndexError(
                f"positions must lie in [0, {self.length}); got values from {points.min()} "
                f"to {points.max()}."
            )
        out = network(points)
        outside = np.flatnonzero(out >= self.length)
        while outside.size:
            out[outside] = network(out[outside])
            outside = outside[out[outside] >= self.length]
        return out

    def _forward(self, x: np.ndarray) -> np.ndarray:
        left, right = np.divmod(x, self._sides[0][1])
        for (left_size, _), table in zip(self._sides, self._tables, strict=True):
            left, right = right, (left + table[right]) % left_size
        # The last round left its right half with as many values as its left one had.
        return left * self._sides[-1][0] + right

    def _backward(self, x: np.ndarray) -> np.ndarray:
        left, right = np.divmod(x, self._sides[-1][0])
        for (left_size, _), table in zip(self._sides[::-1], self._tables[::-1], strict=True):
            left, right = (right - table[left]) % left_size, left
        return left * self._sides[0][1] + right
