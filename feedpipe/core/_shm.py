"""Shared memory that worker processes map: anonymous files handed over by descriptor.

Each buffer is a file that has no name by the time anyone uses it: on Linux a `memfd`, elsewhere
a file created in the shared-memory directory and unlinked at once. Its descriptor is passed to
the workers, so no `/dev/shm` entry can outlive its owner, even one killed with SIGKILL. Names
are `feedpipe-<owner pid>-<kind>-<n>` (`NAME_PATTERN`) for `/proc/<pid>/maps` listings; a file
of that name found at start (an owner killed between create and unlink) is removed if its owner
is gone.

Buffers are mapped with libc's `mmap`, not Python's, which keeps a duplicate descriptor open for
as long as the mapping lives: a mapping here holds no descriptor, so batches a consumer keeps
cost memory, never descriptors. A buffer's own descriptor, needed only to hand it to workers,
is closed by `close()` as soon as no worker needs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import os
import re
import tempfile
import weakref
from pathlib import Path

import numpy as np

PREFIX = "feedpipe"
KINDS = ("slot", "data", "status")
NAME_PATTERN = re.compile(rf"{PREFIX}-\d+-(?:{'|'.join(KINDS)})-\d+")
"""The names of feedpipe's buffers, and nothing else (not a path that merely holds
`feedpipe-`, such as an unpacked `feedpipe-0.1.0/` checkout)."""
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where a named buffer briefly lives on systems without `memfd_create`."""
MEMFD = hasattr(os, "memfd_create")
"""Whether buffers are memfds (Linux): memory alone, charged as this process's (and its
cgroup's), never a file of `SHM_DIR`, whose size (Docker's 64 MiB `/dev/shm`) bounds only
the files of systems without them."""

_counter = itertools.count()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Removes `feedpipe-<pid>-*` files in the shared-memory directory whose owner is gone."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}-*-*"):
        owner = path.name.split("-")[1]
        if owner.isdigit() and not _pid_alive(int(owner)):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def _anonymous_file(name: str) -> int:
    try:
        if MEMFD:
            return os.memfd_create(name, os.MFD_CLOEXEC)
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        path.unlink()
        return fd
    except OSError as error:
        if error.errno == errno.EMFILE:
            error.add_note(
                "feedpipe: this process has run out of file descriptors. feedpipe keeps one per "
                "host slot it shares with worker processes (a few per feeder), none per batch "
                "kept; look for other open files, or raise the limit (`ulimit -n`)."
            )
        raise


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXES = {
    errno.ENOMEM: "this process's address space (`ulimit -v`), the memory the system may "
    "commit, or its count of mappings (`vm.max_map_count`) is at its limit: a smaller `depth` "
    "or `global_batch_size` makes fewer and smaller host slots, and fewer `workers` use less "
    "memory in all",
}
"""What to do when a mapping fails, by errno, where there is something to do."""


def _refuse(size: int, what: str):
    """Raises the error of the mapping of `size` bytes of `what` that just failed."""
    code = ctypes.get_errno()
    fix = _MAP_FIXES.get(code)
    raise OSError(
        code,
        f"mapping {what} ({size} bytes) failed with {errno.errorcode.get(code, code)} "
        f"({os.strerror(code)})" + (f"; {fix}." if fix else "."),
    )


def _map(fd: int, nbytes: int, *, writable: bool, what: str) -> np.ndarray:
    """The file `fd` (holding `what`) mapped as `np.uint8` bytes; unmapped when the last view
    of them goes."""
    size = max(nbytes, 1)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = _libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        _refuse(size, what)
    memory = (ctypes.c_char * size).from_address(address)
    weakref.finalize(memory, _libc.munmap, address, size)
    array = np.frombuffer(memory, np.uint8)[:nbytes]
    array.flags.writeable = writable
    return array


class SharedBuffer:
    """`nbytes` of memory that other processes can map from `fd`.

    `array` is a writable `np.uint8` view; the mapping lives as long as any view of it, and the
    descriptor is closed by `close()` or when this object is collected. A buffer written
    through its descriptor only (`mapped=False`: `os.pwrite` into `fd`) has no `array`.
    """

    def __init__(self, nbytes: int, kind: str, *, mapped: bool = True):
        self.name = f"{PREFIX}-{os.getpid()}-{kind}-{next(_counter)}"
        self.nbytes = nbytes
        self.fd = _anonymous_file(self.name)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.array = _map(self.fd, nbytes, writable=True, what=self.name) if mapped else None

    def close(self) -> None:
        """Closes the descriptor and drops `array`: the mapping goes with the last other view."""
        self._close_fd()
        self.array = None

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, nbytes={self.nbytes})"


def map_shared(fd: int, nbytes: int, *, what: str, writable: bool = True) -> np.ndarray:
    """The `np.uint8` bytes of a `SharedBuffer` received as `fd` (which this closes); `what`
    it holds names it in an error."""
    try:
        return _map(fd, nbytes, writable=writable, what=what)
    finally:
        os.close(fd)


_MAP_FIXED = 0x10  # the same on Linux and macOS; Python's mmap module does not export it


def map_parts(fds: list[int], sizes: list[int], *, what: str) -> np.ndarray:
    """The files `fds` (of `sizes` bytes, each but the last a whole number of pages) mapped
    read-only one after the other, as one run of `np.uint8` bytes; closes the descriptors.

    One array may lie across two files: the files are written in parallel (one file's pages
    are given out one writer at a time), and read as one."""
    try:
        total = sum(sizes)
        size = max(total, 1)
        anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        base = _libc.mmap(None, size, 0, anonymous, -1, 0)  # the address range, reserved
        if base is None or base == _MAP_FAILED:
            _refuse(size, what)
        memory = (ctypes.c_char * size).from_address(base)
        weakref.finalize(memory, _libc.munmap, base, size)
        offset = 0
        for fd, part in zip(fds, sizes, strict=True):
            if part:
                flags = mmap.MAP_SHARED | _MAP_FIXED
                if _libc.mmap(base + offset, part, mmap.PROT_READ, flags, fd, 0) != base + offset:
                    _refuse(part, what)
            offset += part
        array = np.frombuffer(memory, np.uint8)[:total]
        array.flags.writeable = False
        return array
    finally:
        for fd in fds:
            os.close(fd)
