"""Page-locked host memory: slots registered with the CUDA library the framework already loaded.

A copy to a GPU from pageable memory goes through the driver's own staging buffers: 7-13 GB/s
from feedpipe's slots on an H100 (PCIe Gen5 x16). The same memory once registered with
`cudaHostRegister` copies at 48-55 GB/s, the link's practical ceiling. Registering costs
~0.75 ms per MB, so it is done once per slot, never per batch.

feedpipe never loads CUDA and adds no dependency: it looks in `/proc/self/maps` for a CUDA
runtime (`libcudart`) the process already mapped, or failing that the driver (`libcuda`), and
calls it through ctypes. Memory is registered `PORTABLE`, page-locked for every context; the
driver API runs in device 0's primary context, the one XLA/JAX, PyTorch and the runtime API
share. Only the process that copies to the device page-locks; worker processes never do.

Where page-locking is impossible (no CUDA in the process, a limit, an error, or
`FEEDPIPE_PAGE_LOCK=0`) memory stays pageable, feedpipe runs as it would without, and
`PageLocker.reason` says why.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from feedpipe.core import env
from feedpipe.core._cuda import (
    DRIVER_PATH,
    RUNTIME_PATH,
    CudaError,
    Driver,
    loaded_library,
    open_loaded,
)

if TYPE_CHECKING:
    import numpy as np

PORTABLE = 1
"""`cudaHostRegisterPortable` and `CU_MEMHOSTREGISTER_PORTABLE`: locked for every context."""


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} bytes"


class _Runtime:
    """The CUDA runtime API: registers in the calling thread's current device's primary
    context, which the runtime makes current (and shares with the framework) if none is."""

    call = "cudaHostRegister"

    def __init__(self, lib: ctypes.CDLL):
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._clear = getattr(lib, "cudaGetLastError", None)
        self._text = getattr(lib, "cudaGetErrorString", None)
        if self._text is not None:
            self._text.argtypes = [ctypes.c_int]
            self._text.restype = ctypes.c_char_p

    def register(self, address: int, nbytes: int) -> int:
        code = self._register(address, nbytes, PORTABLE)
        if code and self._clear is not None:
            # The runtime keeps the error for the next cudaGetLastError, which frameworks
            # call after their own kernel launches: ours must not surface as theirs.
            self._clear()
        return code

    def unregister(self, address: int) -> int:
        code = self._unregister(address)
        if code and self._clear is not None:
            self._clear()
        return code

    def describe(self, code: int) -> str:
        text = self._text(code) if self._text is not None else None
        return text.decode(errors="replace") if text else "no description"


class _Driver:
    """The CUDA driver API, in device 0's primary context, made current around each call."""

    call = "cuMemHostRegister"

    def __init__(self, lib: ctypes.CDLL):
        try:
            self._driver = Driver(lib)
            self._driver.context(0)
        except CudaError as error:
            raise _Unavailable(str(error)) from error

    def _in_context(self, name: str, *args) -> int:
        try:
            with self._driver.current(0):
                return self._driver.call(name, *args)
        except CudaError as error:
            return error.code

    def register(self, address: int, nbytes: int) -> int:
        return self._in_context("cuMemHostRegister_v2", address, nbytes, PORTABLE)

    def unregister(self, address: int) -> int:
        return self._in_context("cuMemHostUnregister", address)

    def describe(self, code: int) -> str:
        return self._driver.describe(code)


class _Unavailable(Exception):
    """Why a CUDA library that is loaded cannot page-lock."""


class PageLocker:
    """Page-locks host memory through the CUDA library this process already loaded.

    Invariant: memory locked with `lock` is unregistered before it can be freed, because the
    locker keeps it alive until then. A failed registration leaves that memory pageable, is
    recorded in `reason`, and raises nothing: a copy from pageable memory is slower, not wrong.

    Make one with `page_locker()` (the process's own) or `PageLocker.find()`.
    """

    def __init__(self, api: _Runtime | _Driver | None, reason: str | None, library: str | None):
        self._api = api
        self._pid = os.getpid()
        # Re-entrant: a collection inside a locked section can run a finalizer that unregisters.
        self._lock = threading.RLock()
        self._registered: dict[int, int] = {}
        """Bytes registered at each address."""
        self._claimed: set[int] = set()
        """Addresses being registered now, or registered: each is registered once."""
        self._reason = reason
        self.library = library
        """The path of the CUDA library that page-locks, or None."""
        self.lock_s = 0.0
        """Seconds spent registering memory, failures included."""

    @classmethod
    def find(cls, maps_path: str = "/proc/self/maps") -> PageLocker:
        """A locker over the CUDA runtime (else driver) mapped in this process, if any."""
        if env.switched_off(env.PAGE_LOCK):
            return cls(None, f"page-locking was turned off with {env.setting(env.PAGE_LOCK)}", None)
        for pattern, api in ((RUNTIME_PATH, _Runtime), (DRIVER_PATH, _Driver)):
            path = loaded_library(pattern, maps_path)
            if path is None:
                continue
            try:
                return cls(api(open_loaded(path)), None, path)
            except (OSError, AttributeError, _Unavailable) as error:
                return cls(None, f"{path} cannot page-lock memory: {error}", path)
        return cls(
            None,
            "no CUDA runtime (libcudart) or driver (libcuda) is loaded in this process, and "
            "feedpipe never loads CUDA itself",
            None,
        )

    @property
    def available(self) -> bool:
        """True when memory can be registered (a registration may still fail)."""
        return self._api is not None

    @property
    def reason(self) -> str | None:
        """Why page-locking is unavailable, or why the latest call to CUDA failed; None while
        every call has succeeded."""
        return self._reason

    @property
    def locked_bytes(self) -> int:
        """Bytes registered now."""
        with self._lock:
            return sum(self._registered.values())

    def register(self, address: int, nbytes: int) -> bool:
        """Page-locks `nbytes` at `address`; False (memory stays pageable) if it cannot.

        The caller unregisters before the memory is freed; `lock` does that by itself.
        """
        if self._api is None:
            return False
        with self._lock:
            if address in self._claimed:
                raise ValueError(
                    f"Memory at {address:#x} is already page-locked by this locker; register "
                    "each buffer once, and unregister it before registering it again."
                )
            self._claimed.add(address)
        started = time.perf_counter()
        code = self._api.register(address, nbytes)
        elapsed = time.perf_counter() - started
        with self._lock:
            self.lock_s += elapsed
            if code:
                self._claimed.discard(address)
                self._reason = (
                    f"{self._api.call} returned {code} ({self._api.describe(code)}) for "
                    f"{_size(nbytes)}"
                )
                return False
            self._registered[address] = nbytes
        return True

    def unregister(self, address: int) -> bool:
        """Makes memory registered at `address` pageable again; False if this locker had not
        registered it, or if this is a forked child (the registration is the parent's)."""
        with self._lock:
            if self._registered.pop(address, None) is None:
                return False
            self._claimed.discard(address)
        if os.getpid() != self._pid:
            return False
        code = self._api.unregister(address)
        if code:
            with self._lock:
                self._reason = f"unregistering memory at {address:#x} returned {code}"
        return not code

    def lock(self, buffer: np.ndarray, owner: object) -> bool:
        """Page-locks the bytes of `buffer` for as long as `owner` lives; False if it cannot.

        `buffer` is kept alive until `owner` is collected and its memory unregistered, so the
        memory is never freed or unmapped while registered.
        """
        address = buffer.ctypes.data
        if not self.register(address, buffer.nbytes):
            return False
        weakref.finalize(owner, _release, self, address, buffer)
        return True

    def __repr__(self) -> str:
        state = f"library={self.library!r}" if self.available else f"reason={self._reason!r}"
        return f"PageLocker({state}, locked_bytes={self.locked_bytes})"


def _release(locker: PageLocker, address: int, buffer: object) -> None:
    """Unregisters the memory at `address`; `buffer`, the memory itself, rides along so that the
    finalizer holding these arguments keeps it from being freed until then."""
    locker.unregister(address)


_locker: PageLocker | None = None
_locker_lock = threading.Lock()


def page_locker() -> PageLocker:
    """This process's locker, found on first use.

    A locker that found no CUDA is not kept: a framework may load CUDA later (JAX does when its
    GPU backend first starts), so the next call looks again.
    """
    global _locker
    with _locker_lock:
        if _locker is None or _locker._pid != os.getpid():
            found = PageLocker.find()
            if found.available or found.library is not None or env.switched_off(env.PAGE_LOCK):
                _locker = found
            return found
        return _locker
