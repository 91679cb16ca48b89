"""What runs inside a worker: the tasks, and the main loop of a worker process.

A worker process is started as `python -m feedpipe._worker NAME FD` (see `feedpipe.workers`):
a fresh interpreter that imports only what the source and `transform` need, never TensorFlow
on feedpipe's account. It receives its setup and tasks over the socket `FD`, maps the host
slots it is sent, writes samples straight into them and replies with one message per task.
It exits when told to, when the socket closes, or when its parent process is gone.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import numpy as np

from feedpipe._shm import map_shared
from feedpipe.slots import HostSlot, SlotLayout
from feedpipe.writer import RowStream, SampleWriter

PARENT_CHECK_S = 0.25
"""How often a worker process checks that its parent is still alive."""


class TaskRunner:
    """Runs one worker's tasks with its own copy of the writer (and of a generator's shard).

    Tasks are tuples: `("rows", id, slot, epoch, first_row, indices)` fills those rows of a
    slot; `("stream", id, slot, epoch, generation)` fills a slot with the next rows of this
    worker's shard, restarting the shard for a new (generation, epoch); `("epoch_end", epoch)`
    tells the source an epoch ended. `run` returns the rows written.
    """

    def __init__(self, writer: SampleWriter, layouts: dict[bool, SlotLayout]):
        self.writer = writer
        self.layouts = layouts
        self.slots: dict[int, HostSlot] = {}
        self._stream: tuple[tuple[int, int], RowStream] | None = None

    def add_slot(self, ident: int, contiguous: bool, buffer: np.ndarray) -> None:
        self.slots[ident] = HostSlot(self.layouts[contiguous], buffer=buffer, ident=ident)

    def forget(self, ident: int) -> None:
        self.slots.pop(ident, None)

    def run(self, task: tuple) -> int:
        kind = task[0]
        if kind == "rows":
            _, _, ident, epoch, first_row, indices = task
            self.writer.fill_rows(self.slots[ident], epoch, first_row, indices)
            return len(indices)
        if kind == "stream":
            _, _, ident, epoch, generation = task
            slot = self.slots[ident]
            key = (generation, epoch)
            if self._stream is None or self._stream[0] != key:
                size = slot.layout.split.global_batch_size
                self._stream = (key, RowStream(self.writer, epoch, size))
            return self._stream[1].read_into(slot)
        if kind == "epoch_end":
            on_epoch_end = getattr(self.writer.source, "on_epoch_end", None)
            if on_epoch_end is not None:
                on_epoch_end()
            return 0
        raise ValueError(f"Unknown task {kind!r}.")


def pack_error(error: BaseException) -> bytes:
    """`error` pickled; one that does not survive the round trip goes as a RuntimeError that
    names its type and message and keeps its notes."""
    try:
        packed = pickle.dumps(error)
        pickle.loads(packed)
    except Exception:
        kind = type(error)
        stand_in = RuntimeError(
            f"{kind.__module__}.{kind.__qualname__}: {error} (raised in a worker; it cannot be "
            "pickled, so it arrives as a RuntimeError)"
        )
        for note in getattr(error, "__notes__", []):
            stand_in.add_note(note)
        packed = pickle.dumps(stand_in)
    return packed


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _serve(conn: Connection, runner: TaskRunner) -> None:
    """Answers tasks until the feeder closes the socket (or asks the worker to stop)."""
    try:
        while _answer(conn, runner, conn.recv()):
            pass
    except (EOFError, OSError):  # the feeder is gone or closed: nothing is waiting for us
        return


def _answer(conn: Connection, runner: TaskRunner, message: tuple) -> bool:
    kind = message[0]
    if kind == "stop":
        return False
    if kind == "slot":
        _, ident, nbytes, contiguous = message
        runner.add_slot(ident, contiguous, map_shared(recv_handle(conn), nbytes))
    elif kind == "forget":
        runner.forget(message[1])
    else:
        try:
            reply = ("done", message[1], runner.run(message))
        except Exception as error:
            reply = ("error", message[1], pack_error(error), traceback.format_exc())
        conn.send(reply)
    return True


def _load(conn: Connection, index: int) -> TaskRunner:
    """Receives the setup: the import path, shared arrays, the status row and the payload."""
    sys_path, data_nbytes, spans, status_nbytes = conn.recv()
    sys.path[:] = sys_path
    data = map_shared(recv_handle(conn), data_nbytes, writable=False) if data_nbytes else None
    status = map_shared(recv_handle(conn), status_nbytes)
    payload = conn.recv_bytes()
    buffers = [data[lo:hi] for lo, hi in spans] if data is not None else []
    setup = pickle.loads(payload, buffers=buffers)
    writer = setup["writer"]
    if setup["num_shards"] > 1:
        writer.source = writer.source.sharded(index, setup["num_shards"])
    writer.status = status.view(np.float64)[3 * index : 3 * index + 3]
    return TaskRunner(writer, setup["layouts"])


def main(argv: list[str]) -> int:
    name, fd = argv[1], int(argv[2])
    index = int(name.rsplit("-", 1)[1])
    threading.current_thread().name = name
    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), name=f"{name}-watch", daemon=True
    ).start()
    conn = Connection(fd)
    try:
        runner = _load(conn, index)
    except Exception as error:
        error.add_note(f"feedpipe: raised in {name} while loading the source and transform.")
        conn.send(("error", None, pack_error(error), traceback.format_exc()))
        return 1
    _serve(conn, runner)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
