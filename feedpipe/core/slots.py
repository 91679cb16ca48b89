"""Slots: the host memory that holds global batches while they are made and staged.

A host slot is one buffer in which every (field, replica) region starts on a 64-byte boundary,
so each replica's rows are already cut out when they are written: staging a replica hands its
regions over as they are, with no further copy on the host.

Slots are allocated once and reused. A slot goes back to the pool when every array and tensor
made from its last lease has been freed, which the lease's finalizer reports; nothing polls.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np

from feedpipe.core._shm import SharedBuffer
from feedpipe.core._sync import Stopped
from feedpipe.core.machine import available_host_bytes
from feedpipe.core.pinned import PageLocker
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import ReplicaSplit

ALIGN_BYTES = 64
"""TensorFlow's CPU kernels expect 64-byte aligned buffers (Eigen's EIGEN_MAX_ALIGN_BYTES)."""


ROW_BOOKKEEPING_BYTES = 32
"""Host bytes a step holds per row beside its slot: the sampler's rows, positions and sample
indices (int64 each) and the masks of real rows, on the host and on the device."""


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}" if unit != "bytes" else f"{int(nbytes)} bytes"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def check_host_memory(layout: SlotLayout, slots: int, *, shared: bool, hosts: int = 1) -> None:
    """Refuses, before any is allocated, `slots` slots of `layout` (and each step's bookkeeping
    rows) that need more host memory than is available (`available_host_bytes`): allocating
    them would get the process killed by the OOM killer, with no Python error, at the first
    batch. Names the size and the largest global batch that fits; `hosts` share each global
    batch, `layout` being this host's rows."""
    available = available_host_bytes(shared)
    if available is None:
        return
    free, where = available
    rows = layout.split.global_batch_size
    needed = slots * layout.nbytes + rows * ROW_BOOKKEEPING_BYTES
    if needed <= free:
        return
    replicas = layout.split.num_replicas * hosts
    per_row = slots * layout.spec.row_bytes + ROW_BOOKKEEPING_BYTES
    fits = free // per_row * hosts // replicas * replicas
    raise ValueError(
        f"`global_batch_size`={rows * hosts} needs {_size(needed)} of host memory: {slots} "
        f"slots of {_size(layout.nbytes)} ({rows} rows of {layout.spec.row_bytes} bytes) and "
        f"{ROW_BOOKKEEPING_BYTES} bytes a row of bookkeeping, but only {_size(free)} is "
        f"available ({where}); use a `global_batch_size` of at most {fits}, or smaller "
        "samples."
    )


class SlotLayout:
    """Where each (field, replica) region lives inside a slot's buffer.

    With `contiguous`, a field's replica regions follow each other with no gap, so the whole
    global batch of that field is one array (used when batches stay on the host).
    """

    def __init__(self, spec: SampleSpec, split: ReplicaSplit, *, contiguous: bool = False):
        self.spec = spec
        self.split = split
        self.contiguous = contiguous
        self.field_offsets: list[int] = []
        strides = []
        offset = 0
        for leaf in spec.leaves:
            region = split.per_replica * leaf.row_bytes
            stride = region if contiguous else round_up(region, ALIGN_BYTES)
            offset = round_up(offset, ALIGN_BYTES)
            self.field_offsets.append(offset)
            strides.append(stride)
            offset += stride * split.num_replicas
        self.nbytes = max(round_up(offset, ALIGN_BYTES), ALIGN_BYTES)
        self.offsets = [
            [start + r * stride for start, stride in zip(self.field_offsets, strides, strict=True)]
            for r in range(split.num_replicas)
        ]
        """`offsets[replica][field]`: where that region starts in the buffer."""

        # Each region as (bytes, dtype, shape), worked out once: views are made every batch.
        self._regions = [
            [self._region(offset, split.per_replica, field) for field, offset in enumerate(row)]
            for row in self.offsets
        ]
        self._globals = [
            self._region(start, split.global_batch_size, field)
            for field, start in enumerate(self.field_offsets)
        ]
        self.spans = [
            [(where.start, where.stop - where.start) for where, _, _ in row]
            for row in self._regions
        ]
        """`spans[replica][field]`: that region's (offset, bytes) in the buffer, for a copy
        that takes addresses, not arrays."""

    def _region(self, offset: int, rows: int, field: int) -> tuple[slice, np.dtype, tuple]:
        leaf = self.spec.leaves[field]
        return slice(offset, offset + rows * leaf.row_bytes), leaf.dtype, (rows, *leaf.shape)

    @property
    def batch_bytes(self) -> int:
        """Bytes of payload in one global batch (without alignment gaps)."""
        return self.spec.row_bytes * self.split.global_batch_size

    def views(self, memory: np.ndarray) -> list[list[np.ndarray]]:
        """Arrays over the bytes `memory`: `views[replica][field]`, `[per_replica, *shape]`."""
        return [
            [memory[where].view(dtype).reshape(shape) for where, dtype, shape in row]
            for row in self._regions
        ]

    def global_views(self, memory: np.ndarray) -> list[np.ndarray]:
        """Arrays over the bytes `memory`, one per field, each `[global_batch, *shape]`."""
        if not self.contiguous:
            raise ValueError("Only a contiguous layout has global views.")
        return [memory[where].view(dtype).reshape(shape) for where, dtype, shape in self._globals]


def aligned_buffer(nbytes: int, align: int = ALIGN_BYTES) -> np.ndarray:
    """`nbytes` starting on an `align` boundary, alone in the `align`-sized blocks they touch."""
    raw = np.empty(round_up(nbytes, align) + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of `array` in fresh memory that starts on an `ALIGN_BYTES` boundary: a framework
    can take it as it is (JAX's CPU `device_put` wraps aligned memory, and copies the rest)."""
    out = aligned_buffer(array.nbytes).view(array.dtype).reshape(array.shape)
    np.copyto(out, array)
    return out


_slot_ids = itertools.count()


class HostSlot:
    """One global batch's worth of host memory, laid out per replica.

    Its bytes are private to this process, or `shared` with worker processes that map them;
    a worker that receives a slot builds its own `HostSlot` over them with the same `ident`.
    """

    def __init__(
        self,
        layout: SlotLayout,
        overflow: bool = False,
        *,
        shared: bool = False,
        buffer: np.ndarray | None = None,
        ident: int | None = None,
    ):
        self.layout = layout
        self.ident = next(_slot_ids) if ident is None else ident
        self.shared = SharedBuffer(layout.nbytes, "slot") if shared else None
        if buffer is None:
            buffer = self.shared.array if shared else aligned_buffer(layout.nbytes)
        self.buffer = buffer
        self.regions = layout.views(self.buffer)
        """`regions[replica][field]`: where the producer writes the rows of that replica."""
        self.overflow = overflow
        """True for a one-off slot, dropped rather than pooled once freed."""

    def row(self, field: int, row: int) -> np.ndarray:
        """A one-row view of `field` at global row `row` (writable, even for scalar fields)."""
        replica, offset = divmod(row, self.layout.split.per_replica)
        return self.regions[replica][field][offset : offset + 1]

    def copy_row(self, row: int, source: HostSlot, source_row: int) -> None:
        """Copies global row `source_row` of `source` to global row `row` of this slot."""
        for field in range(len(self.layout.spec.leaves)):
            self.row(field, row)[...] = source.row(field, source_row)

    def runs(self, start: int, count: int) -> Iterator[tuple[list[np.ndarray], int, int]]:
        """Global rows `start:start+count`, one run per replica they cross: that replica's
        regions, each cut to the run's rows, and where the run begins (`0` for row `start`)
        and how many rows it has."""
        b = self.layout.split.per_replica
        done = 0
        while done < count:
            replica, offset = divmod(start + done, b)
            n = min(count - done, b - offset)
            yield [region[offset : offset + n] for region in self.regions[replica]], done, n
            done += n

    def write_rows(self, start: int, leaves: list[np.ndarray], lo: int, count: int) -> None:
        """Copies rows `lo:lo+count` of `leaves` to global rows `start:start+count`."""
        for outs, done, n in self.runs(start, count):
            for out, leaf in zip(outs, leaves, strict=True):
                out[...] = leaf[lo + done : lo + done + n]

    def pad(self, written: int) -> None:
        """Fills rows `written:` by repeating the rows `0:written` in order."""
        size = self.layout.split.global_batch_size
        if written >= size:
            return
        runs = [outs for outs, _, _ in self.runs(0, written)]
        real = [np.concatenate(parts) for parts in zip(*runs, strict=True)]
        for start in range(written, size, written):
            self.write_rows(start, real, 0, min(written, size - start))

    def lease(self, on_free: Callable[[HostSlot], None]) -> np.ndarray:
        """This slot's bytes, calling `on_free(slot)` once they and every view of them are gone.

        The bytes are exported from a ctypes array made for this lease alone: every array or
        tensor derived from them keeps it alive, so its finalizer runs exactly when the last of
        them is freed, in whichever thread frees it. Nothing polls.
        """
        owner = (ctypes.c_char * self.layout.nbytes).from_buffer(self.buffer)
        weakref.finalize(owner, on_free, self)
        return np.frombuffer(owner, np.uint8)


class SlotPool:
    """A fixed set of host slots, allocated once and reused.

    Invariant: a slot is handed to a producer only when nothing made from its last lease is
    alive. When every slot is held and the consumer is starving (it keeps batches it has
    taken), the producer asks for a one-off `overflow` slot rather than deadlock; it is dropped
    when freed.

    With `shared`, slots are memory that worker processes can map.

    With `page_lock`, each pooled slot is page-locked once, when it is allocated, so that it
    copies to an accelerator at the link's speed, and unregistered before its memory is freed.
    One-off (overflow) slots stay pageable: registering costs ~0.75 ms per MB, more than the
    one copy it would speed up saves.
    """

    def __init__(
        self,
        layout: SlotLayout,
        capacity: int,
        *,
        shared: bool = False,
        page_lock: PageLocker | None = None,
    ):
        self.layout = layout
        self.capacity = capacity
        self.shared = shared
        self.page_lock = page_lock
        """Page-locks the pooled slots, or None to leave them pageable."""
        self._locked_slots = 0
        self._pageable_slots = 0
        self._page_lock_failure: str | None = None
        self._page_lock_s = 0.0
        self.dropped: list[int] = []
        """Idents of one-off slots dropped since the last `take_dropped` (workers unmap them)."""
        self.allocated = 0
        self.overflow_allocations = 0
        self._free: list[HostSlot] = []
        self._woken = False
        # Re-entrant: a finalizer can run in a thread that already holds the lock.
        self._cond = threading.Condition(threading.RLock())

    def take(self, stop: threading.Event) -> HostSlot | None:
        """A free slot if one is ready now (or can still be allocated), else None; raises
        `Stopped` if `stop` is set."""
        if stop.is_set():
            raise Stopped
        with self._cond:
            if self._free:
                return self._free.pop()
            if self.allocated >= self.capacity:
                return None
            self.allocated += 1
        # Allocated outside the lock: page-locking a slot takes ~0.75 ms per MB, and a freed
        # lease gives its slot back under this lock, from whichever thread frees it.
        return self._pooled_slot()

    def _pooled_slot(self) -> HostSlot:
        if self.page_lock is None:
            return HostSlot(self.layout, shared=self.shared)
        # A private slot alone in its pages: the driver locks whole pages, so a neighbour
        # registered on its own would overlap it.
        buffer = None if self.shared else aligned_buffer(self.layout.nbytes, mmap.PAGESIZE)
        slot = HostSlot(self.layout, shared=self.shared, buffer=buffer)
        started = time.perf_counter()
        locked = self.page_lock.lock(slot.buffer, slot)
        elapsed = time.perf_counter() - started
        with self._cond:
            self._page_lock_s += elapsed
            if locked:
                self._locked_slots += 1
            else:
                self._pageable_slots += 1
                self._page_lock_failure = self._page_lock_failure or self.page_lock.reason
        return slot

    @property
    def page_locked(self) -> bool:
        """True when a page locker was given, can lock, and every pooled slot allocated so far
        is page-locked."""
        with self._cond:
            return (
                self.page_lock is not None and self.page_lock.available and not self._pageable_slots
            )

    @property
    def page_lock_reason(self) -> str | None:
        """Why the pooled slots are not all page-locked; None when they are."""
        with self._cond:
            if self.page_lock is None:
                return "page-locking was not asked for (the pool was given no `page_lock`)"
            if not self.page_lock.available:
                return self.page_lock.reason
            if self._pageable_slots:
                slots = self._locked_slots + self._pageable_slots
                return (
                    f"{self._pageable_slots} of {slots} pooled slots are pageable: "
                    f"{self._page_lock_failure}"
                )
            return None

    @property
    def page_locked_bytes(self) -> int:
        """Bytes of this pool's slots that were page-locked when allocated."""
        with self._cond:
            return self._locked_slots * self.layout.nbytes

    @property
    def page_lock_s(self) -> float:
        """Seconds this pool spent page-locking its slots, failed attempts included."""
        with self._cond:
            return self._page_lock_s

    def overflow(self) -> HostSlot:
        """A one-off slot, beyond the capacity, dropped once freed."""
        with self._cond:
            self.overflow_allocations += 1
        return HostSlot(self.layout, overflow=True, shared=self.shared)

    def wait(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for a slot to be given back, or for `wake`."""
        with self._cond:
            if not (self._free or self._woken or self.allocated < self.capacity):
                self._cond.wait(timeout_s)
            self._woken = False

    def wake(self) -> None:
        """Ends a `wait` now, or the next one (the consumer started starving: time to see if
        a one-off slot is due)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def give_back(self, slot: HostSlot) -> None:
        """Returns a slot to the pool (a producer that did not use it, or a freed lease)."""
        with self._cond:
            if slot.overflow:
                if slot.shared is not None:
                    self.dropped.append(slot.ident)
                return
            self._free.append(slot)
            self._cond.notify()

    def take_dropped(self) -> list[int]:
        """The idents of shared one-off slots dropped since the last call."""
        with self._cond:
            dropped, self.dropped = self.dropped, []
        return dropped

    def __repr__(self) -> str:
        locked = "" if self.page_lock is None else f", page_locked={self.page_locked}"
        return (
            f"SlotPool(capacity={self.capacity}, allocated={self.allocated}, "
            f"free={len(self._free)}, slot_bytes={self.layout.nbytes}{locked})"
        )
