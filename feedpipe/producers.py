"""Producers: who makes the samples, writing them straight into per-replica host slots.

A producer turns the plan of each epoch into filled slots, in order, behind one small interface
(`Producer.slots`). `ThreadProducer` runs in the feeder's background thread; it is what
`workers=0` uses. `SampleWriter` does the per-sample work (read, `transform`, check, write) and
holds no thread state, so other producers can reuse it.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np

from feedpipe.sampler import EpochEnd, Sampler, Step
from feedpipe.source import ArraySource, SampleSpec, Source, TFDatasetSource
from feedpipe.split import HostSlot

Transform = Callable[..., Any]


class Position(NamedTuple):
    """Where a stream of batches starts: an epoch and a step within it."""

    epoch: int
    step: int


def accepts_rng(transform: Transform) -> bool:
    """Whether `transform` takes `(sample, rng)` rather than `(sample)`."""
    try:
        inspect.signature(transform).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): call it with the sample alone
        return False
    return True


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator a `transform` gets for one sample: a function of (seed, epoch, index)."""
    return np.random.default_rng([seed, epoch, index])


def _note_origin(error: BaseException, doing: str, index: int, epoch: int) -> None:
    error.add_note(
        f"feedpipe: raised in {threading.current_thread().name} while {doing} index {index} "
        f"of epoch {epoch}."
    )


def apply_transform(
    transform: Transform, with_rng: bool, sample: Any, seed: int, epoch: int, index: int
) -> Any:
    """`transform(sample)` or `transform(sample, rng)`; an error gets a note naming the sample."""
    try:
        if with_rng:
            return transform(sample, sample_rng(seed, epoch, index))
        return transform(sample)
    except Exception as error:
        _note_origin(error, "producing sample", index, epoch)
        raise


class SampleWriter:
    """Reads samples, applies `transform`, checks them against the spec and writes rows."""

    def __init__(self, source: Source, spec: SampleSpec, transform: Transform | None, seed: int):
        self.source = source
        self.spec = spec
        self.transform = transform
        self.seed = seed
        self.with_rng = transform is not None and accepts_rng(transform)
        # Arrays without a transform are gathered with one vectorised copy per field.
        self.vectorised = transform is None and isinstance(source, ArraySource)

    def prepare(self, sample: Any, index: int, epoch: int) -> list[np.ndarray]:
        """The fields of one sample after `transform`, as checked arrays."""
        if self.transform is not None:
            sample = apply_transform(self.transform, self.with_rng, sample, self.seed, epoch, index)
        return self.spec.flatten(sample, index)

    def read(self, index: int, epoch: int) -> list[np.ndarray]:
        """The checked fields of sample `index` of an indexed source."""
        try:
            sample = self.source.sample(index)
        except Exception as error:
            _note_origin(error, "producing sample", index, epoch)
            raise
        return self.prepare(sample, index, epoch)

    def fill(self, slot: HostSlot, step: Step) -> None:
        """Writes the real rows of `step` into `slot`, then pads the rest of the batch."""
        b = slot.layout.split.per_replica
        for replica, outs in enumerate(slot.regions):
            rows = step.rows[replica * b : (replica + 1) * b]
            if self.vectorised:
                self.source.take(rows, [out[: len(rows)] for out in outs])
                continue
            for row, index in enumerate(rows.tolist()):
                for out, leaf in zip(outs, self.read(index, step.epoch), strict=True):
                    out[row] = leaf
        slot.pad(step.num_valid)


class Producer(Protocol):
    """Makes the filled slots of every epoch from `start` on, in order."""

    def slots(
        self,
        start: Position,
        acquire: Callable[[], HostSlot],
        give_back: Callable[[HostSlot], None],
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]: ...


class ThreadProducer:
    """Produces in the calling thread: the feeder's background thread when `workers=0`."""

    def __init__(
        self,
        writer: SampleWriter,
        global_batch_size: int,
        sampler: Sampler | None,
        remainder: str,
    ):
        self.writer = writer
        self.global_batch_size = global_batch_size
        self.sampler = sampler
        self.remainder = remainder

    def slots(
        self,
        start: Position,
        acquire: Callable[[], HostSlot],
        give_back: Callable[[HostSlot], None],
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        for epoch in itertools.count(start.epoch):
            first = start.step if epoch == start.epoch else 0
            if self.sampler is not None:
                yield from self._indexed_epoch(epoch, first, acquire)
            else:
                yield from self._stream_epoch(epoch, first, acquire, give_back)

    def _indexed_epoch(self, epoch: int, first: int, acquire) -> Iterator:
        for step in self.sampler.steps(epoch, first):
            slot = acquire()
            self.writer.fill(slot, step)
            yield step, slot
        on_epoch_end = getattr(self.writer.source, "on_epoch_end", None)
        if on_epoch_end is not None:
            on_epoch_end()
        yield EpochEnd(epoch, self.sampler.dropped_per_epoch)

    def _stream_epoch(self, epoch: int, first: int, acquire, give_back) -> Iterator:
        size = self.global_batch_size
        rows = _RowStream(self.writer, epoch, size)
        rows.skip(first * size)
        for index in itertools.count(first):
            slot = acquire()
            count = rows.read_into(slot)
            if count == 0 or (count < size and self.remainder == "drop"):
                give_back(slot)
                yield EpochEnd(epoch, dropped=count)
                return
            if count < size and self.remainder == "error":
                give_back(slot)
                raise ValueError(
                    f'`remainder`="error", but epoch {epoch} of the stream ended with '
                    f"{rows.position} samples, {count} past a multiple of `global_batch_size`="
                    f'{size}; use remainder="pad" or "drop".'
                )
            slot.pad(count)
            yield Step(epoch, index, None, count), slot
            if count < size:
                yield EpochEnd(epoch)
                return


class _RowStream:
    """The rows of one epoch of a stream source, in blocks or one sample at a time."""

    def __init__(self, writer: SampleWriter, epoch: int, block_rows: int):
        self.writer = writer
        self.epoch = epoch
        self.position = 0  # samples of this epoch read so far
        source = writer.source
        if isinstance(source, TFDatasetSource) and writer.transform is None:
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
            try:
                item = next(items)
            except StopIteration:
                return
            except Exception as error:
                _note_origin(error, doing, self.position, self.epoch)
                raise
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
        return filled
