"""Workers: the pool that makes samples away from the feeder's thread, as processes or threads.

Worker processes (the default) run the source and `transform` in parallel, each with its own
interpreter and GIL, and write samples straight into host slots shared with them, so a batch
never travels through a pipe. They are fresh interpreters (`python -m feedpipe._worker`), not
forks of a process that runs TensorFlow, and they see no GPU. Their source and `transform` are
sent pickled with cloudpickle, which carries functions and classes defined in `__main__` by
value; numpy arrays inside them go out of band into one read-only shared buffer that every
worker maps, so N workers do not hold N copies of an array dataset.

Worker threads (`worker_mode="thread"`) share the process and its GIL: they pay off only for
code that releases the GIL (numpy, Pillow decode) and cost no start-up or pickling.

Both kinds answer every task with one reply and keep a status row `[sample, epoch, started]`,
so a hang is named; a dead process is found at once, because its socket closes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import send_handle
from typing import Any, NamedTuple, Protocol

import cloudpickle
import numpy as np

from feedpipe._shm import SharedBuffer, remove_orphans
from feedpipe._worker import TaskRunner
from feedpipe.slots import ALIGN_BYTES, HostSlot

STOP_GRACE_S = 1.0
"""How long `close()` lets worker processes finish their current task before killing them."""
JOIN_TIMEOUT_S = 5.0
"""How long `close()` waits for a worker thread stuck in user code."""


class WorkerError(RuntimeError):
    """A worker process died: killed by a signal, or exited, while the feeder needed it."""


class Reply(NamedTuple):
    """A worker's answer to one task: `done` with the rows written, or `error` with the error."""

    worker: int
    kind: str
    task: int
    value: Any


class Workers(Protocol):
    """A pool of `count` workers, each running its tasks in the order submitted."""

    count: int
    names: list[str]

    def share(self, worker: int, slot: HostSlot) -> None:
        """Makes `slot` writable by `worker` (before a task names it)."""

    def forget(self, idents: list[int]) -> None:
        """Tells every worker that these slots are gone."""

    def submit(self, worker: int, task: tuple) -> None: ...

    def replies(self, timeout_s: float) -> list[Reply]:
        """Replies that arrived within `timeout_s`; raises if a worker died or hangs."""

    def close(self) -> None: ...


def check_picklable(name: str, value: Any) -> None:
    """Refuses, up front, a `source` or `transform` that cannot be sent to worker processes."""
    try:
        cloudpickle.dumps(value)
    except Exception as error:
        raise TypeError(
            f"`{name}` cannot be sent to worker processes: pickling it failed with "
            f"{type(error).__name__}: {error}. Build it from picklable parts (open files, "
            f"locks and connections inside the worker, on first use), or pass "
            f'worker_mode="thread" or workers=0.'
        ) from error


def _pack(setup: dict) -> tuple[bytes, SharedBuffer | None, list[tuple[int, int]]]:
    """The setup pickled, with its large arrays moved out of band into one shared buffer."""
    buffers: list[pickle.PickleBuffer] = []
    payload = cloudpickle.dumps(setup, protocol=5, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    spans, offset = [], 0
    for raw in raws:
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        spans.append((offset, offset + raw.nbytes))
        offset += raw.nbytes
    if not raws:
        return payload, None, []
    data = SharedBuffer(offset, "data")
    for (lo, hi), raw in zip(spans, raws, strict=True):
        data.array[lo:hi] = np.frombuffer(raw, np.uint8)
    return payload, data, spans


def _status(count: int) -> np.ndarray:
    status = np.zeros((count, 3))
    status[:, 0] = -1
    return status


def _overdue(
    status: np.ndarray, names: list[str], timeout_s: float | None, pids: list[int | None]
) -> tuple[int, TimeoutError] | None:
    """The first worker that has spent over `timeout_s` on one sample, and its error."""
    if timeout_s is None:
        return None
    now = time.monotonic()
    for worker, (index, epoch, started) in enumerate(status.tolist()):
        if index >= 0 and now - started > timeout_s:
            pid = f" (pid {pids[worker]})" if pids[worker] is not None else ""
            return worker, TimeoutError(
                f"{names[worker]}{pid} has spent {now - started:.1f} s on sample {int(index)} "
                f"of epoch {int(epoch)}, more than `timeout_s`={timeout_s:g}; fix the hang in "
                "the source or `transform`, or raise `timeout_s`."
            )
    return None


def _rebuild(packed: bytes, text: str, name: str) -> BaseException:
    """A worker's error as the consumer gets it, with the worker's traceback as a note."""
    error = pickle.loads(packed)
    error.add_note(f"feedpipe: the traceback in {name}:\n{text.rstrip()}")
    return error


def _stop_processes(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Closes every socket (a waiting worker exits), then kills what is still running."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ProcessWorkers:
    """`count` worker processes named `feedpipe-worker-<i>`, started at once.

    Invariant: each live worker holds one socket to this process and maps only the slots it
    was sent; `close()` (also run by `weakref.finalize`) leaves no process behind.
    """

    kind = "process"

    def __init__(self, count: int, setup: dict, timeout_s: float | None):
        remove_orphans()
        self.count = count
        self.timeout_s = timeout_s
        self.names = [f"feedpipe-worker-{i}" for i in range(count)]
        payload, data, spans = _pack(setup)
        self._status_buffer = SharedBuffer(count * 3 * 8, "status")
        self.status = self._status_buffer.array.view(np.float64).reshape(count, 3)
        self.status[:] = _status(count)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._known: list[set[int]] = [set() for _ in range(count)]
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        for name in self.names:
            ours, theirs = socket.socketpair()
            with theirs:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "feedpipe._worker", name, str(theirs.fileno())],
                        pass_fds=[theirs.fileno()],
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                )
            self.conns.append(Connection(ours.detach()))
        for worker, conn in enumerate(self.conns):
            try:
                conn.send((sys.path, data.nbytes if data else 0, spans, self._status_buffer.nbytes))
                if data is not None:
                    send_handle(conn, data.fd, self.procs[worker].pid)
                send_handle(conn, self._status_buffer.fd, self.procs[worker].pid)
                conn.send_bytes(payload)
            except OSError:
                raise self._death(worker) from None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _death(self, worker: int) -> WorkerError:
        proc = self.procs[worker]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
        code = proc.returncode
        name = f"{self.names[worker]} (pid {proc.pid})"
        if code is None:
            how = "closed its connection but is still running"
        elif code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with code {code}"
        hint = (
            " SIGKILL often comes from the out-of-memory killer (see `dmesg`): use fewer "
            "workers or smaller batches."
            if code == -signal.SIGKILL
            else ""
        )
        return WorkerError(f"{name} {how} while the feeder needed it.{hint}")

    def share(self, worker: int, slot: HostSlot) -> None:
        if slot.ident in self._known[worker]:
            return
        conn = self.conns[worker]
        try:
            conn.send(("slot", slot.ident, slot.layout.nbytes, slot.layout.contiguous))
            send_handle(conn, slot.shared.fd, self.procs[worker].pid)
        except OSError:
            raise self._death(worker) from None
        self._known[worker].add(slot.ident)

    def forget(self, idents: list[int]) -> None:
        for worker, known in enumerate(self._known):
            for ident in idents:
                if ident in known:
                    known.discard(ident)
                    self.submit(worker, ("forget", ident))

    def submit(self, worker: int, task: tuple) -> None:
        try:
            self.conns[worker].send(task)
        except OSError:
            raise self._death(worker) from None

    def replies(self, timeout_s: float) -> list[Reply]:
        replies = []
        for conn in wait(self.conns, timeout_s):
            worker = self.conns.index(conn)
            try:
                while conn.poll():
                    kind, task, value, *text = conn.recv()
                    if kind == "error":
                        value = _rebuild(value, text[0], self.names[worker])
                        if task is None:  # the worker could not load its setup
                            raise value
                    replies.append(Reply(worker, kind, task, value))
            except (EOFError, OSError):
                raise self._death(worker) from None
        overdue = _overdue(self.status, self.names, self.timeout_s, self.pids)
        if overdue is not None:
            worker, error = overdue
            self.procs[worker].kill()  # it is stuck in user code: closing would wait for it
            raise error
        return replies

    def close(self) -> None:
        self._finalizer()
        # The shared status goes now, not when this object is collected (a dataset that
        # outlives its feeder may keep it): its last rows stay readable in a private copy.
        self.status = self.status.copy()
        self._status_buffer.close()


def _serve_thread(runner: TaskRunner, tasks: queue.SimpleQueue, replies, worker: int) -> None:
    while (task := tasks.get()) is not None:
        try:
            replies.put(Reply(worker, "done", task[1], runner.run(task)))
        except Exception as error:
            replies.put(Reply(worker, "error", task[1], error))


def _stop_threads(threads: list[threading.Thread], tasks: list[queue.SimpleQueue]) -> None:
    for inbox in tasks:
        inbox.put(None)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        warnings.warn(
            f"{', '.join(stuck)} did not stop within {JOIN_TIMEOUT_S:.0f} s (user code still "
            "running); daemon threads end with the process.",
            stacklevel=3,
        )


class ThreadWorkers:
    """`count` worker threads named `feedpipe-worker-<i>`, sharing this process's memory."""

    kind = "thread"

    def __init__(self, count: int, setup: dict, timeout_s: float | None):
        self.count = count
        self.timeout_s = timeout_s
        self.names = [f"feedpipe-worker-{i}" for i in range(count)]
        self.status = _status(count)
        self._slots: dict[int, HostSlot] = {}
        self._tasks = [queue.SimpleQueue() for _ in range(count)]
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = []
        for worker, name in enumerate(self.names):
            writer = copy.copy(setup["writer"])
            if setup["num_shards"] > 1:
                writer.source = writer.source.sharded(worker, setup["num_shards"])
            writer.status = self.status[worker]
            runner = TaskRunner(writer, setup["layouts"])
            runner.slots = self._slots
            thread = threading.Thread(
                target=_serve_thread,
                args=(runner, self._tasks[worker], self._replies, worker),
                name=name,
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop_threads, self._threads, self._tasks)

    def share(self, worker: int, slot: HostSlot) -> None:
        self._slots[slot.ident] = slot

    def forget(self, idents: list[int]) -> None:
        for ident in idents:
            self._slots.pop(ident, None)

    def submit(self, worker: int, task: tuple) -> None:
        self._tasks[worker].put(task)

    def replies(self, timeout_s: float) -> list[Reply]:
        replies = []
        with contextlib.suppress(queue.Empty):
            replies.append(self._replies.get(timeout=timeout_s))
            while True:
                replies.append(self._replies.get_nowait())
        overdue = _overdue(self.status, self.names, self.timeout_s, [None] * self.count)
        if overdue is not None:
            raise overdue[1]
        return replies

    def close(self) -> None:
        self._finalizer()
