"""Can one tf.data service dispatcher serve hundreds of hosts? Its CPU per row, the bytes of
the source's rows that reach the service's processes, and what the split size costs when one
worker is slow, with feedpipe's splits of 16 rows (before) and its splits sized from the job
(`ServiceWork.split_rows`: a job's rows over 64, 16 to 1024 rows).

One dispatcher and 4 workers, each a `python -m feedpipe service` process on 127.0.0.1, started
by this script, with a counting TCP proxy in front of each: the dispatcher's (which the workers
and this process dial) and each worker's (the address the worker gives the dispatcher, so that
the dispatcher's pushes of tasks and this process's reads of elements pass through it). Bytes
are counted as they pass; `/proc/PID/io` does not count a socket's `recvmsg`, which gRPC reads
with. The bytes the workers receive: from the dispatcher (answers to their heartbeats and
split requests) and into their own ports (the tasks the dispatcher pushes, each with its job's
graph, which holds the job's source rows; this process's small element requests). The bytes
the dispatcher receives: every request to it, chiefly the jobs' graphs this process registers.

The source: `--rows` rows (209,714: two jobs' worth, as each of a host's jobs is full but its
last) of 8 float32 features and an int64 label, 40 bytes a row;
the transform `features * 2 + 1` (TensorFlow ops, as light as a transform gets, so that the
service's own costs show). The jobs are the feeder's own (`ServiceWork.job`, as
`fp.Feeder(..., service=...)` asks them): an epoch is the plan's order
(`Sampler(rows, 256, shuffle=True, seed).order(epoch)`) in jobs of at most
`ServiceWork.rows_per_job` rows (`JOB_BYTES` of source rows, 4 MiB: 2 jobs here), one after
the other, each read until all its rows are in, as the feeder's reader does (no slots, so no
job is started ahead of the epoch being timed).

Per split size (`before`: `MAX_ROWS_PER_SPLIT` set to 16, as feedpipe had it; `after`: the
module's own), in rotating order: one epoch untimed (warm-up), then one timed and counted: each
row's tag (its place in the epoch) must come once, with the plan's sample (`exact`).
`dispatcher_cpu_us_per_row` (psutil CPU time of the dispatcher process / rows),
`worker_bytes_over_source` (bytes the 4 workers received / the arrays' bytes),
`dispatcher_bytes_over_source` (bytes the dispatcher received / the arrays' bytes), `epoch_s`.
A model says every job's graph reaches the dispatcher and every worker: (W + 1)x the source's
bytes, W = 4, and more, as the graph also holds each row's tag and seed (32 bytes a row).

Balance: one more timed epoch per split size with one of the 4 workers slowed (stopped by
SIGSTOP for `--slow-stopped` (0.8) of each 50 ms, SIGCONT for the rest): `slowed_epoch_s`, and
`slowed_over_even`, its ratio to the same split size's epoch without.

Targets: `after`'s dispatcher CPU <= 1 µs a row; `after`'s bytes to the workers <= 2x the
source's; `exact` = 1 for both. The rest is reported.

Run: `python -m kernels_bench.dispatcher [--quick] [--reps N] [--rows 209714]
[--slow-stopped 0.8] [--deadline-s 590]`; writes `kernels_bench/results/dispatcher.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kernels_bench import harness
from kernels_bench.harness.processes import Servers, deadline, free_loopback_port

WORKERS = 4
GLOBAL_BATCH = 256
FEATURES = 8
ROW_BYTES = FEATURES * 4 + 8
SPLITS = ("before", "after")
ROWS_PER_SPLIT_BEFORE = 16
"""feedpipe's split size before it was sized from the job: 16 rows, every job."""
SLOW_PERIOD_S = 0.05
"""The period of the slowed worker's SIGSTOP / SIGCONT cycle."""
CHUNK = 1 << 16
SETTLE_S = 1.0
"""Pause after each feeder, so that a job it left behind ends before the next is timed."""


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of `target_port` that counts the bytes each way: to
    the target (`sent`) and from it (`received`), over every connection."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sent = 0
        self.received = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="bench-proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the target does not serve yet: the caller dials again
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink, to_target in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump,
                    args=(source, sink, to_target),
                    name="bench-proxy-pump",
                    daemon=True,
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_target: bool) -> None:
        try:
            while data := source.recv(CHUNK):
                sink.sendall(data)
                with self._lock:
                    if to_target:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def counts(self) -> tuple[int, int]:
        """Bytes (to the target, from the target) so far."""
        with self._lock:
            return self.sent, self.received

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


@contextlib.contextmanager
def split_size(which: str) -> Iterator[None]:
    """feedpipe's splits as they were (`before`: 16 rows) or as they are (`after`)."""
    from feedpipe.service import client

    kept = client.MAX_ROWS_PER_SPLIT
    if which == "before":
        client.MAX_ROWS_PER_SPLIT = ROWS_PER_SPLIT_BEFORE
    try:
        yield
    finally:
        client.MAX_ROWS_PER_SPLIT = kept


@contextlib.contextmanager
def slowed(pid: int, stopped: float) -> Iterator[None]:
    """Process `pid` stopped for `stopped` of every `SLOW_PERIOD_S` meanwhile; always
    continued at the end."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(SLOW_PERIOD_S * stopped)
            os.kill(pid, signal.SIGCONT)
            done.wait(SLOW_PERIOD_S * (1 - stopped))

    thread = threading.Thread(target=cycle, name="bench-slow-worker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


def scaled(sample):
    features, label = sample
    return features * 2.0 + 1.0, label


def read_epoch(work, address: str, plan, epoch: int) -> bool:
    """Reads `epoch` of `plan` through the service in the feeder's jobs, one after the other,
    each until all its rows are in; whether each row came once, with its sample's label."""
    from feedpipe.service.client import JOB_SHIFT

    order = plan.order(epoch)
    seen = np.zeros(len(order), np.int64)
    right = True
    for start in range(0, len(order), work.rows_per_job):
        chunk = order[start : start + work.rows_per_job]
        owed = len(chunk)
        for tags, _, labels in work.job(address, chunk, epoch, 0):
            places = start + (tags.numpy() & ((1 << JOB_SHIFT) - 1))
            np.add.at(seen, places, 1)
            right &= bool(np.array_equal(labels.numpy(), order[places]))
            owed -= len(places)
            if owed <= 0:
                break
    return right and bool(np.all(seen == 1))


def run_split(
    arrays,
    address: str,
    seed: int,
    which: str,
    servers: Servers,
    proxies: dict[str, list[CountingProxy]],
    slow: tuple[int, float],
) -> dict:
    """Split size `which`: an epoch untimed, one timed and counted, one with a worker slowed."""
    import psutil

    from feedpipe.core.sampler import Sampler
    from feedpipe.core.sources import as_source
    from feedpipe.service.client import ServiceWork

    (dispatcher_pid,) = servers.pids("dispatcher")
    dispatcher = psutil.Process(dispatcher_pid)
    rows = len(arrays[0])
    plan = Sampler(rows, GLOBAL_BATCH, shuffle=True, seed=seed)

    def counts() -> tuple[float, int, int]:
        cpu = dispatcher.cpu_times()
        to_dispatcher, from_dispatcher = proxies["dispatcher"][0].counts()
        into_workers = sum(proxy.counts()[0] for proxy in proxies["workers"])
        return cpu.user + cpu.system, to_dispatcher, from_dispatcher + into_workers

    with split_size(which):
        work = ServiceWork(as_source(arrays), scaled, seed)
        read_epoch(work, address, plan, 0)
        time.sleep(SETTLE_S)
        before = counts()
        started = time.perf_counter()
        exact = read_epoch(work, address, plan, 1)
        epoch_s = time.perf_counter() - started
        after = counts()
        time.sleep(SETTLE_S)
        with slowed(*slow):
            started = time.perf_counter()
            slowed_exact = read_epoch(work, address, plan, 2)
            slowed_epoch_s = time.perf_counter() - started
        time.sleep(SETTLE_S)
    source = sum(array.nbytes for array in arrays)
    dispatcher_s, dispatcher_got, workers_got = (b - a for a, b in zip(before, after, strict=True))
    return {
        "dispatcher_cpu_us_per_row": 1e6 * dispatcher_s / rows,
        "worker_bytes_over_source": workers_got / source,
        "dispatcher_bytes_over_source": dispatcher_got / source,
        "worker_mb": workers_got / 1e6,
        "dispatcher_mb": dispatcher_got / 1e6,
        "epoch_s": epoch_s,
        "exact": float(exact),
        "slowed_epoch_s": slowed_epoch_s,
        "slowed_over_even": slowed_epoch_s / epoch_s,
        "slowed_exact": float(slowed_exact),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rows", type=int, default=None, help="rows of the source (two jobs' worth: 209714)"
    )
    parser.add_argument(
        "--slow-stopped",
        type=float,
        default=0.8,
        help="share of each 50 ms the slowed worker is stopped (0.8)",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=590.0, help="hard deadline of the run, seconds"
    )


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    if not 0 < args.slow_stopped < 1:
        raise SystemExit(f"--slow-stopped={args.slow_stopped} must be between 0 and 1.")
    report = harness.Report(
        "dispatcher",
        "tf.data service dispatcher CPU per row, bytes of source rows to the service's "
        "processes, and an epoch with one slow worker, at feedpipe's splits of 16 rows and at "
        "splits sized from the job, 1 dispatcher and 4 workers on loopback",
        settings,
        "kernels_bench.dispatcher",
    )
    from feedpipe.service.client import JOB_BYTES

    args.rows = args.rows or 2 * (JOB_BYTES // ROW_BYTES)
    rng = np.random.default_rng(settings.seed)
    arrays = (
        rng.standard_normal((args.rows, FEATURES), dtype=np.float32),
        np.arange(args.rows, dtype=np.int64),
    )
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="feedpipe-bench-dp-")))
        servers = Servers(root)
        stack.callback(servers.stop)
        stack.enter_context(deadline(args.deadline_s, servers))
        proxies = start_cluster(servers, stack)
        address = f"grpc://localhost:{proxies['dispatcher'][0].port}"
        harness.configure_tf(1)
        slow = (servers.pids("worker")[0], args.slow_stopped)
        rows = []
        for rep in range(settings.reps):
            row = {}
            for which in harness.rotate(SPLITS, rep):
                result = run_split(arrays, address, settings.seed, which, servers, proxies, slow)
                row |= {f"{which}_{key}": value for key, value in result.items()}
            row["after_over_before_dispatcher_cpu"] = (
                row["after_dispatcher_cpu_us_per_row"] / row["before_dispatcher_cpu_us_per_row"]
            )
            rows.append(row)
            print(
                f"  rep {rep + 1}/{settings.reps}: "
                + "  ".join(
                    f"{w}: {row[f'{w}_dispatcher_cpu_us_per_row']:.2f} µs/row, workers "
                    f"{row[f'{w}_worker_bytes_over_source']:.2f}x, epoch {row[f'{w}_epoch_s']:.2f}"
                    f" s, slowed {row[f'{w}_slowed_epoch_s']:.2f} s"
                    for w in SPLITS
                ),
                flush=True,
            )
        servers.stop()
    finish(report, args, arrays, rows)


def start_cluster(servers: Servers, stack: contextlib.ExitStack) -> dict[str, list[CountingProxy]]:
    """Starts the dispatcher and its `WORKERS` workers, each behind a counting proxy (closed
    with `stack`), and waits until they serve."""

    def proxy(port: int) -> CountingProxy:
        counting = CountingProxy(port)
        stack.callback(counting.close)
        return counting

    port = free_loopback_port()
    started = [servers.start("dispatcher", ["--port", str(port)])]
    dispatcher = proxy(port)
    workers = []
    for _ in range(WORKERS):
        workers.append(proxy(worker_port := free_loopback_port()))
        args = ["--dispatcher", f"localhost:{dispatcher.port}", "--port", str(worker_port)]
        started.append(
            servers.start("worker", [*args, "--worker-address", f"localhost:{workers[-1].port}"])
        )
    servers.wait_serving(started)
    return {"dispatcher": [dispatcher], "workers": workers}


def finish(report: harness.Report, args, arrays, rows: list[dict]) -> None:
    from feedpipe.core.sources import as_source
    from feedpipe.service import client

    case = "4 workers"
    units = {f"{w}_dispatcher_cpu_us_per_row": "CPU-µs per row" for w in SPLITS}
    units |= {f"{w}_{k}": "s" for w in SPLITS for k in ("epoch_s", "slowed_epoch_s")}
    units |= {f"{w}_{k}": "MB" for w in SPLITS for k in ("worker_mb", "dispatcher_mb")}
    work = client.ServiceWork(as_source(arrays), scaled, 0)
    jobs = [
        min(work.rows_per_job, args.rows - start)
        for start in range(0, args.rows, work.rows_per_job)
    ]
    report.add_case(
        case,
        {
            "rows": args.rows,
            "row_bytes": ROW_BYTES,
            "source_mb": sum(a.nbytes for a in arrays) / 1e6,
            "global_batch": GLOBAL_BATCH,
            "workers": WORKERS,
            "transform": "features * 2 + 1",
            "job_rows": jobs,
            "rows_per_split_before": ROWS_PER_SPLIT_BEFORE,
            "rows_per_split_after": [work.split_rows(n) for n in jobs],
            "slowed_worker": f"stopped {args.slow_stopped:g} of every {SLOW_PERIOD_S * 1e3:.0f} ms",
            "model_bytes_over_source": WORKERS + 1,
        },
        rows,
        units=units,
    )
    report.target(
        case,
        "after_dispatcher_cpu_us_per_row",
        "<=",
        1.0,
        "dispatcher CPU per row, splits sized from the job (µs)",
    )
    report.target(
        case,
        "after_worker_bytes_over_source",
        "<=",
        2.0,
        "bytes from the dispatcher to the 4 workers / the source's bytes",
    )
    for which in SPLITS:
        report.target(case, f"{which}_exact", ">=", 1.0, f"{which}: each row once, in order")
    report.note(
        "Bytes counted by TCP proxies in front of the dispatcher, one for the workers, one for "
        "the feeder; the feeder reads the workers' elements directly. A job's graph holds its "
        "rows of the source, and TensorFlow 2.21 sends it to every worker with each task "
        "(tensorflow/core/data/service/worker_impl.cc, GetDatasetDef: the TaskDef's dataset_def, "
        "or a path in the dispatcher's work_dir, read as a file, else from the dispatcher; no "
        "cache across tasks; dispatcher_impl.cc creates a task on every worker for each job). "
        "So the workers get W times the source's bytes an epoch, whatever the split size."
    )
    report.note(
        "On 2 shared cores the dispatcher, the 4 workers, the proxies and the feeder compete "
        "for the same CPUs: the epoch times are upper bounds; the dispatcher's CPU is its own."
    )
    report.finish()


if __name__ == "__main__":
    main()
