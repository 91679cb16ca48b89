"""`feedpipe service`: TensorFlow's tf.data service servers, run as commands until a signal.

A dispatcher hands out the work of tf.data jobs; workers run that per-sample TensorFlow work on
their own CPUs and send the elements to the trainers. Both servers are TensorFlow's own
(`tf.data.experimental.service.DispatchServer` and `WorkerServer`): this module checks the
arguments, starts a server, writes one line saying what it serves at which address (flushed, so
a launcher can wait for it), serves until SIGTERM or SIGINT, then stops it and returns.

Three checks are made here because TensorFlow does not make them in a way a user could act on:

- a port in use: gRPC binds with `SO_REUSEPORT`, so a second dispatcher on a dispatcher's port
  starts without a word and the two share its connections;
- a dispatcher address that is not HOST:PORT, or nothing answering there (checked by
  connecting): TensorFlow's worker retries for an hour, holding the interpreter, so that not
  even a signal is handled meanwhile;
- `fault_tolerant` without `work_dir`.

Each raises `LaunchError`, whose message names the argument, the value and the fix.
TensorFlow is imported on the first start, not with this module.

TensorFlow's servers listen on every interface with no authentication, and TensorFlow offers
no way to bind one interface; so each server also says, on stderr as it starts, who can reach
it and the safe setup (`exposure`), as the command's help and docs/multi-host.md do.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

PROTOCOL = "grpc"
"""The one protocol TensorFlow's servers speak out of the box."""
PORT_PLACEHOLDER = "%port%"
"""In a worker address, stands for the port the worker binds (TensorFlow's own placeholder)."""
DISPATCHER_WAIT_S = 60.0
"""How long a worker waits for its dispatcher to answer: enough for a dispatcher launched at
the same time to start (a few seconds), short enough that a wrong address ends in an error."""
PROBE_INTERVAL_S = 0.25
"""Between two attempts to reach the dispatcher."""
SIGNAL_CHECK_S = 0.5
"""How often serving re-checks for a stop signal, should one land on a thread other than the
main one (Linux gives it to the main thread first)."""
FREE_PORT_TRIES = 5
"""Free ports picked for a worker asked for port 0, should another process take one first."""
EXPOSED = (
    "TensorFlow's servers listen on every interface with no authentication: whoever reaches "
    "the dispatcher can run TensorFlow ops on the workers, reading and writing their files"
)
"""Who can reach the service, as the command's help says it."""
SAFE_SETUP = (
    "keep the service on a private network, or behind a firewall that admits only the "
    "trainers and the workers (on one machine, loopback alone)"
)
"""Where the service is safe to run, as the help and each starting server say it."""
_REACH = {
    "dispatcher": "can run TensorFlow ops on the workers, reading and writing their files",
    "worker": "can read the elements it serves, and whoever reaches its dispatcher runs "
    "TensorFlow ops here, reading and writing files",
}


class _Server(Protocol):
    """What serving needs of TensorFlow's `DispatchServer` and `WorkerServer`."""

    def stop(self) -> None: ...


_ServerT = TypeVar("_ServerT", bound=_Server)

_ADDRESS = re.compile(r"^(?:grpc://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\S+)$")


class LaunchError(ValueError):
    """A server could not start for a reason the user can fix; the message names the argument."""


def serve_dispatcher(port: int, work_dir: str | None = None, fault_tolerant: bool = False) -> None:
    """Runs a tf.data service dispatcher on `port` (0: a free one) until SIGTERM or SIGINT.

    Args:
        port: the port to serve on, on every interface; 0 picks a free one.
        work_dir: where the dispatcher keeps its state (its journal with `fault_tolerant`).
        fault_tolerant: journal the state to `work_dir` so a restarted dispatcher recovers it.

    Raises:
        LaunchError: the port is in use or not a port, or `fault_tolerant` lacks `work_dir`.
    """
    _check_port(port, "--port")
    if fault_tolerant and not work_dir:
        raise LaunchError(
            "`--fault-tolerant` journals the dispatcher's state and needs a directory for it; "
            "add `--work-dir DIR` (the same DIR when the dispatcher is restarted)."
        )
    if port:
        _check_port_free(port, "--port", "another port, or stop what serves on it")
    import tensorflow as tf

    service = tf.data.experimental.service
    config = service.DispatcherConfig(
        port=port, protocol=PROTOCOL, work_dir=work_dir, fault_tolerant_mode=fault_tolerant
    )
    with _stop_signals() as stop:
        server = _start(functools.partial(service.DispatchServer, config), port, "--port")
        bound = int(server.target.rsplit(":", 1)[1])
        state = f"; state in {work_dir}" if work_dir else ""
        state += " (fault tolerant)" if fault_tolerant else ""
        _say(
            f"feedpipe service dispatcher: serving the tf.data service at "
            f"{PROTOCOL}://localhost:{bound} (from other machines "
            f"{PROTOCOL}://{socket.gethostname()}:{bound}){state}"
        )
        print(exposure("dispatcher", bound), file=sys.stderr, flush=True)
        _serve(server, stop)


def serve_worker(
    dispatcher: str,
    port: int = 0,
    worker_address: str | None = None,
    wait_s: float = DISPATCHER_WAIT_S,
) -> None:
    """Runs a tf.data service worker for `dispatcher` until SIGTERM or SIGINT.

    Args:
        dispatcher: the dispatcher's HOST:PORT (a leading `grpc://` is accepted).
        port: the port to serve on, on every interface; 0 picks a free one.
        worker_address: HOST:PORT at which trainers reach this worker, told them by the
            dispatcher; `%port%` stands for the bound port. By default this machine's name.
        wait_s: how long to wait for the dispatcher to answer before giving up.

    Raises:
        LaunchError: an address is not HOST:PORT, no dispatcher answers within `wait_s`, or
            the port is in use or not a port.
    """
    host, dispatcher_port = _parse_address(dispatcher, "--dispatcher", "localhost:5050")
    _check_port(port, "--port")
    if worker_address is None:
        worker_address = f"{socket.gethostname()}:{PORT_PLACEHOLDER}"
    worker_host, worker_port = _parse_address(
        worker_address, "--worker-address", f"myhost:{PORT_PLACEHOLDER}", PORT_PLACEHOLDER
    )
    if port:
        _check_port_free(port, "--port", "another port, or 0 for a free one")
    import tensorflow as tf

    service = tf.data.experimental.service
    with _stop_signals() as stop:
        if not _wait_for_dispatcher(host, dispatcher_port, wait_s, stop):
            if stop.is_set():
                return
            raise LaunchError(
                f"`--dispatcher`={dispatcher}: nothing answered there within {wait_s:g} s; "
                f"start the dispatcher first (`feedpipe service dispatcher --port "
                f"{dispatcher_port}` on {host}), or correct the host and port."
            )
        for attempt in range(1, FREE_PORT_TRIES + 1):
            bound = port or _free_port()
            config = service.WorkerConfig(
                dispatcher_address=f"{host}:{dispatcher_port}",
                worker_address=f"{worker_host}:{worker_port}",
                port=bound,
                protocol=PROTOCOL,
            )
            try:
                server = _start(functools.partial(service.WorkerServer, config), bound, "--port")
                break
            except LaunchError:
                if port or attempt == FREE_PORT_TRIES:
                    raise
        address = f"{worker_host}:{worker_port.replace(PORT_PLACEHOLDER, str(bound))}"
        _say(
            f"feedpipe service worker: serving tf.data service work at {address} "
            f"(port {bound}) for the dispatcher at {host}:{dispatcher_port}"
        )
        print(exposure("worker", bound), file=sys.stderr, flush=True)
        _serve(server, stop)


def exposure(server: str, port: int) -> str:
    """The line a starting `server` ("dispatcher" or "worker") writes on `port`: who can reach
    it, and the safe setup, since TensorFlow neither authenticates nor binds one interface."""
    return (
        f"feedpipe service {server}: warning: port {port} listens on every interface with no "
        f"authentication; whoever reaches it {_REACH[server]}; {SAFE_SETUP} "
        "(docs/multi-host.md)."
    )


def _parse_address(
    text: str, argument: str, example: str, port_placeholder: str | None = None
) -> tuple[str, str]:
    """`text`'s host and port; the port is a number, or `port_placeholder` inside it."""
    match = _ADDRESS.match(text)
    port = match["port"] if match else ""
    numeric = port.isdigit() and 0 < int(port) < 65536
    if not match or not (numeric or (port_placeholder is not None and port == port_placeholder)):
        allowed = f" or HOST:{port_placeholder}" if port_placeholder else ""
        raise LaunchError(
            f"`{argument}`={text!r} is not HOST:PORT{allowed} (PORT a number from 1 to "
            f"65535); give it as {example}."
        )
    return match["host"], port


def _check_port(port: int, argument: str) -> None:
    if not 0 <= port < 65536:
        raise LaunchError(
            f"`{argument}`={port} is not a port; use 1 to 65535, or 0 for a free one."
        )


def _check_port_free(port: int, argument: str, fix: str) -> None:
    """Raises `LaunchError` if something on this machine already serves on `port`.

    The probe binds without `SO_REUSEPORT`, so a gRPC server's socket counts as in use, and
    with `SO_REUSEADDR`, so connections of a server stopped a moment ago do not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as error:
            if error.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            reason = "in use" if error.errno == errno.EADDRINUSE else "not allowed"
            raise LaunchError(
                f"`{argument}`={port}: the port is {reason} here; use {fix}."
            ) from None


def _free_port() -> int:
    """A port free on every interface now (TensorFlow's worker tells its bound port only through
    a private attribute, so the port is chosen here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("0.0.0.0", 0))
        return probe.getsockname()[1]


def _wait_for_dispatcher(host: str, port: int, wait_s: float, stop: threading.Event) -> bool:
    """Whether `host:port` accepted a connection within `wait_s` (False at once on a stop)."""
    deadline = time.monotonic() + wait_s
    while not stop.is_set():
        try:
            socket.create_connection((host.strip("[]"), port), timeout=PROBE_INTERVAL_S).close()
            return True
        except OSError:
            pass
        if time.monotonic() >= deadline or stop.wait(PROBE_INTERVAL_S):
            return False
    return False


def _start(make: Callable[[], _ServerT], port: int, argument: str) -> _ServerT:
    """The server `make` starts; a bind that failed becomes `LaunchError`."""
    try:
        return make()
    except RuntimeError as error:
        if "Could not start gRPC server" not in str(error):
            raise
        raise LaunchError(
            f"`{argument}`={port}: TensorFlow could not bind the port ({error}); use another "
            f"port, or 0 for a free one."
        ) from None


@contextlib.contextmanager
def _stop_signals() -> Iterator[threading.Event]:
    """An event that SIGTERM and SIGINT set while the block runs, instead of ending the process."""
    stop = threading.Event()
    previous = {
        number: signal.signal(number, lambda *_: stop.set())
        for number in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _serve(server: _Server, stop: threading.Event) -> None:
    """Serves until `stop` is set, then stops `server`."""
    while not stop.wait(SIGNAL_CHECK_S):
        pass
    server.stop()


def _say(line: str) -> None:
    """Writes the line a launcher waits for, at once (stdout is a file or pipe there)."""
    print(line, flush=True)
