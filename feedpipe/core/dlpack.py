"""DLPack exports of memory feedpipe owns: how a framework takes a staged buffer without a copy.

An `Export` is what `jax.dlpack.from_dlpack` (or any DLPack consumer) takes: it hands over a
legacy `DLManagedTensor` in a capsule named "dltensor", built here with ctypes, so no library is
needed. The consumer wraps the memory where it is and calls the tensor's deleter once its own
buffer is destroyed; the deleter appends the export's token to the `released` list it was given,
and does nothing else. It takes no lock and touches no module global, because a framework calls
it from any thread, and may call it while the interpreter shuts down.

A consumer may call the deleter once the last computation reading the memory is *enqueued*,
before it has run: the owner of the memory must fence it before reusing it
(`feedpipe.core.copy_engine`).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

DEVICE_CPU = 1
"""DLPack's `kDLCPU`: host memory."""

_TYPE_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
"""DLPack's type code of each numpy dtype kind (kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool)."""
_BFLOAT = 4
"""DLPack's `kDLBfloat`."""


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class _ManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = (
    ("dl_tensor", _Tensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
)


def type_code(dtype: np.dtype) -> tuple[int, int] | None:
    """DLPack's (type code, bits) for `dtype`, or None where DLPack has no name for it."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return _BFLOAT, 16
    code = _TYPE_CODES.get(dtype.kind)
    if code is None or not dtype.isnative or dtype.fields is not None:
        return None
    if dtype.kind == "f" and dtype.name not in ("float16", "float32", "float64"):
        return None  # float8 and the like: kinds numpy reports as 'f' or 'V'
    return code, dtype.itemsize * 8


def _make_deleter(live: dict[int, tuple]) -> Any:
    pop = live.pop

    def deleter(managed: Any) -> None:
        token = managed.contents.manager_ctx
        released, _ = pop(token)
        released.append(token)

    return deleter


_live: dict[int, tuple] = {}
"""Each export handed over and not yet released: token -> (its `released` list, the ctypes
memory of the tensor, which must outlive the consumer's use of it)."""
_deleter = _DELETER(_make_deleter(_live))


def _make_capsule_destructor() -> Any:
    # The capsule is being destroyed, so it cannot travel as a Python object: its address does.
    is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
        ("PyCapsule_IsValid", ctypes.pythonapi)
    )
    pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi)
    )
    cast, managed_type = ctypes.cast, ctypes.POINTER(_ManagedTensor)

    def destroy(capsule: int) -> None:
        if is_valid(capsule, b"dltensor"):  # never consumed: the deleter is still owed
            managed = cast(pointer(capsule, b"dltensor"), managed_type)
            managed.contents.deleter(managed)

    return ctypes.CFUNCTYPE(None, ctypes.c_void_p)(destroy)


_capsule_destructor = _make_capsule_destructor()
# A consumer may free its last buffer as the interpreter shuts down, after module globals are
# gone: the two callbacks (and, through them, `_live`) are kept for as long as the process.
for _callback in (_deleter, _capsule_destructor):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_callback))
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_tokens = itertools.count(1)


class Export:
    """A C-contiguous array at `address` for a DLPack consumer. Each capsule it makes appends
    its token to `handed`; the consumer's release of it appends the same token to `released`
    (from any thread: both are `collections.deque`s, whose appends are atomic)."""

    __slots__ = ("_shape", "_template", "address", "device", "dtype", "handed", "released", "shape")

    def __init__(
        self,
        address: int,
        shape: Sequence[int],
        dtype: np.dtype,
        device: tuple[int, int],
        handed: collections.deque,
        released: collections.deque,
    ):
        if type_code(dtype) is None:
            raise TypeError(f"DLPack has no type for dtype {np.dtype(dtype)}.")
        self.address = address
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.handed = handed
        self.released = released
        # Every capsule describes the same tensor: its C struct is built once, copied per capsule.
        self._shape = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        template = _ManagedTensor()
        template.dl_tensor.data = address
        template.dl_tensor.device = _Device(*device)
        template.dl_tensor.ndim = len(self.shape)
        template.dl_tensor.dtype = _DataType(*type_code(self.dtype), 1)
        template.dl_tensor.shape = self._shape
        template.dl_tensor.strides = None  # C-contiguous
        template.dl_tensor.byte_offset = 0
        template.deleter = _deleter
        self._template = bytes(template)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        """A fresh capsule over the memory. The bytes are complete before an `Export` is made,
        so the consumer's `stream` has nothing to wait for."""
        managed = _ManagedTensor.from_buffer_copy(self._template)
        token = next(_tokens)
        managed.manager_ctx = token
        _live[token] = (self.released, (managed, self._shape))
        self.handed.append(token)
        return _new_capsule(ctypes.addressof(managed), b"dltensor", _capsule_destructor)

    def __repr__(self) -> str:
        return f"Export({self.address:#x}, shape={self.shape}, dtype={self.dtype})"


def exports_alive() -> int:
    """Exports handed to a consumer and not yet released, in this process."""
    return len(_live)
