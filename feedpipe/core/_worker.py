"""What runs inside a worker: the tasks, and the main loop of a worker process.

A worker process is started as `python -m feedpipe.core._worker NAME FD PARENT PDEATHSIG
[WAIT_S]` (see `feedpipe.core.warm`): a fresh interpreter that imports only what the source and
`transform` need, never TensorFlow on feedpipe's account (and says so, once, if they pull it
in). It receives a feeder's setup and tasks over the socket `FD`, maps the host slots it is
sent, writes samples straight into them and replies with one message per task. An error of
its own, outside any task (loading its setup, mapping a slot), is sent as a reply to no task
before it stops.

When its feeder closes it may be asked to let go of the feeder instead of ending: it drops the
source, the slots and every shared mapping, checks that none of them is left (`leftovers`),
says so with the files of the modules it has imported meanwhile (`ImportedFiles`), and waits
for the next feeder's setup, ending by itself if none comes in time.

It ignores SIGINT: Ctrl-C reaches every process of the terminal's process group, and it is meant
for the training loop, not for the pool that feeds it. It exits when told to, when the socket
closes, or when its parent is gone: on Linux the kernel kills it (`PR_SET_PDEATHSIG`), even when
it is stopped or stuck in C code holding the GIL; a thread checks as well, for other systems.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.abc
import os
import pickle
import signal
import sys
import sysconfig
import threading
import time
import traceback
import types
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from pathlib import Path

import cloudpickle
import numpy as np

from feedpipe.core._shm import NAME_PATTERN, map_parts, map_shared
from feedpipe.core.slots import HostSlot, SlotLayout
from feedpipe.core.text import shown
from feedpipe.core.writer import RowStream, SampleWriter, first_look

FRAMEWORKS = ("tensorflow", "keras", "jax", "torch")
"""What a worker never loads on feedpipe's account, and is not reused after its source did."""
PARENT_CHECK_S = 0.25
"""How often a worker process checks that its parent is still alive (besides the kernel)."""
_PR_SET_PDEATHSIG = 1


class TaskRunner:
    """Runs one worker's tasks with its own copy of the source (a generator's: its shard).

    Until `configure` gives it the spec (and what worker 0 measured of the source), it can only
    look at its first sample (`("spec", id, policy)`: the spec, a digest, see `first_look`, and
    what it measured of the source, see `Source.measure`). Then:
    `("rows", id, slot, epoch, first_row, indices)` fills those rows of a slot, leaving out,
    under `errors="skip"`, the samples that raise (it returns the rows written and the skips,
    each error pickled with its traceback);
    `("stream", id, slot, epoch, generation)` fills a slot with the next rows of this worker's
    shard, restarting the shard for a new (generation, epoch); `("epoch_end", id, epoch)` tells
    the source an epoch ended. `run` returns the rows written (the spec, for "spec").
    """

    def __init__(
        self, source, transform, seed: int, status: np.ndarray | None, skips: bool = False
    ):
        self.source = source
        self.transform = transform
        self.seed = seed
        self.skips = skips
        self.status = status
        self.writer: SampleWriter | None = None
        self.layouts: dict[bool, SlotLayout] = {}
        self.slots: dict[int, HostSlot] = {}
        self._stream: tuple[tuple[int, int], RowStream] | None = None

    def configure(self, spec, axes, layouts: dict[bool, SlotLayout], measured) -> None:
        if measured is not None:
            self.source.learn(measured)
        self.writer = SampleWriter(
            self.source, spec, self.transform, self.seed, axes, skips=self.skips
        )
        self.writer.status = self.status
        self.layouts = layouts

    def add_slot(self, ident: int, contiguous: bool, buffer: np.ndarray) -> None:
        self.slots[ident] = HostSlot(self.layouts[contiguous], buffer=buffer, ident=ident)

    def forget(self, ident: int) -> None:
        self.slots.pop(ident, None)

    def run(self, task: tuple):
        kind = task[0]
        if kind == "spec":
            spec, digest = first_look(self.source, self.transform, self.seed, self.status, task[2])
            return spec, digest, self.source.measure()
        if kind == "rows":
            _, _, ident, epoch, first_row, indices = task
            skipped = self.writer.fill_rows(self.slots[ident], epoch, first_row, indices)
            return len(indices), [pack_skip(*skip) for skip in skipped]
        if kind == "stream":
            _, _, ident, epoch, generation = task
            slot = self.slots[ident]
            key = (generation, epoch)
            if self._stream is None or self._stream[0] != key:
                size = slot.layout.split.global_batch_size
                self._stream = (key, RowStream(self.writer, epoch, size))
            return self._stream[1].read_into(slot)
        if kind == "epoch_end":
            self.source.on_epoch_end()
            return 0
        raise ValueError(f"Unknown task {kind!r}.")


def pack_error(error: BaseException) -> bytes:
    """`error` pickled with cloudpickle, which carries classes defined in the user's script
    (`__main__`) back as the very class the consumer knows; one that does not survive the
    round trip goes as a RuntimeError that names its type and message and keeps its notes."""
    try:
        packed = cloudpickle.dumps(error)
        pickle.loads(packed)
    except Exception:
        kind = type(error)
        stand_in = RuntimeError(
            f"{kind.__module__}.{kind.__qualname__}: {shown(error)} (raised in a worker; it "
            "cannot be pickled, so it arrives as a RuntimeError)"
        )
        for note in getattr(error, "__notes__", []):
            stand_in.add_note(note)
        packed = pickle.dumps(stand_in)
    return packed


def code_at(filename: str, make, args: tuple):
    """The code object `make(*args)` with `co_filename` set to `filename`: how code sent by
    value arrives (see `feedpipe.core.pickling.dumps`), so a traceback here names the user's
    file and line, and `linecache` shows the line's text."""
    return make(*args).replace(co_filename=filename)


def pack_skip(row: int, index: int, error: BaseException) -> tuple:
    """A skipped row as a reply carries it: its error pickled, with its traceback as text."""
    return row, index, pack_error(error), "".join(traceback.format_exception(error))


def _library_paths() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


class TensorFlowWatch(importlib.abc.MetaPathFinder):
    """Notes where TensorFlow is first imported from, in a worker that should never need it:
    each worker would load it (hundreds of MB, seconds) and compete with training for the CPU."""

    def __init__(self):
        self.imported_from: str | None = None
        self.reported = False

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" and self.imported_from is None:
            self.imported_from = _importer()
        return None  # the import itself goes on as usual

    def news(self, worker: str) -> str | None:
        """A warning, once, if TensorFlow has been imported in this worker."""
        if self.reported or "tensorflow" not in sys.modules:
            return None
        self.reported = True
        return (
            f"{worker} imported TensorFlow (from {self.imported_from or 'an unknown place'}): "
            "every worker process now loads it, hundreds of MB and seconds each, and competes "
            "with training for the CPU. Keep TensorFlow and Keras out of `source` and "
            "`transform` (decode and augment with PIL or numpy; `keras.utils.load_img` is PIL "
            'underneath), or pass worker_mode="thread" to run them in the training process.'
        )


def file_state(path: str) -> tuple[int, int] | None:
    """What tells a module's file from an edited one: its mtime in ns and size (None where it
    cannot be read, a module in a zip file say: nothing then proves it unchanged)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


class ImportedFiles(importlib.abc.MetaPathFinder):
    """Notes the file of each module imported here, and its state just before it is read: what
    the process that adopts this worker compares with the file then, to tell that a new worker
    would run the same code (see `feedpipe.core.warm`). Installed when the worker starts, it
    notes only the modules imported beyond those it started with, found by the finders after
    it; a module with no file (built in, frozen, a namespace) has no code to go stale."""

    def __init__(self):
        self.files: dict[str, tuple[str, tuple[int, int] | None]] = {}

    def find_spec(self, name, path=None, target=None):
        finders = sys.meta_path
        for finder in finders[finders.index(self) + 1 :] if self in finders else []:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                if spec.has_location and spec.origin:
                    self.files[name] = (spec.origin, file_state(spec.origin))
                return spec
        return None

    def news(self) -> dict[str, tuple[str, tuple[int, int] | None]]:
        """The files of the modules imported since the last call (and imported still)."""
        news = {name: file for name, file in self.files.items() if name in sys.modules}
        self.files.clear()
        return news


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _passes_imports_along(filename: str) -> bool:
    """Frames of the import system, of unpickling and of this package only pass an import
    along (matched by their place, not by a name a checkout's path may hold)."""
    if filename.startswith(("<", _PACKAGE)):
        return True
    path = Path(filename)
    return bool({"importlib", "cloudpickle"} & set(path.parts)) or path.name in (
        "pickle.py",
        "runpy.py",
    )


def _importer() -> str:
    """Where the import now running comes from: the outermost package whose import led to it,
    and the first frame of user code (not a library) on the way, if any."""
    libraries = _library_paths()
    outermost = user = None
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _passes_imports_along(filename):
            outermost = frame.f_globals.get("__name__", "?").split(".")[0]
            if not filename.startswith(libraries):
                user = f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    if outermost is None:
        return "the import system"
    return outermost if user is None else f"{outermost}, reached from {user}"


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _die_with_parent(parent: int, kernel: bool) -> None:
    """Ends this process when `parent` ends: by the kernel's SIGKILL where it can (`kernel`:
    the parent thread that started us lives as long as the parent process), and by a thread."""
    if kernel and sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)
    threading.Thread(
        target=_watch_parent, args=(parent,), name="feedpipe-parent-watch", daemon=True
    ).start()


def _serve(conn: Connection, runner: TaskRunner, watch: TensorFlowWatch, name: str):
    """Answers tasks until the feeder closes the socket or asks the worker to stop (None), or
    asks it to let go of the feeder (the seconds to wait for the next one)."""
    try:
        while (ending := _answer(conn, runner, conn.recv())) is None:
            news = watch.news(name)
            if news is not None:
                conn.send(("warning", None, news))
        return ending or None
    except (EOFError, ConnectionError):  # the feeder is gone or closed: nothing is waiting
        return None


def _answer(conn: Connection, runner: TaskRunner, message: tuple) -> float | bool | None:
    """None to go on; False to stop; the seconds to wait for another feeder to let go."""
    kind = message[0]
    if kind == "stop":
        return False
    if kind == "release":
        return message[1]
    if kind == "slot":
        _, ident, nbytes, contiguous = message
        buffer = map_shared(recv_handle(conn), nbytes, what=f"host slot {ident}")
        runner.add_slot(ident, contiguous, buffer)
    elif kind == "forget":
        runner.forget(message[1])
    elif kind == "configure":
        runner.configure(*message[1:])
    else:
        try:
            reply = ("done", message[1], runner.run(message))
        except BaseException as error:
            reply = ("error", message[1], pack_error(error), traceback.format_exc())
        conn.send(reply)
    return None


def _load(conn: Connection, index: int, setup: tuple) -> TaskRunner:
    """Receives the rest of a feeder's setup (import path, working directory and environment
    as the feeder's process has them now, shared arrays, status row and the payload, announced
    by `setup`): a worker adopted by a later feeder sees what a new one would."""
    sys_path, cwd, environ, data_sizes, spans, status_nbytes = setup
    sys.path[:] = sys_path
    os.chdir(cwd)
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    data = None
    if data_sizes is not None:  # files of 0 bytes (arrays all empty) are still sent
        fds = [recv_handle(conn) for _ in data_sizes]
        data = map_parts(fds, data_sizes, what="the arrays")
    status = map_shared(recv_handle(conn), status_nbytes, what="the status rows")
    payload = conn.recv_bytes()
    buffers = [data[lo:hi] for lo, hi in spans] if data is not None else []
    setup = pickle.loads(payload, buffers=buffers)
    source = setup["source"]
    if setup["num_shards"] > 1:
        source = source.sharded(index, setup["num_shards"])
    row = status.view(np.float64)[3 * index : 3 * index + 3]
    return TaskRunner(source, setup["transform"], setup["seed"], row, setup["skips"])


_SHARED_KINDS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
"""What outlives a feeder by right: classes, modules and functions live in the process."""


def _watched(roots: list, depth: int = 3) -> list[weakref.ref]:
    """Weak references to `roots` and what they hold, `depth` levels down (a source wrapping
    the user's dataset, its attributes), which must all go with their feeder."""
    refs, seen, level = [], set(), [root for root in roots if root is not None]
    for _ in range(depth):
        following = []
        for thing in level:
            if id(thing) in seen or isinstance(thing, _SHARED_KINDS):
                continue
            seen.add(id(thing))
            with contextlib.suppress(TypeError):
                refs.append(weakref.ref(thing))
            following += gc.get_referents(thing)
        level = following
    return refs


def leftovers(watched: list[weakref.ref]) -> list[str]:
    """What this worker still holds of a feeder it let go of: objects of `watched` still alive,
    feedpipe shared memory still mapped, or a framework its source imported, which the next
    feeder must not pay for. Empty when it may serve another feeder."""
    gc.collect()
    held = [f"{type(ref()).__name__} object" for ref in watched if ref() is not None]
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            held += [
                line.split(maxsplit=5)[-1].strip() for line in maps if NAME_PATTERN.search(line)
            ]
    held += [f"{name} (imported)" for name in FRAMEWORKS if name in sys.modules]
    return held


def main(argv: list[str]) -> int:
    name, fd, parent, kernel = argv[1], int(argv[2]), int(argv[3]), argv[4] == "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent, kernel)
    watch, imported = TensorFlowWatch(), ImportedFiles()
    sys.meta_path[:0] = [watch, imported]
    conn = Connection(fd)
    # Started for a feeder, it waits for it; started ahead (`warm_workers`), for so long.
    wait_s = float(argv[5]) if len(argv) > 5 else None
    while True:
        try:
            if wait_s is not None and not conn.poll(wait_s):
                return 0  # idle for too long: the memory goes back
            _, name, index, *setup = conn.recv()
        except (EOFError, ConnectionError):
            return 0
        threading.current_thread().name = name
        doing = "while loading the source and transform"
        try:
            runner = _load(conn, index, setup)
            watched = _watched([runner.source, runner.transform])
            doing = "outside any task; it has stopped"
            wait_s = _serve(conn, runner, watch, name)
        except BaseException as error:
            error.add_note(f"feedpipe: raised in {name} (pid {os.getpid()}) {doing}.")
            with contextlib.suppress(OSError):  # a feeder already gone needs no reply
                conn.send(("error", None, pack_error(error), traceback.format_exc()))
            return 1
        if wait_s is None:
            return 0
        del runner
        held = leftovers(watched)
        try:
            conn.send(("released", None, held, imported.news()))
        except OSError:
            return 0
        if held:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
