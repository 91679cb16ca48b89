"""Warm workers: worker processes kept between feeders, so that only the first pays their start.

A spawned interpreter takes 0.1 s or more to import numpy and feedpipe's core, and every notebook
re-run, second `fit` and evaluate-after-fit would pay it again. A feeder closed with its workers
healthy gives them back here instead of ending them; the next feeder in the process adopts them
and sends its own setup. A worker given back has let go of everything of its feeder (source,
transform, host slots, shared arrays, status row) and proved it (see
`feedpipe.core._worker.leftovers`); one that was killed, overdue, ended, or still holds any of it
is ended, never kept.

A worker is adopted only where it runs the code a new one would. A source or `transform`
defined in a script or notebook (`__main__`) travels whole, by value; one defined in a module
travels by reference, and a worker imports its module once and keeps it. So each worker says,
when it gives itself back, which modules it has imported beyond those it started with and the
state of their files when it read them (`feedpipe.core._worker.ImportedFiles`); it is adopted
only while every such file is unchanged (mtime and size), imports resolve as they did (the
same `sys.path`, made absolute), and this process has neither reloaded nor imported anew any
of those modules it held then. Otherwise it is ended, and a new worker starts.

Idle workers cost memory (an interpreter with numpy: about 40 MB resident, 20 MB of it its
own), so at most `FEEDPIPE_WARM_WORKERS` are kept (default: one per core this process may run
on; 0 turns warm workers off, and every worker then ends with its feeder), each for at most
`FEEDPIPE_WARM_IDLE_S` seconds (default 300), after which it ends by itself. They end with this
process as every worker does (see `feedpipe.core._worker`), SIGKILL included.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import NamedTuple

from feedpipe.core import _arrays, env
from feedpipe.core._sync import STOP_GRACE_S
from feedpipe.core._worker import file_state
from feedpipe.core.machine import cores

DEFAULT_IDLE_S = 300.0
"""Five minutes: a notebook cell run again, or `evaluate` after `fit`, comes well within it;
a process that has stopped feeding gives the memory back soon after."""
EXIT_MARGIN_S = 5.0
"""A worker ends this long after this process stops offering it, so that it is never adopted
while it ends."""


class Imported(NamedTuple):
    """A module a worker imported: its file and that file's state when read (see
    `file_state`), with what this process held of it then (its `__spec__`, which a reload or a
    new import replaces; None if it had not imported it) and where imports resolved."""

    file: str
    state: tuple[int, int] | None
    spec: object
    path: tuple[str, ...]


class Spawned(NamedTuple):
    """A worker process, this process's end of its socket, and the modules it has imported
    beyond those it started with, by name."""

    proc: subprocess.Popen
    conn: Connection
    imported: dict[str, Imported]


class Imports(NamedTuple):
    """This process's imports when it sends a feeder's setup, against which the modules its
    workers import meanwhile are checked later: each module's `__spec__`, and the import path."""

    specs: dict[str, object]
    path: tuple[str, ...]

    @classmethod
    def now(cls) -> Imports:
        """This process's imports now; none where no worker is kept (it costs milliseconds
        with a framework's thousands of modules loaded)."""
        if not capacity():
            return cls({}, ())
        modules = list(sys.modules.items())  # another thread may import meanwhile
        return cls({name: _spec(module) for name, module in modules}, _path())


def _spec(module: object) -> object:
    """A module's `__spec__`, read without running its code: a lazy module
    (`importlib.util.LazyLoader`) loads on any attribute asked of it."""
    try:
        return object.__getattribute__(module, "__dict__").get("__spec__")
    except AttributeError:  # not a module: something a package put in `sys.modules`
        return None


def _path() -> tuple[str, ...]:
    """Where imports resolve: `sys.path`, each entry absolute (a relative one depends on the
    working directory, which workers share) and each once."""
    return tuple(dict.fromkeys(os.path.abspath(entry) for entry in sys.path))


def runs_current_code(worker: Spawned) -> bool:
    """Whether `worker` would run the code that a new worker would: each module it imported
    is still the file it read, unchanged, found on the same import path, and this process
    has not reloaded or imported anew a module it held when the worker imported it."""
    path = _path()
    for name, imported in worker.imported.items():
        state = file_state(imported.file)
        if imported.path != path or state is None or state != imported.state:
            return False
        spec = _spec(sys.modules.get(name))
        if imported.spec is not None and spec is not imported.spec:
            return False
        if getattr(spec, "origin", None) not in (None, imported.file):
            return False
    return True


class _Idle(NamedTuple):
    worker: Spawned
    until: float  # monotonic seconds after which it is no longer offered


_lock = threading.Lock()
_idle: list[_Idle] = []


def capacity() -> int:
    """The idle workers kept at most: `FEEDPIPE_WARM_WORKERS`, else one per usable core."""
    kept = env.count(env.WARM_WORKERS)
    return cores() if kept is None else kept


def idle_s() -> float:
    """How long an idle worker is kept: `FEEDPIPE_WARM_IDLE_S` seconds, else 300."""
    return env.seconds(env.WARM_IDLE_S, DEFAULT_IDLE_S)


def warm_workers(count: int) -> list[int]:
    """Starts worker processes now, so that the feeders to come find `count` of them warm.

    Call it early (at the top of a script, before loading a model): the interpreters start
    while the rest runs, and the first feeder with `workers<=count` adopts them, paying no
    interpreter start. They are kept as workers given back are (`FEEDPIPE_WARM_WORKERS`,
    `FEEDPIPE_WARM_IDLE_S`); returns the pids of the idle workers.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"`count`={count!r} must be a number of processes >= 0.")
    room = capacity()
    wait_s = idle_s()
    with _lock:
        missing = min(count, room) - len(_idle)
    started = [spawn(f"feedpipe-worker-{i}", wait_s + EXIT_MARGIN_S) for i in range(missing)]
    until = time.monotonic() + wait_s
    with _lock:
        _idle.extend(_Idle(worker, until) for worker in started)
    return idle_pids()


def environment() -> dict[str, str]:
    """A worker's environment: this process's, with no GPU visible."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def spawn(name: str, wait_s: float | None = None) -> Spawned:
    """Starts one worker process (`python -m feedpipe.core._worker`), which waits for a setup.

    It sees no GPU, and it ends with this process: by the kernel where the thread starting it
    is the main thread (which lives exactly as long as the process), else by its own check.
    With `wait_s`, it ends by itself if no feeder adopts it within that many seconds.
    """
    kernel = "1" if threading.current_thread() is threading.main_thread() else "0"
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "feedpipe.core._worker",
                name,
                str(theirs.fileno()),
                str(os.getpid()),
                kernel,
                *([] if wait_s is None else [str(wait_s)]),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=environment(),
        )
    return Spawned(proc, Connection(ours.detach()), {})


def _usable(idle: _Idle, now: float) -> bool:
    return now < idle.until and idle.worker.proc.poll() is None and not idle.worker.conn.closed


def take(names: list[str]) -> list[Spawned]:
    """A worker for each of `names`: idle ones that run the current code first (the most
    recently given back), then new ones, all started before this returns (a new one may still
    be importing). Idle ones past their time, or whose code is stale, end."""
    _arrays.current()  # a kept copy past its time goes
    now = time.monotonic()
    with _lock:
        idle, _idle[:] = _idle[:], []
    usable = [one for one in idle if _usable(one, now) and runs_current_code(one.worker)]
    count = min(len(names), len(usable))
    adopted = [one.worker for one in reversed(usable[len(usable) - count :])]
    with _lock:  # another feeder may have given workers back meanwhile
        _idle[:0] = usable[: len(usable) - count]
    stop([one.worker for one in idle if one not in usable])
    return adopted + [spawn(name) for name in names[len(adopted) :]]


def give_back(workers: list[Spawned], healthy: list[bool], imports: Imports) -> list[int]:
    """Keeps the `healthy` workers that let go of their feeder, up to `capacity()`, and ends
    the rest; returns the pids kept.

    Each kept worker is asked to let go (it first finishes the task it is running) and must say
    it has, holding nothing of the feeder, within `STOP_GRACE_S`. The modules it imported
    since `imports` (this process's, when the feeder's setup was sent) are noted on it.
    """
    room = capacity()
    with _lock:
        room -= len(_idle)
    wait_s = idle_s()
    asked, kept = [], []
    try:
        for worker, ok in zip(workers, healthy, strict=True):
            if ok and len(asked) < room and worker.proc.poll() is None:
                with contextlib.suppress(OSError):
                    worker.conn.send(("release", wait_s + EXIT_MARGIN_S))
                    asked.append(worker)
        released = _released(asked, time.monotonic() + STOP_GRACE_S, imports)
        until = time.monotonic() + wait_s
        with _lock:  # another feeder may have given workers back meanwhile
            kept = released[: max(0, capacity() - len(_idle))]
            _idle.extend(_Idle(worker, until) for worker in kept)
    finally:  # even when interrupted (Ctrl-C): what is not kept ends
        # Those asked have had their grace: one still running is stuck in user code (one that
        # let go, beyond the room left, waits for a feeder and ends at once).
        stop([worker for worker in asked if worker not in kept], grace_s=0.0)
        stop([worker for worker in workers if worker not in asked])
    return [worker.proc.pid for worker in kept]


def _released(asked: list[Spawned], deadline: float, imports: Imports) -> list[Spawned]:
    """Those of `asked` that said, before `deadline`, that they hold nothing of their feeder,
    with the modules they imported since `imports` noted; replies to tasks still running come
    first and are dropped."""
    waiting = {worker.conn: worker for worker in asked}
    clean = []
    while waiting and (left := deadline - time.monotonic()) > 0:
        for conn in wait(list(waiting), left):
            try:
                kind, _, value, *files = conn.recv()
            except (EOFError, OSError):
                waiting.pop(conn)
                continue
            if kind == "released":
                worker = waiting.pop(conn)
                if not value:  # nothing left over
                    worker.imported.update(
                        (name, Imported(file, state, imports.specs.get(name), imports.path))
                        for name, (file, state) in files[0].items()
                    )
                    clean.append(worker)
    return clean


def stop(workers: list[Spawned], grace_s: float = STOP_GRACE_S) -> None:
    """Ends `workers`: their sockets close (a waiting worker exits), and what still runs after
    `grace_s` is killed."""
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.close()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


def idle_pids() -> list[int]:
    """The pids of the idle workers kept now."""
    now = time.monotonic()
    with _lock:
        return [idle.worker.proc.pid for idle in _idle if _usable(idle, now)]


def release() -> None:
    """Gives back now what closed feeders keep for the next one: ends the idle worker processes
    and drops the copy of a source's arrays kept for the workers (see docs/workers.md).

    Without it, idle workers end by themselves after `FEEDPIPE_WARM_IDLE_S` seconds, and the
    copy goes when its arrays are collected or a feeder finds it older than that; both go at
    exit. The next feeder then starts its workers anew.
    """
    _arrays.forget()
    with _lock:
        workers = [idle.worker for idle in _idle]
        _idle.clear()
    stop(workers)


atexit.register(release)
