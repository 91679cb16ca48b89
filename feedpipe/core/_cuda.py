"""The CUDA driver API through ctypes, on the `libcuda` this process already loaded.

feedpipe never loads CUDA and adds no dependency for it: a framework that runs on a GPU has
mapped the driver, and feedpipe finds it in `/proc/self/maps` and calls it in each device's
primary context, the one JAX, PyTorch and the runtime API share. Page-locking
(`feedpipe.core.pinned`) and the copy engine (`feedpipe.core.copy_engine`) both call it here,
where each function's signature is written once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Iterator

from feedpipe.core._sync import poll_then_sleep

RUNTIME_PATH = re.compile(r"/libcudart\.so(?:\.[0-9]+)*$")
DRIVER_PATH = re.compile(r"/libcuda\.so(?:\.[0-9]+)*$")

STREAM_NON_BLOCKING = 1
"""`CU_STREAM_NON_BLOCKING`: the stream never waits for the legacy default stream."""
EVENT_BLOCKING_SYNC = 1
"""`CU_EVENT_BLOCKING_SYNC`: a thread waiting for the event sleeps instead of spinning a core."""
EVENT_DISABLE_TIMING = 2
"""`CU_EVENT_DISABLE_TIMING`: the cheapest event, one that only orders work."""
OUT_OF_MEMORY = 2
"""`CUDA_ERROR_OUT_OF_MEMORY`."""
NOT_READY = 600
"""`CUDA_ERROR_NOT_READY`: what `cuEventQuery` returns while the work before the event runs."""

_P = ctypes.c_void_p
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
    "cuCtxPushCurrent_v2": [_P],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_P)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemHostRegister_v2": [_P, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [_P],
    "cuStreamCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuStreamDestroy_v2": [_P],
    "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemFree_v2": [ctypes.c_uint64],
    "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _P, ctypes.c_size_t, _P],
    "cuEventCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuEventRecord": [_P, _P],
    "cuEventSynchronize": [_P],
    "cuEventQuery": [_P],
    "cuEventDestroy_v2": [_P],
}
"""Each driver function feedpipe calls, with its arguments; every one returns a `CUresult`."""


def loaded_library(pattern: re.Pattern, maps_path: str = "/proc/self/maps") -> str | None:
    """The path of the first library mapped in this process whose path matches `pattern`."""
    try:
        with open(maps_path) as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and pattern.search(fields[5].strip()):
                    return fields[5].strip()
    except OSError:
        return None
    return None


def open_loaded(path: str) -> ctypes.CDLL:
    """A handle on the library at `path`, which must already be loaded: never loads it."""
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)


class CudaError(RuntimeError):
    """A driver call that failed: `code` is its `CUresult`."""

    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} returned {code} ({text})")
        self.call = call
        self.code = code


class Driver:
    """The driver API of one loaded `libcuda`, initialised, with each device's primary context
    retained for as long as the process lives (a release that dropped the last reference would
    destroy the context and everything made in it)."""

    def __init__(self, lib: ctypes.CDLL, path: str | None = None):
        self.path = path
        self._functions = {}
        for name, arguments in _SIGNATURES.items():
            function = getattr(lib, name, None)
            if function is not None:
                function.argtypes = arguments
                function.restype = ctypes.c_int
                self._functions[name] = function
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self.check("cuInit", 0)

    @classmethod
    def find(cls, maps_path: str = "/proc/self/maps") -> Driver:
        """The driver this process loaded; raises `CudaError` (code -1) when none is."""
        path = loaded_library(DRIVER_PATH, maps_path)
        if path is None:
            raise CudaError("finding libcuda", -1, "no CUDA driver is loaded in this process")
        try:
            return cls(open_loaded(path), path)
        except OSError as error:
            raise CudaError("opening libcuda", -1, str(error)) from error

    def call(self, name: str, *args) -> int:
        """Calls driver function `name`; returns its `CUresult` (0: success)."""
        function = self._functions.get(name)
        if function is None:
            raise CudaError(name, -1, f"the loaded driver ({self.path}) has no {name}")
        return function(*args)

    def check(self, name: str, *args) -> None:
        """Calls driver function `name`; raises `CudaError` unless it succeeded."""
        code = self.call(name, *args)
        if code:
            raise CudaError(name, code, self.describe(code))

    def describe(self, code: int) -> str:
        text = ctypes.c_char_p()
        if "cuGetErrorString" not in self._functions:
            return "no description"
        if self.call("cuGetErrorString", code, ctypes.byref(text)) or not text.value:
            return "no description"
        return text.value.decode(errors="replace")

    def context(self, ordinal: int) -> ctypes.c_void_p:
        """Device `ordinal`'s primary context, retained once."""
        with self._lock:
            if ordinal not in self._contexts:
                device, context = ctypes.c_int(), ctypes.c_void_p()
                self.check("cuDeviceGet", ctypes.byref(device), ordinal)
                self.check("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
                self._contexts[ordinal] = context
            return self._contexts[ordinal]

    @contextlib.contextmanager
    def current(self, ordinal: int) -> Iterator[None]:
        """Makes device `ordinal`'s primary context current in this thread for the block, and
        whatever was current before it again afterwards."""
        self.check("cuCtxPushCurrent_v2", self.context(ordinal))
        try:
            yield
        finally:
            self.call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))


class CudaDevice:
    """One GPU's side of the copy engine: a non-blocking stream of feedpipe's own, device memory
    from `cuMemAlloc`, and one event that says when the stream's copies are done.

    The stream is not the framework's: a copy issued on it starts at once, beside whatever step
    the framework's compute stream runs, instead of after it.
    """

    dlpack_type = 2
    """DLPack's `kDLCUDA`."""

    def __init__(self, driver: Driver, ordinal: int):
        self.driver = driver
        self.ordinal = ordinal
        self.stream = ctypes.c_void_p()
        self.event = ctypes.c_void_p()
        with driver.current(ordinal):
            driver.check("cuStreamCreate", ctypes.byref(self.stream), STREAM_NON_BLOCKING)
            driver.check(
                "cuEventCreate",
                ctypes.byref(self.event),
                EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING,
            )

    def allocate(self, nbytes: int) -> int:
        """The address of `nbytes` of fresh device memory; raises `CudaError` if none is left."""
        address = ctypes.c_uint64()
        with self.driver.current(self.ordinal):
            self.driver.check("cuMemAlloc_v2", ctypes.byref(address), nbytes)
        return address.value

    def free(self, address: int) -> None:
        with self.driver.current(self.ordinal):
            self.driver.check("cuMemFree_v2", address)

    def copy(self, pairs: list[tuple[int, int, int]]) -> None:
        """Issues each `(device_address, host_address, nbytes)` copy on the stream, then records
        the event behind them; returns at once."""
        driver, stream = self.driver, self.stream
        with driver.current(self.ordinal):
            for device_address, host_address, nbytes in pairs:
                driver.check("cuMemcpyHtoDAsync_v2", device_address, host_address, nbytes, stream)
            driver.check("cuEventRecord", self.event, stream)

    def wait(self, expected_s: float) -> None:
        """Returns once every copy issued so far is done: only this stream's work is waited
        for, never the framework's compute. Polls for up to `expected_s`, then sleeps on the
        event (`poll_then_sleep`)."""
        driver, event = self.driver, self.event
        with driver.current(self.ordinal):
            poll_then_sleep(
                lambda: self._query(event),
                lambda: driver.check("cuEventSynchronize", event),
                expected_s,
            )

    def _query(self, event: ctypes.c_void_p) -> bool:
        """Whether the work before `event` is done; raises where the query failed."""
        code = self.driver.call("cuEventQuery", event)
        if code and code != NOT_READY:
            raise CudaError("cuEventQuery", code, self.driver.describe(code))
        return not code

    def close(self) -> None:
        with self.driver.current(self.ordinal):
            self.driver.call("cuEventDestroy_v2", self.event)
            self.driver.call("cuStreamDestroy_v2", self.stream)
