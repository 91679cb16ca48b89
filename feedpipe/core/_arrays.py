"""The arrays a worker setup carries, copied once into one shared buffer that every worker maps.

A source holding numpy arrays (a dataset class holding its data) is pickled with its arrays out
of band (pickle protocol 5): the pickle itself stays small, and the arrays' bytes are written
once into an anonymous shared file, which N workers map read-only: one copy, not N, and no
worker unpickles the bytes. The copy is a `pwrite`, which fills the file's pages in the kernel;
a copy through a fresh mapping would take a page fault per 4 KiB besides.

That copy is memory (as much again as the arrays, while a feeder uses it) and time (giving a
file fresh pages costs about as much as the copy itself), so with warm workers on, the last
copy is kept for the next feeder over the same arrays, for `FEEDPIPE_WARM_IDLE_S` at most: the
same array objects, at the same addresses, hand over the kept copy, provided their bytes have
not changed since (read-only arrays cannot have changed; writable ones are compared with the
copy, which reads both once and writes nothing). Arrays changed in between get a new copy;
a copy in use is never written again.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import NamedTuple

import numpy as np

from feedpipe.core._shm import SharedBuffer, _libc, _map
from feedpipe.core.slots import ALIGN_BYTES

_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Shared(NamedTuple):
    """The arrays' bytes for the workers: a descriptor of the shared file (the caller's own,
    to close once every worker has it), its size, and each array's span in it."""

    fd: int
    nbytes: int
    spans: list[tuple[int, int]]


def _address(raw: memoryview) -> int:
    return np.frombuffer(raw, np.uint8).__array_interface__["data"][0] if raw.nbytes else 0


def write(fd: int, raw: memoryview, offset: int) -> None:
    """Writes `raw` into the file `fd` at `offset` (in as many calls as the kernel needs)."""
    raw = raw.cast("B")
    while raw.nbytes:
        written = os.pwrite(fd, raw, offset)
        raw, offset = raw[written:], offset + written


class _Kept:
    """The last copy, with what identifies the arrays it was made from."""

    def __init__(self, buffer: SharedBuffer, spans: list, raws: list[memoryview]):
        self.buffer = buffer
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
        writable = [i for i, raw in enumerate(raws) if not raw.readonly]
        if writable and self._view is None:
            self._view = _map(self.buffer.fd, self.buffer.nbytes, writable=False, what="kept")
        for i in writable:
            lo, hi = self.spans[i]
            if hi > lo and _libc.memcmp(self._view[lo:].ctypes.data, _address(raws[i]), hi - lo):
                return False
        return True


_lock = threading.Lock()
_kept: _Kept | None = None
_expiry: threading.Timer | None = None


def share(raws: list[memoryview], keep_s: float | None) -> Shared:
    """The bytes of `raws` in a shared file: the kept copy if it holds them unchanged, else a
    new copy, which is kept for `keep_s` seconds (None: not kept)."""
    global _kept
    with _lock:
        kept = _kept
    if kept is not None and kept.holds(raws):
        _keep_until(keep_s)
        return Shared(os.dup(kept.buffer.fd), kept.buffer.nbytes, kept.spans)
    spans, offset = [], 0
    for raw in raws:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        spans.append((offset, offset + raw.nbytes))
        offset += raw.nbytes
    buffer = SharedBuffer(offset, "data", mapped=False)
    for (lo, _), raw in zip(spans, raws, strict=True):
        write(buffer.fd, raw, lo)
    if keep_s is None or not all(_weakly_held(raw) for raw in raws):
        forget()
        return Shared(os.dup(buffer.fd), offset, spans)  # the copy goes with its last mapping
    with _lock:
        _kept = _Kept(buffer, spans, raws)
    _keep_until(keep_s)
    return Shared(os.dup(buffer.fd), offset, spans)


def _weakly_held(raw: memoryview) -> bool:
    try:
        weakref.ref(raw.obj)
    except TypeError:  # bytes: nothing tells that they are the same ones next time
        return False
    return True


def _keep_until(keep_s: float | None) -> None:
    global _expiry
    if keep_s is None:
        return
    timer = threading.Timer(keep_s, forget)
    timer.name, timer.daemon = "feedpipe-kept-arrays", True
    with _lock:
        previous, _expiry = _expiry, timer
    if previous is not None:
        previous.cancel()
    timer.start()


def _owner_gone(_ref) -> None:
    """Drops the kept copy when one of its arrays is collected (in any thread)."""
    global _kept
    with _lock:
        _kept = None


def forget() -> None:
    """Drops the kept copy now: its memory goes once no worker maps it."""
    global _kept, _expiry
    with _lock:
        _kept, timer, _expiry = None, _expiry, None
    if timer is not None:
        timer.cancel()
        if timer is not threading.current_thread():
            timer.join()


def kept_nbytes() -> int:
    """The bytes of the kept copy (0: none)."""
    with _lock:
        return 0 if _kept is None else _kept.buffer.nbytes
