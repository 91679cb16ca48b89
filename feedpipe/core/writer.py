"""Writer: everything that runs per sample, in whichever thread or process makes it.

`SampleWriter` reads a sample, applies `transform` (with an rng or a stateless seed drawn from
(seed, epoch, index) where it asks for one), checks it against the spec and writes its fields
into the rows of a host slot, transposed where asked. `RowStream` does the same for the rows of
a stream source (a generator or a tf.data.Dataset), in its own order. An error in user code gets
a note naming the thread and the sample; under `errors="skip"` an indexed source's failing sample
is left out of its row instead (`Skip`), for the producer to book. Nothing here imports
TensorFlow: worker processes run it.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np
import optree

from feedpipe.core.sampler import Step
from feedpipe.core.skips import ErrorPolicy, over_budget
from feedpipe.core.slots import HostSlot
from feedpipe.core.sources import ArraySource, SampleSpec, Source, TFDatasetSource, as_array
from feedpipe.core.text import listed, shown

Transform = Callable[..., Any]


class Skip(NamedTuple):
    """A row left unwritten under `errors="skip"`: its global row, its sample, and the error
    the sample raised."""

    row: int
    index: int
    error: BaseException


RNG = "rng"
"""A `transform(sample, rng)` gets a numpy Generator."""
SEED = "seed"
"""A `transform(sample, seed)` (the second parameter named `seed`) gets a stateless-RNG seed, two
int64s for `tf.random.stateless_*` ops: the same here, in workers and on tf.data service."""


def randomness(transform: Transform) -> str | None:
    """What `transform` takes after the sample: None, `RNG` or `SEED` (by its second
    parameter's name)."""
    try:
        bound = inspect.signature(transform).bind(None, None)
    except TypeError:
        return None
    except ValueError:  # no signature (some builtins): call it with the sample alone
        return None
    names = list(bound.arguments)
    return SEED if len(names) == 2 and names[1] == SEED else RNG


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator a `transform` gets for one sample: a function of (seed, epoch, index)."""
    return np.random.default_rng([seed, epoch, index])


def sample_seeds(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """The stateless seed of each of `indices`, shape (n, 2): `[seed, epoch * 2**40 + index]`,
    a function of (seed, epoch, index) alone, so a value does not depend on who made it."""
    indices = np.asarray(indices, np.int64)
    return np.stack([np.full_like(indices, seed), (epoch << 40) + indices], axis=1)


def randomness_for(kind: str | None, seed: int, epoch: int, index: int) -> Any:
    """The rng or seed a `transform` of `kind` gets for sample `index` of `epoch`."""
    if kind == SEED:
        return sample_seeds(seed, epoch, np.array([index]))[0]
    return sample_rng(seed, epoch, index)


def raise_noted(error: BaseException, doing: str, index: int, epoch: int) -> NoReturn:
    """Raises `error` with a note naming the thread and the sample.

    A `StopIteration` from user code becomes a RuntimeError that says so: raised as it is, it
    would end the generators the pipeline is made of, which Python turns into a RuntimeError
    that names neither the sample nor the cause.
    """
    note = (
        f"feedpipe: raised in {threading.current_thread().name} while {doing} index {index} "
        f"of epoch {epoch}."
    )
    if isinstance(error, StopIteration):
        stand_in = RuntimeError(
            f"User code raised StopIteration({', '.join(shown(arg, repr) for arg in error.args)}"
            "); an indexed source says it has no sample `i` with IndexError, and a `transform` "
            "must return a sample."
        )
        stand_in.add_note(note)
        raise stand_in from error
    error.add_note(note)
    raise error


def mark(status: np.ndarray | None, index: int, epoch: int) -> None:
    """Keeps a status row at `[index, epoch, time.monotonic()]`: the sample being made (-1:
    idle) and since when, so a hang can be named from outside (see `feedpipe._sync.Watchdog`)."""
    if status is not None:
        status[2] = time.monotonic()
        status[1] = epoch
        status[0] = index


def apply_transform(
    transform: Transform, kind: str | None, sample: Any, seed: int, epoch: int, index: int
) -> Any:
    """`transform(sample)`, or with the rng or seed `kind` names; an error gets a note naming
    the sample."""
    try:
        if kind is not None:
            return transform(sample, randomness_for(kind, seed, epoch, index))
        return transform(sample)
    except BaseException as error:
        raise_noted(error, "producing sample", index, epoch)


def first_look(
    source: Source,
    transform: Transform | None,
    seed: int,
    status: np.ndarray | None = None,
    policy: ErrorPolicy | None = None,
) -> tuple[SampleSpec, str]:
    """The spec of what producers will make, from the first sample after `transform`, and a
    digest of that sample as the source gave it (two shards of a generator that begin with the
    same digest ignore their shard). The source is measured first (`Source.measure`).

    The first sample is sample 0 (the first of a stream). Under `policy`'s `errors="skip"`, an
    indexed source's sample that raises is passed over for the next, as its batch will skip it,
    up to the epoch's budget of skips: past it, the error raises with a note saying so.
    """
    source.measure(policy)
    tries = 1
    if policy is not None and policy.skips and source.indexed:
        budget = policy.budget(source.length)
        tries = min(budget + 1, source.length)
    for index in range(tries):
        try:
            return _look(source, transform, seed, index, status)
        except Exception as error:
            if index + 1 < tries:
                continue  # passed over, as its batch will skip it
            if tries > 1 and tries == source.length:
                error.add_note(
                    f'feedpipe: errors="skip" found no sample that reads: all {tries} raised.'
                )
            elif tries > 1:
                skipping = f"{tries} samples of epoch 0 (indices {listed(range(tries))})"
                error.add_note(over_budget(skipping, policy, budget))
            raise


def _look(
    source: Source, transform: Transform | None, seed: int, index: int, status: np.ndarray | None
) -> tuple[SampleSpec, str]:
    """The spec of sample `index` (the first of a stream) after `transform`, and a digest of
    the sample as the source gave it; an error gets a note naming the sample."""
    mark(status, index, 0)
    try:
        sample = source.sample(index) if source.indexed else source.first_sample()
        digest = hashlib.sha1()
        for leaf in optree.tree_leaves(sample):
            digest.update(np.ascontiguousarray(as_array(leaf)).tobytes())
        if transform is not None:
            sample = apply_transform(transform, randomness(transform), sample, seed, 0, index)
        return SampleSpec.of(sample, index=index), digest.hexdigest()
    except Exception as error:
        error.add_note(
            f"feedpipe: raised while reading sample {index} to learn the structure, shapes and "
            "dtypes of the samples."
        )
        raise
    finally:
        mark(status, -1, 0)


class SampleWriter:
    """Reads samples, applies `transform`, checks them against the spec and writes rows.

    `spec` is what `transform` returns; `axes[field]`, where given, reorders that field's axes
    as it is written (for example HWC to CHW), so the slot holds `out_spec` and no transpose
    ever runs later. `status`, where given, is a float64 array that the writer keeps at
    `[sample index, epoch, time.monotonic() when it started]` (index -1 when idle), so a hang
    can be named from outside.
    """

    def __init__(
        self,
        source: Source,
        spec: SampleSpec,
        transform: Transform | None,
        seed: int,
        axes: Sequence[tuple[int, ...] | None] | None = None,
        skips: bool = False,
    ):
        self.source = source
        self.skips = skips
        """`errors="skip"`: a sample that raises is left out of its row (see `fill_rows`)."""
        self.spec = spec
        self.transform = transform
        self.seed = seed
        self.axes = list(axes) if axes is not None else [None] * len(spec.leaves)
        self.out_spec = spec.transposed(self.axes)
        self.randomness = None if transform is None else randomness(transform)
        # Arrays without a transform are gathered with one vectorised copy per field.
        self.vectorised = (
            transform is None
            and isinstance(source, ArraySource)
            and all(a is None for a in self.axes)
        )
        self.status: np.ndarray | None = None

    def mark(self, index: int, epoch: int) -> None:
        """Notes that sample `index` of `epoch` is being made (-1: idle)."""
        mark(self.status, index, epoch)

    def prepare(self, sample: Any, index: int, epoch: int) -> list[np.ndarray]:
        """The fields of one sample after `transform`, as checked arrays in the slot's layout."""
        if self.transform is not None:
            sample = apply_transform(
                self.transform, self.randomness, sample, self.seed, epoch, index
            )
        try:
            leaves = self.spec.flatten(sample, index)
        except ValueError as error:
            raise_noted(error, "checking sample", index, epoch)
        return [
            leaf if axes is None else leaf.transpose(axes)
            for leaf, axes in zip(leaves, self.axes, strict=True)
        ]

    def read(self, index: int, epoch: int) -> list[np.ndarray]:
        """The checked fields of sample `index` of an indexed source."""
        self.mark(index, epoch)
        try:
            sample = self.source.sample(index)
        except BaseException as error:
            raise_noted(error, "producing sample", index, epoch)
        return self.prepare(sample, index, epoch)

    def fill_rows(
        self,
        slot: HostSlot,
        epoch: int,
        first_row: int,
        indices: np.ndarray,
    ) -> list[Skip]:
        """Writes samples `indices` to global rows `first_row`, `first_row + 1`, ... of `slot`;
        under `errors="skip"`, returns the rows left unwritten: the samples that raised."""
        skipped: list[Skip] = []
        for outs, done, count in slot.runs(first_row, len(indices)):
            rows = indices[done : done + count]
            if self.vectorised:
                self.mark(int(rows[0]), epoch)
                self.source.take(rows, outs)
                continue
            for row, index in enumerate(rows.tolist()):
                try:
                    leaves = self.read(index, epoch)
                except Exception as error:
                    if not self.skips:
                        raise
                    skipped.append(Skip(first_row + done + row, index, error))
                    continue
                for out, leaf in zip(outs, leaves, strict=True):
                    out[row] = leaf
        self.mark(-1, epoch)
        return skipped

    def fill(self, slot: HostSlot, step: Step) -> list[Skip]:
        """Writes the rows of `step` into `slot`, covers the rows it skipped and pads the rest
        of the batch (a host's share of a batch reads its padding rows: there is no rest);
        returns the rows skipped."""
        skipped = self.fill_rows(slot, step.epoch, 0, step.rows)
        cover(slot, [skip.row for skip in skipped], len(step.rows))
        slot.pad(len(step.rows))
        return skipped


def cover(slot: HostSlot, skipped: Sequence[int], written: int) -> None:
    """Fills each of the `skipped` rows among the first `written` with a copy of the first real
    row, so a skipped row holds a real sample's values (masked, weighted zero), never stale
    bytes that could turn a masked loss into NaN."""
    if not skipped:
        return
    real = sorted(set(range(written)) - set(skipped))
    if real:
        for row in skipped:
            slot.copy_row(row, slot, real[0])


class RowStream:
    """The rows of one epoch of a stream source, in blocks or one sample at a time."""

    def __init__(self, writer: SampleWriter, epoch: int, block_rows: int):
        self.writer = writer
        self.epoch = epoch
        self.position = 0  # samples of this epoch read so far
        source = writer.source
        if (
            isinstance(source, TFDatasetSource)
            and writer.transform is None
            and not any(writer.axes)
        ):
            # tf.data reads many samples at once: an error names where its block began.
            self._blocks = self._noted(source.blocks(block_rows), "reading the samples from")
        else:
            self._blocks = (
                [leaf[np.newaxis] for leaf in writer.prepare(sample, index, epoch)]
                for index, sample in enumerate(
                    self._noted(source.samples(epoch), "producing sample")
                )
            )
        self._block: list[np.ndarray] | None = None
        self._offset = 0

    def _noted(self, items: Iterator, doing: str) -> Iterator:
        """`items`, adding to an error they raise a note naming the sample reached."""
        while True:
            self.writer.mark(self.position, self.epoch)
            try:
                item = next(items)
            except StopIteration:
                return
            except Exception as error:
                raise_noted(error, doing, self.position, self.epoch)
            yield item

    def _next_rows(self, limit: int) -> tuple[list[np.ndarray], int, int] | None:
        """Up to `limit` rows of the current block, as (leaves, first row, count)."""
        if self._block is None or self._offset == len(self._block[0]):
            block = next(self._blocks, None)
            if block is None:
                return None
            self._block, self._offset = block, 0
        lo = self._offset
        count = min(limit, len(self._block[0]) - lo)
        self._offset += count
        self.position += count
        return self._block, lo, count

    def skip(self, count: int) -> None:
        while count:
            taken = self._next_rows(count)
            if taken is None:
                return
            count -= taken[2]

    def read_into(self, slot: HostSlot) -> int:
        """Fills `slot` from row 0 with up to a global batch of rows; returns how many."""
        size = slot.layout.split.global_batch_size
        filled = 0
        while filled < size:
            taken = self._next_rows(size - filled)
            if taken is None:
                break
            leaves, lo, count = taken
            slot.write_rows(filled, leaves, lo, count)
            filled += count
        self.writer.mark(-1, self.epoch)
        return filled
