"""Workers: the pool that makes samples away from the feeder's thread, as processes or threads.

Worker processes (the default) run the source and `transform` in parallel, each with its own
interpreter and GIL, and write samples straight into host slots shared with them, so a batch
never travels through a pipe. They are spawned interpreters (`python -m feedpipe.core._worker`),
not forks of a process that runs TensorFlow, and they see no GPU; a feeder adopts the idle ones
an earlier feeder gave back (`feedpipe.core.warm`) and starts the rest. Their source and
`transform` are sent pickled with cloudpickle (`feedpipe.core.pickling`, which keeps their file
names for tracebacks), which carries functions and classes defined in `__main__` by value;
numpy arrays inside them go out of band into read-only shared files that every worker maps
(`feedpipe.core._arrays`), so N workers do not hold N copies of an array dataset. Even sample
0, which tells the feeder what a sample looks like, is read by a worker, and so are a
PyDataset's first and last batches, which tell its batch size and length: a source that
crashes, hangs or opens its files on first use does so there, not in the training process.

Worker threads (`worker_mode="thread"`) share the process and its GIL: they pay off only for
code that releases the GIL (numpy, Pillow decode) and cost no start-up or pickling.

Both kinds answer every task with one reply, and keep a status row `[sample, epoch, started]`
that `feedpipe._sync.Watchdog` reads: a worker with work outstanding that shows no progress
for `timeout_s` is named in a TimeoutError. A dead process is found at once (its socket
closes), and so is a dead thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import warnings
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import send_handle
from typing import Any, NamedTuple

import numpy as np

from feedpipe.core import warm
from feedpipe.core._shm import SharedBuffer, remove_orphans
from feedpipe.core._sync import WAIT_SLICE_S, Watchdog, join_within
from feedpipe.core._worker import TaskRunner
from feedpipe.core.pickling import check_picklable as check_picklable
from feedpipe.core.pickling import pack
from feedpipe.core.slots import HostSlot
from feedpipe.core.writer import Skip

SPEC_TASK = -1
"""The id of the one task sent before any other: measure the source, read its first sample and
return its spec."""


class WorkerError(RuntimeError):
    """A worker died: a process killed by a signal or exited, or a thread that ended, while the
    feeder needed it."""


class Reply(NamedTuple):
    """A worker's answer to one task: `done` with the rows written, or `error` with the error."""

    worker: int
    kind: str
    task: int
    value: Any


def _idle_status(status: np.ndarray) -> np.ndarray:
    status[:] = 0
    status[:, 0] = -1
    return status


def _rebuild(packed: bytes, text: str, name: str) -> BaseException:
    """A worker's error as the consumer gets it, with the worker's traceback as a note."""
    error = pickle.loads(packed)
    error.add_note(f"feedpipe: the traceback in {name}:\n{text.rstrip()}")
    return error


def unpack_skips(packed: list[tuple], name: str) -> list[Skip]:
    """The skips of a "rows" reply of worker `name`, their errors rebuilt (see `pack_skip`)."""
    return [Skip(row, index, _rebuild(error, text, name)) for row, index, error, text in packed]


class _Pool:
    """What both kinds of pool share: names, status rows, the watchdog and the spec request.

    A kind sends with `_send`, receives raw replies with `_receive` and names a worker that
    stopped answering with `_abandon`.
    """

    def __init__(self, count: int, status: np.ndarray, timeout_s: float | None, num_shards: int):
        self.count = count
        self.timeout_s = timeout_s
        self.num_shards = num_shards
        self.names = [f"feedpipe-worker-{i}" for i in range(count)]
        self.status = _idle_status(status)
        self.watchdog = Watchdog(self.status, self.names, timeout_s)
        self._warned = False

    @property
    def outstanding(self) -> list[int]:
        """Tasks sent to each worker and not yet answered."""
        return self.watchdog.outstanding

    @property
    def pids(self) -> list[int | None]:
        return [None] * self.count

    def submit(self, worker: int, task: tuple) -> None:
        self._send(worker, task)
        self.watchdog.sent(worker)

    def replies(self, timeout_s: float) -> list[Reply]:
        """Replies that arrived within `timeout_s`; raises if a worker died or is overdue."""
        replies = []
        for reply in self._receive(timeout_s):
            if reply.kind == "warning":
                if not self._warned:
                    self._warned = True
                    warnings.warn(reply.value, stacklevel=2)
                continue
            self.watchdog.answered(reply.worker)
            replies.append(reply)
        overdue = self.watchdog.overdue(self.pids)
        if overdue is not None:
            worker, error = overdue
            self._abandon(worker)
            raise error
        return replies

    def first_spec(self, policy: Any) -> tuple[Any, Any]:
        """The spec of the first sample, read (and transformed) by worker 0 under the error
        `policy` (see `first_look`), and what it measured of the source (`Source.measure`).

        With generator shards, worker 1 looks at its first sample too: a `fn` that yields the
        same first sample for shards 0 and 1 ignores its shard, and every worker would deliver
        every sample, which is said in a warning.
        """
        lookers = range(2 if self.num_shards > 1 else 1)
        for worker in lookers:
            self.submit(worker, ("spec", SPEC_TASK, policy))
        looks: dict[int, Reply] = {}
        while len(looks) < len(lookers):
            looks.update((reply.worker, reply) for reply in self.replies(WAIT_SLICE_S))
        if looks[0].kind == "error":
            raise looks[0].value
        spec, digest, measured = looks[0].value
        if len(looks) > 1 and looks[1].kind == "done" and looks[1].value[1] == digest:
            warnings.warn(
                f"fn(0, {self.num_shards}) and fn(1, {self.num_shards}) of fp.from_generator "
                "begin with the same sample: fn seems to ignore (shard, num_shards), so each "
                f"of the {self.num_shards} workers would deliver every sample. Yield only shard "
                "`shard` (e.g. itertools.islice(samples, shard, None, num_shards)).",
                stacklevel=3,
            )
        return spec, measured

    def configure(self, spec: Any, axes: list, layouts: dict, measured: Any) -> None:
        """Tells every worker what samples look like, how slots are laid out and what worker 0
        measured of the source."""
        for worker in range(self.count):
            self._send(worker, ("configure", spec, axes, layouts, measured))

    def _send(self, worker: int, message: tuple) -> None:
        raise NotImplementedError

    def _receive(self, timeout_s: float) -> list[Reply]:
        raise NotImplementedError

    def _abandon(self, worker: int) -> None:
        """Gives up on an overdue worker, which is stuck in user code."""


_opening = threading.local()


@contextlib.contextmanager
def watched(on_open: Any):
    """Calls `on_open(pool)` for each `ProcessWorkers` this thread starts meanwhile, as soon as
    its processes exist, before its setup is sent: whoever starts a pool in the background can
    then end it (`ProcessWorkers.end`) without waiting until it is ready."""
    _opening.watcher = on_open
    try:
        yield
    finally:
        _opening.watcher = None


class ProcessWorkers(_Pool):
    """`count` worker processes named `feedpipe-worker-<i>`, idle ones adopted (see
    `feedpipe.core.warm`) and the rest started at once.

    Invariant: each live worker holds one socket to this process and maps only the slots it
    was sent; `close()` (also run by `weakref.finalize`) leaves no process behind but those
    given back, healthy and holding nothing of this feeder, to the warm workers.
    """

    kind = "process"

    def __init__(self, count: int, setup: dict, timeout_s: float | None):
        remove_orphans()
        self._status_buffer = SharedBuffer(count * 3 * 8, "status")
        status = self._status_buffer.array.view(np.float64).reshape(count, 3)
        super().__init__(count, status, timeout_s, setup["num_shards"])
        # What the workers import from here on is checked against this when they are reused.
        self._imports = warm.Imports.now()
        # New interpreters start first: the arrays are copied while they import.
        self._spawned = warm.take(self.names)
        self.procs: list[subprocess.Popen] = [worker.proc for worker in self._spawned]
        self.conns: list[Connection] = [worker.conn for worker in self._spawned]
        self._failed: set[int] = set()
        self._known: list[set[int]] = [set() for _ in range(count)]
        # Closes every socket (a waiting worker exits), then kills what is still running.
        self._finalizer = weakref.finalize(self, warm.stop, self._spawned)
        if (on_open := getattr(_opening, "watcher", None)) is not None:
            on_open(self)
        payload, data = pack(setup)
        # None, not [] or 0 bytes, says no files follow: arrays may all be empty.
        data_sizes = None if data is None else data.sizes
        spans = [] if data is None else data.spans
        try:
            for worker, conn in enumerate(self.conns):
                try:
                    conn.send(
                        (
                            "adopt",
                            self.names[worker],
                            worker,
                            sys.path,
                            os.getcwd(),
                            warm.environment(),
                            data_sizes,
                            spans,
                            self._status_buffer.nbytes,
                        )
                    )
                    for fd in [] if data is None else data.fds:
                        send_handle(conn, fd, self.procs[worker].pid)
                    send_handle(conn, self._status_buffer.fd, self.procs[worker].pid)
                    conn.send_bytes(payload)
                except OSError:
                    raise self._death(worker) from None
        finally:
            for fd in [] if data is None else data.fds:
                os.close(fd)  # every worker has mapped it or will

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _death(self, worker: int) -> BaseException:
        """Why `worker` is gone: the error it sent before it stopped (a send to it may fail
        before that reply is read), else a WorkerError naming how it ended."""
        self._failed.add(worker)
        conn = self.conns[worker]
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                kind, task, value, *text = conn.recv()
                if kind == "error" and task is None:
                    return _rebuild(value, text[0], self.names[worker])
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
        """Makes `slot` writable by `worker` (before a task names it)."""
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
        """Tells every worker that these slots are gone."""
        for worker, known in enumerate(self._known):
            for ident in idents:
                if ident in known:
                    known.discard(ident)
                    self._send(worker, ("forget", ident))

    def _send(self, worker: int, message: tuple) -> None:
        try:
            self.conns[worker].send(message)
        except OSError:
            raise self._death(worker) from None

    def _receive(self, timeout_s: float) -> list[Reply]:
        replies = []
        for conn in wait(self.conns, timeout_s):
            worker = self.conns.index(conn)
            while True:
                try:
                    if not conn.poll():
                        break
                    kind, task, value, *text = conn.recv()
                except (EOFError, OSError):
                    raise self._death(worker) from None
                if kind == "error":
                    value = _rebuild(value, text[0], self.names[worker])
                    if task is None:  # the worker's own error, not a task's: it has stopped
                        self._failed.add(worker)
                        raise value
                replies.append(Reply(worker, kind, task, value))
        return replies

    def _abandon(self, worker: int) -> None:
        self._failed.add(worker)
        self.procs[worker].kill()  # it is stuck in user code: closing would wait for it

    def end(self) -> None:
        """Kills every worker now, for a pool given up while it starts (its setup, sample 0
        or its start may take seconds): none is given back; `close()` still follows."""
        self._failed.update(range(self.count))
        for proc in self.procs:
            proc.kill()

    def close(self) -> None:
        """Gives the healthy workers back to the warm workers (which may keep them) and ends
        the others; idempotent."""
        if self._finalizer.detach() is not None:
            healthy = [worker not in self._failed for worker in range(self.count)]
            warm.give_back(self._spawned, healthy, self._imports)
        # The shared status goes now, not when this object is collected (a dataset that
        # outlives its feeder may keep it): its last rows stay readable in a private copy.
        self.status = self.watchdog.status = self.status.copy()
        self._status_buffer.close()


class _Abandoned(BaseException):
    """Raised inside a worker thread stuck in user code, to end it where Python can."""


def _serve_thread(runner: TaskRunner, tasks: queue.SimpleQueue, replies, worker: int) -> None:
    try:
        while (task := tasks.get()) is not None:
            if task[0] == "configure":
                runner.configure(*task[1:])
                continue
            try:
                replies.put(Reply(worker, "done", task[1], runner.run(task)))
            except _Abandoned:
                return
            except BaseException as error:
                replies.put(Reply(worker, "error", task[1], error))
    except _Abandoned:
        return


def _interrupt(thread: threading.Thread) -> None:
    """Raises `_Abandoned` in `thread` at its next Python instruction (not inside a C call)."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned)
        )


def _stop_threads(
    threads: list[threading.Thread], tasks: list[queue.SimpleQueue], stuck: set
) -> None:
    for inbox in tasks:
        inbox.put(None)
    join_within(threads, skip=stuck)


class ThreadWorkers(_Pool):
    """`count` worker threads named `feedpipe-worker-<i>`, sharing this process's memory.

    A thread stuck past `timeout_s` is interrupted where Python can interrupt it (its next
    Python instruction) and not waited for; one stuck inside a C call ends with that call.
    """

    kind = "thread"

    def __init__(self, count: int, setup: dict, timeout_s: float | None):
        super().__init__(count, np.zeros((count, 3)), timeout_s, setup["num_shards"])
        self._slots: dict[int, HostSlot] = {}
        self._tasks = [queue.SimpleQueue() for _ in range(count)]
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stuck: set[threading.Thread] = set()
        for worker, name in enumerate(self.names):
            source = setup["source"]
            if setup["num_shards"] > 1:
                source = source.sharded(worker, setup["num_shards"])
            runner = TaskRunner(
                source, setup["transform"], setup["seed"], self.status[worker], setup["skips"]
            )
            runner.slots = self._slots
            thread = threading.Thread(
                target=_serve_thread,
                args=(runner, self._tasks[worker], self._replies, worker),
                name=name,
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._finalizer = weakref.finalize(
            self, _stop_threads, self._threads, self._tasks, self._stuck
        )

    def share(self, worker: int, slot: HostSlot) -> None:
        self._slots[slot.ident] = slot

    def forget(self, idents: list[int]) -> None:
        for ident in idents:
            self._slots.pop(ident, None)

    def _send(self, worker: int, message: tuple) -> None:
        self._tasks[worker].put(message)

    def _receive(self, timeout_s: float) -> list[Reply]:
        replies = []
        with contextlib.suppress(queue.Empty):
            replies.append(self._replies.get(timeout=timeout_s))
            while True:
                replies.append(self._replies.get_nowait())
        if not replies:
            for worker, thread in enumerate(self._threads):
                if not thread.is_alive() and self.outstanding[worker]:
                    raise WorkerError(
                        f"{thread.name} ended with {self.outstanding[worker]} task(s) "
                        "outstanding while the feeder needed it."
                    )
        return replies

    def _abandon(self, worker: int) -> None:
        thread = self._threads[worker]
        self._stuck.add(thread)
        _interrupt(thread)

    def close(self) -> None:
        self._finalizer()


def start_pool(mode: str, count: int, setup: dict, timeout_s: float | None) -> _Pool:
    """`count` workers of `mode` ("process" or "thread"), each started from `setup`."""
    kind = ProcessWorkers if mode == "process" else ThreadWorkers
    return kind(count, setup, timeout_s)
