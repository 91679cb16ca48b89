"""What a feeder sends to its worker processes, pickled: the source and `transform` with
cloudpickle, each code object keeping its file for tracebacks (`dumps`), refused up front where
they cannot be sent (`check_picklable`), their large arrays moved out of band into read-only
shared files that every worker maps (`pack`, `feedpipe.core._arrays`)."""

from __future__ import annotations

import collections
import io
import pickle
import types
from typing import Any, ClassVar

import cloudpickle

from feedpipe.core import warm
from feedpipe.core._arrays import Shared, share
from feedpipe.core._worker import code_at
from feedpipe.core.text import shown


def _reduce_code(code: types.CodeType) -> tuple:
    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    return code_at, (code.co_filename, make, args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, keeping the file of each code object it sends by value.

    cloudpickle sends functions and classes defined in `__main__` (a script, a notebook) by
    value, and since version 3 writes each code object's `co_filename` as "<dynamic-code>" so
    that its payload does not depend on where the code was defined; a worker's traceback would
    then show `File "<dynamic-code>"` where the user's own line is."""

    dispatch_table: ClassVar = collections.ChainMap(
        {types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table
    )


def dumps(value: Any, protocol: int | None = None, buffer_callback: Any = None) -> bytes:
    """`value` pickled as `cloudpickle.dumps` pickles it, each code object keeping its file."""
    with io.BytesIO() as file:
        _Pickler(file, protocol=protocol, buffer_callback=buffer_callback).dump(value)
        return file.getvalue()


WORKER_FIX = (
    "Build it from picklable parts (open files, locks and connections inside the worker, on "
    'first use), or pass worker_mode="thread" or workers=0.'
)
"""What to do about a source or `transform` that cannot reach worker processes."""


def check_picklable(
    name: str, value: Any, to: str = "worker processes", fix: str = WORKER_FIX
) -> None:
    """Refuses, up front, a `source` or `transform` that cannot be sent `to` where it runs,
    naming the part of it that fails (`source.lock`) where one does.

    Large buffers (numpy arrays) are left out of band, as `pack` sends them: checking a source
    holding 1 GB of arrays copies none of it."""
    try:
        _dumps_checked(value)
    except Exception as error:
        part = _failing_part(name, value)
        where = "" if part == name else f"its field `{part}` cannot be pickled, "
        raise TypeError(
            f"`{name}` cannot be sent to {to}: {where}pickling it failed with "
            f"{type(error).__name__}: {shown(error)}. {fix}"
        ) from error


def _dumps_checked(value: Any) -> None:
    dumps(value, protocol=5, buffer_callback=_out_of_band)


def _failing_part(path: str, value: Any, depth: int = 3) -> str:
    """The innermost attribute, item or entry of `value` (`path`) that fails to pickle, looked
    for `depth` levels down; `path` itself where none of its parts does."""
    if depth == 0:
        return path
    if isinstance(value, dict):
        parts = ((f"{path}[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        parts = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        fields = getattr(value, "__dict__", None)
        if not isinstance(fields, dict):
            return path
        parts = ((f"{path}.{key}", item) for key, item in fields.items())
    for part, item in parts:
        try:
            _dumps_checked(item)
        except Exception:
            return _failing_part(part, item, depth - 1)
    return path


def _out_of_band(buffer: pickle.PickleBuffer) -> bool:
    return False  # false: the buffer is left out of the pickle


def pack(setup: dict) -> tuple[bytes, Shared | None]:
    """The setup pickled, with its large arrays moved out of band into shared files, which
    every worker maps read-only: N workers, one copy (see `feedpipe.core._arrays`)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = dumps(setup, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return payload, None
    keep_s = warm.idle_s() if warm.capacity() else None
    return payload, share([buffer.raw() for buffer in buffers], keep_s)
