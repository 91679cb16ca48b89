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


def check_picklable(name: str, value: Any) -> None:
    """Refuses, up front, a `source` or `transform` that cannot be sent to worker processes.

    Large buffers (numpy arrays) are left out of band, as `pack` sends them: checking a source
    holding 1 GB of arrays copies none of it."""
    try:
        dumps(value, protocol=5, buffer_callback=_out_of_band)
    except Exception as error:
        raise TypeError(
            f"`{name}` cannot be sent to worker processes: pickling it failed with "
            f"{type(error).__name__}: {shown(error)}. Build it from picklable parts (open "
            "files, locks and connections inside the worker, on first use), or pass "
            'worker_mode="thread" or workers=0.'
        ) from error


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
