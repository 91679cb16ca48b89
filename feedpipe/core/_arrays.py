"""The arrays a worker setup carries, copied once into shared files that every worker maps.

A source holding numpy arrays (a dataset class holding its data) is pickled with its arrays out
of band (pickle protocol 5): the pickle itself stays small, and the arrays' bytes are written
once into anonymous shared files, which N workers map read-only as one run of bytes
(`feedpipe.core._shm.map_parts`): one copy, not N, and no worker unpickles the bytes. The copy
is a `pwrite`, which fills a file's pages in the kernel (a copy through a fresh mapping takes a
page fault per 4 KiB besides). A file's new pages are given out one writer at a time, so a
large copy is split into one file per thread (`parts`), written in parallel.

That copy is memory (as much again as the arrays, while a feeder uses it) and time (giving a
file new pages costs about as much as the copy itself), so with warm workers on, the last copy
is kept for the next feeder over the same arrays: the same array objects, at the same
addresses, hand over the kept copy, provided their bytes have not changed since. Only an array
over immutable memory (its chain of bases ends in `bytes`) cannot have changed; every other one
is compared with the copy, which reads both once and writes nothing (memcmp, several times
faster than the copy, and than hashing the array). A read-only flag proves nothing: the array's
base may be written, or the flag switched off, the array edited and the flag switched back on.
Arrays changed in between get a new copy; a copy in use is never written again.

The kept copy is dropped when one of its arrays is collected, by the first feeder that finds it
older than `FEEDPIPE_WARM_IDLE_S`, by `fp.release()`, and at exit; no thread waits to drop it,
so none outlives a feeder.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from feedpipe.core._shm import SharedBuffer, _libc, map_parts
from feedpipe.core.machine import cores
from feedpipe.core.slots import ALIGN_BYTES

PART_BYTES = 64 << 20
"""The least a thread of the copy writes: below it, starting a thread costs more than it saves."""
MAX_PARTS = 8
"""Threads of the copy at most: beyond 8 the memory bus, not the page allocator, is the limit."""

_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Shared(NamedTuple):
    """The arrays' bytes for the workers: descriptors of the shared files (the caller's own, to
    close once every worker has them), each file's size, and each array's span in their run."""

    fds: list[int]
    sizes: list[int]
    spans: list[tuple[int, int]]


def _address(raw: memoryview) -> int:
    return np.frombuffer(raw, np.uint8).__array_interface__["data"][0] if raw.nbytes else 0


def write(fd: int, raw: memoryview, offset: int) -> None:
    """Writes `raw` into the file `fd` at `offset` (in as many calls as the kernel needs)."""
    raw = raw.cast("B")
    while raw.nbytes:
        written = os.pwrite(fd, raw, offset)
        raw, offset = raw[written:], offset + written


def parts(total: int) -> list[int]:
    """The sizes of the files `total` bytes are split into: one per thread of the copy, each
    but the last a whole number of pages."""
    count = max(1, min(cores(), MAX_PARTS, total // PART_BYTES))
    size = -(-total // count // mmap.PAGESIZE) * mmap.PAGESIZE
    sizes = []
    while total > 0 or not sizes:
        sizes.append(min(size, total))
        total -= sizes[-1]
    return sizes


def _layout(raws: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    spans, offset = [], 0
    for raw in raws:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        spans.append((offset, offset + raw.nbytes))
        offset += raw.nbytes
    return spans, offset


def _in_parallel(sizes: list[int], work: Callable[[int, int, int], object]) -> list:
    """`work(part, first, end)` for each part (its byte range in the run), in one thread each."""
    starts = np.cumsum([0, *sizes]).tolist()
    results: list = [None] * len(sizes)

    def run(part: int) -> None:
        results[part] = work(part, starts[part], starts[part + 1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(sizes))]
    for thread in threads:
        thread.start()
    try:
        run(0)
    finally:
        for thread in threads:
            thread.join()
    return results


def _pieces(raws: list, spans: list, first: int, end: int):
    """Each piece of the arrays that lies in bytes [first, end) of the run: (array index, its
    offset in that array, the offset in the run, the length)."""
    for i, (lo, hi) in enumerate(spans):
        a, b = max(lo, first), min(hi, end)
        if a < b:
            yield i, a - lo, a, b - a


class _Kept:
    """The last copy, with what identifies the arrays it was made from."""

    def __init__(self, buffers: list[SharedBuffer], spans: list, raws: list[memoryview]):
        self.buffers = buffers
        self.sizes = [buffer.nbytes for buffer in buffers]
        self.spans = spans
        self.owners = [weakref.ref(raw.obj, _owner_gone) for raw in raws]
        self.keys = [(_address(raw), raw.nbytes) for raw in raws]
        self._view: np.ndarray | None = None

    def holds(self, raws: list[memoryview]) -> bool:
        """Whether `raws` are the very arrays copied, unchanged since."""
        if len(raws) != len(self.keys):
            return False
        for raw, owner, key in zip(raws, self.owners, self.keys, strict=True):
            if owner() is not raw.obj or (_address(raw), raw.nbytes) != key:
                return False
        if all(_immutable(raw) for raw in raws):
            return True
        if self._view is None:
            fds = [os.dup(buffer.fd) for buffer in self.buffers]
            self._view = map_parts(fds, self.sizes, what="the kept copy of the arrays")
        run = self._view.ctypes.data

        def same(part: int, first: int, end: int) -> bool:
            return not any(
                _libc.memcmp(run + at, _address(raws[i]) + skip, length)
                for i, skip, at, length in _pieces(raws, self.spans, first, end)
                if not _immutable(raws[i])
            )

        return all(_in_parallel(self.sizes, same))


def _immutable(raw: memoryview) -> bool:
    """Whether nobody can write the bytes of `raw`: its array's chain of bases (arrays and
    memory views) ends in a `bytes` object, which numpy never lets be written."""
    owner = raw.obj
    while isinstance(owner, np.ndarray | memoryview):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    return isinstance(owner, bytes)


_lock = threading.Lock()
_kept: _Kept | None = None
_until = 0.0  # monotonic seconds after which the kept copy is not handed over


def share(raws: list[memoryview], keep_s: float | None) -> Shared:
    """The bytes of `raws` in shared files: the kept copy if it holds them unchanged, else a
    new copy, which is kept for `keep_s` seconds (None: not kept)."""
    global _kept
    kept = current()
    if kept is not None and kept.holds(raws):
        _keep_until(keep_s)
        return _hand(kept.buffers, kept.spans)
    spans, total = _layout(raws)
    sizes = parts(total)
    buffers = [SharedBuffer(size, "data", mapped=False) for size in sizes]

    def copy(part: int, first: int, end: int) -> None:
        for i, skip, at, length in _pieces(raws, spans, first, end):
            write(buffers[part].fd, raws[i][skip : skip + length], at - first)

    _in_parallel(sizes, copy)
    made = _Kept(buffers, spans, raws) if keep_s is not None and _weak(raws) else None
    with _lock:
        _kept = made  # a copy not kept goes with its last mapping
    _keep_until(keep_s)
    return _hand(buffers, spans)


def _hand(buffers: list[SharedBuffer], spans: list[tuple[int, int]]) -> Shared:
    """The caller's own descriptors of `buffers`."""
    return Shared([os.dup(b.fd) for b in buffers], [b.nbytes for b in buffers], spans)


def _weak(raws: list[memoryview]) -> bool:
    """Whether each array can be watched: bytes cannot, and nothing would tell that they are
    the same ones next time."""
    try:
        for raw in raws:
            weakref.ref(raw.obj)
    except TypeError:
        return False
    return True


def _keep_until(keep_s: float | None) -> None:
    global _until
    if keep_s is not None:
        with _lock:
            _until = time.monotonic() + keep_s


def current() -> _Kept | None:
    """The kept copy, dropped first (and None) if it has been kept longer than it was meant to
    be: called by every feeder with workers, so no thread need wait to drop it."""
    global _kept
    with _lock:
        if _kept is not None and time.monotonic() >= _until:
            _kept = None
        return _kept


def _owner_gone(_ref) -> None:
    """Drops the kept copy when one of its arrays is collected (in any thread)."""
    global _kept
    with _lock:
        _kept = None


def forget() -> None:
    """Drops the kept copy now: its memory goes once no worker maps it."""
    global _kept
    with _lock:
        _kept = None


def kept_nbytes() -> int:
    """The bytes of the kept copy (0: none, or kept for too long and dropped now)."""
    kept = current()
    return 0 if kept is None else sum(kept.sizes)
