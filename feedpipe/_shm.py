"""Shared memory that worker processes map: anonymous files handed over by descriptor.

Each buffer is a file that has no name by the time anyone uses it: on Linux a `memfd`, elsewhere
a file created in the shared-memory directory and unlinked at once. Its descriptor is passed to
the workers, so no `/dev/shm` entry can outlive its owner, even one killed with SIGKILL. Names
carry `feedpipe-<owner pid>-` for `/proc/<pid>/maps` listings; a file of that name found at start
(an owner killed between create and unlink) is removed if its owner is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np

PREFIX = "feedpipe"
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where a named buffer briefly lives on systems without `memfd_create`."""

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
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    path.unlink()
    return fd


class SharedBuffer:
    """`nbytes` of memory that other processes can map from `fd`.

    `array` is a writable `np.uint8` view; the mapping lives as long as any view of it, and the
    descriptor is closed by `close()` or when this object is collected.
    """

    def __init__(self, nbytes: int, kind: str):
        self.name = f"{PREFIX}-{os.getpid()}-{kind}-{next(_counter)}"
        self.nbytes = nbytes
        self.fd = _anonymous_file(self.name)
        self._close_fd = weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.array = np.frombuffer(mmap.mmap(self.fd, max(nbytes, 1)), np.uint8)[:nbytes]

    def close(self) -> None:
        """Closes the descriptor and drops `array`: the mapping goes with the last other view."""
        self._close_fd()
        self.array = None

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, nbytes={self.nbytes})"


def map_shared(fd: int, nbytes: int, *, writable: bool = True) -> np.ndarray:
    """The `np.uint8` bytes of a `SharedBuffer` received as `fd` (which this closes)."""
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        memory = mmap.mmap(fd, max(nbytes, 1), prot=prot)
    finally:
        os.close(fd)
    return np.frombuffer(memory, np.uint8)[:nbytes]
