"""What does a job of many hosts cost the parts of feedpipe that every host shares, as the host
count grows to 512? A few processes stand in for many hosts; each part is one function
(`PARTS`), run by `--parts`.

agreement: every host's feeder checked against host 0's when it is built
(`feedpipe.core.agreement.tally_through`), through a real `torch.distributed.TCPStore` whose
server runs in its own process, so that its CPU (the coordinator's) is read alone (from the
scheduler, `/proc/<pid>/task/*/schedstat`, to the nanosecond).
Two emulator processes each run H/2 hosts, a thread and a `TCPStore` client each, at H = 64,
256 and 512 (`--hosts`); every host sends the same fields (`FIELDS`, their bytes in the
params). Beside it, in the same run,
the check as it was before (`every_host_reads_every_other`, a copy kept here: each host sets its
fields and reads every other host's, each read a wait then a get). Per host count: the
coordinator's CPU seconds, the store operations of the agreement's protocol (set, get with a
deadline, add) summed over the hosts (`ops`, counted in a wrapper on each client) and the most
any host made (`max_round_trips`), the `TCPStore` requests those cost (`requests`: a read is a
wait and one more request: a `compare_set` now, a `get` before, which waits again first), and
the wall time from the hosts' start to the last host's answer. Every host starts at once (a
barrier in each emulator). Targets, at every H: `ops` <= 4 H and `max_round_trips` <= 3.

order: host 0's order at H = 64, 256, 512 and N = 1e6, 1e8, 1e9 samples, global batch 4096
(one replica a host: 64, 16 and 8 rows a host), shuffled (a full permutation at 1e6, the lazy
one above `LAZY_SHUFFLE_ABOVE`), as the feeder's producer reads it: the sampler made and the
first step of an epoch planned, and of a restore half-way through one, each timed and, apart,
its traced peak memory (`tracemalloc`, which sees numpy's buffers); then the steady µs a step
and a row the host makes, over `ORDER_STEPS_TIMED` steps. Targets at N = 1e9: the first batch
<= 20 ms and <= 16 MB. The order needs no word between hosts, so one process stands in for any.

state: a host's `get_state()` mid-epoch at each N: the position and the order's fields (a
`Stream`'s state), and with errors="skip" the whole default budget of skips spent (1 % of the
epoch; `kernels_bench.skip_state.skip_state_bytes`). Target: <= 1 MB.

JAX's coordination service is not emulated: each emulated host would need its own
`DistributedRuntimeClient`, and each registers with the service (`connect` waits for all H),
then keeps a heartbeat and an error-polling RPC open for its life, with its own gRPC channel
and threads: hundreds of those in two processes would measure the clients' upkeep as much as
the agreement. The agreement makes the same operations there (`key_value_set_bytes`,
`blocking_key_value_get_bytes` and `key_value_increment`, one RPC each), so its `ops` and
`max_round_trips` are those counted here.

Run: `env -u KERAS_BACKEND .venv-torch/bin/python -m kernels_bench.many_hosts [--quick]
[--hosts 64,256,512] [--parts agreement,order,state]`; writes
`kernels_bench/results/many_hosts.json`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kernels_bench import harness

FIELDS = {
    "remainder": "pad",
    "block_size": 1,
    "devices_per_host": 8,
    "dataset_length": 1_000_000_000,
    "global_batch_size": 4096,
    "num_replicas": 4096,
    "seed": 1234,
    "shuffle": True,
    "steps_per_epoch": 244141,
    "replicas_order": "contiguous",
}
"""A feeder's fields as every host sends them, for 1e9 samples."""
EMULATORS = 2
"""Processes that share the emulated hosts between them."""
WAIT_S = 120.0
"""The agreement's deadline in the emulators: far past any run here, so nothing hangs."""
ALGORITHMS = ("tally", "every_host_reads_every_other")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}"
    )
    parser.add_argument("--hosts", default="64,256,512", help="host counts emulated")


# ---- the store and its clients ------------------------------------------------------------


def serve_store(conn) -> None:
    """The coordinator: a `TCPStore` server alone in this process; sends its port, then
    serves until told to stop."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(server.port)
    conn.recv()


class CountedClient:
    """A `TCPStore` client that counts the requests it sends the server (`TCPStore.get`
    sends two: it waits for the key first)."""

    def __init__(self, port: int):
        import torch.distributed as dist

        self.client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=_delta(WAIT_S)
        )
        self.requests = 0

    def set(self, key: str, value: bytes) -> None:
        self.requests += 1
        self.client.set(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.requests += 1
        self.client.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        self.requests += 2
        return self.client.get(key)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.requests += 1
        return self.client.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        return self.client.add(key, amount)


class CountedOps:
    """The agreement's store (`feedpipe.torch.agreement`'s adapter over one client), counting
    the protocol's operations: each is one round trip of the host that makes it."""

    def __init__(self, store):
        self.store = store
        self.ops = collections.Counter()

    def set(self, key: str, value: bytes) -> None:
        self.ops["set"] += 1
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        self.ops["get"] += 1
        return self.store.get(key, timeout_s)

    def add(self, key: str, amount: int) -> int:
        self.ops["add"] += 1
        return self.store.add(key, amount)


class BeforeStore:
    """The torch adapter as it was before (a read: a wait, then `get`)."""

    def __init__(self, client: CountedClient):
        self.store = client

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        self.store.wait([key], _delta(timeout_s))
        return bytes(self.store.get(key))


def every_host_reads_every_other(
    store, host: int, hosts: list[int], payload: bytes, name: str, key: str
) -> list[bytes]:
    """The check as it was before (`exchange_through`): this host sets its payload, then reads
    every other host's, one blocking read at a time, under one deadline: O(H^2) reads at the
    store. `name` is unused, as in `tally_through`'s place it takes."""
    store.set(f"{key}/{host}", payload)
    deadline = time.monotonic() + WAIT_S
    return [store.get(f"{key}/{other}", max(0.001, deadline - time.monotonic())) for other in hosts]


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ---- the emulators -------------------------------------------------------------------------


def emulate(conn, port: int) -> None:
    """An emulator process: makes clients for the hosts it is given, then runs each agreement
    it is asked for, every host a thread, and answers with what each host counted."""
    os.environ["FEEDPIPE_AGREEMENT_TIMEOUT_S"] = str(WAIT_S)

    clients: dict[int, CountedClient] = {}
    while (order := conn.recv()) is not None:
        if order[0] == "clients":
            _, mine = order
            clients = {host: clients.get(host) or CountedClient(port) for host in mine}
            conn.send("ready")
            continue
        _, algorithm, key, count = order
        hosts = list(range(count))
        payload = json.dumps(FIELDS).encode()
        counted = {host: 0 for host in clients}
        before = {host: client.requests for host, client in clients.items()}
        errors: list[str] = []
        start = threading.Barrier(len(clients))

        cpu = time.process_time()
        threads = [
            threading.Thread(
                target=agree_as,
                args=(algorithm, clients[h], h, hosts, payload, key, start, counted, errors),
            )
            for h in clients
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        conn.send(
            {
                "ops": counted,
                "requests": {h: c.requests - before[h] for h, c in clients.items()},
                "errors": errors,
                "cpu_s": time.process_time() - cpu,
            }
        )


def agree_as(
    algorithm: str,
    client: CountedClient,
    host: int,
    hosts: list[int],
    payload: bytes,
    key: str,
    start: threading.Barrier,
    counted: dict[int, int],
    errors: list[str],
) -> None:
    """One emulated host's agreement by `algorithm`, started with the others; its operations
    go to `counted`, what it raised to `errors`."""
    from feedpipe.core.agreement import tally_through
    from feedpipe.torch.agreement import _ProcessGroupStore

    adapter = _ProcessGroupStore if algorithm == "tally" else BeforeStore
    store = CountedOps(adapter(client))
    check = tally_through if algorithm == "tally" else every_host_reads_every_other
    start.wait()
    try:
        check(store, host, hosts, payload, "rank", key)
    except Exception as error:  # reported to the parent, which fails the run
        errors.append(f"host {host}: {type(error).__name__}: {error}")
    counted[host] = sum(store.ops.values())


class Hosts:
    """The coordinator's process and the emulators, for one part's runs."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        server_end, self.server_conn = context.Pipe()
        self.server = context.Process(
            target=serve_store, args=(server_end,), name="feedpipe-bench-store", daemon=True
        )
        self.server.start()
        port = self.server_conn.recv()
        self.emulators = []
        for i in range(EMULATORS):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=emulate, args=(theirs, port), name=f"feedpipe-bench-hosts-{i}", daemon=True
            )
            process.start()
            self.emulators.append((process, mine))
        self.rounds = 0

    def coordinator_cpu_s(self) -> float:
        """CPU seconds the coordinator's threads have run, to the nanosecond (the scheduler's
        own account, `/proc/<pid>/task/*/schedstat`; psutil's counts 10 ms ticks, as long as
        an agreement of 64 hosts takes)."""
        total_ns = 0
        for task in Path(f"/proc/{self.server.pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                total_ns += int((task / "schedstat").read_text().split()[0])
        return total_ns / 1e9

    def use(self, count: int) -> None:
        """Gives each emulator its share of `count` hosts (a client each)."""
        for i, (_, conn) in enumerate(self.emulators):
            conn.send(("clients", list(range(i, count, EMULATORS))))
        for _, conn in self.emulators:
            if conn.recv() != "ready":
                raise RuntimeError("an emulator did not make its clients")

    def run(self, algorithm: str, count: int) -> dict:
        """One agreement of `count` hosts by `algorithm`: what it cost."""
        self.rounds += 1
        key = f"bench/{self.rounds}"
        cpu = self.coordinator_cpu_s()
        started = time.perf_counter()
        for _, conn in self.emulators:
            conn.send(("run", algorithm, key, count))
        answers = [conn.recv() for _, conn in self.emulators]
        wall_s = time.perf_counter() - started
        after = self.coordinator_cpu_s()
        errors = [e for a in answers for e in a["errors"]]
        if errors:
            raise RuntimeError(f"{len(errors)} hosts failed: {errors[:3]}")
        ops = [n for a in answers for n in a["ops"].values()]
        return {
            "coordinator_cpu_s": after - cpu,
            "ops": sum(ops),
            "max_round_trips": max(ops),
            "requests": sum(n for a in answers for n in a["requests"].values()),
            "wall_s": wall_s,
            "emulators_cpu_s": sum(a["cpu_s"] for a in answers),
        }

    def close(self) -> None:
        for process, conn in self.emulators:
            conn.send(None)
            process.join(10)
        self.server_conn.send(None)
        self.server.join(10)
        for process in [self.server, *(p for p, _ in self.emulators)]:
            if process.is_alive():
                process.kill()


# ---- the parts -----------------------------------------------------------------------------


def agreement(report: harness.Report, settings: harness.Settings) -> None:
    """The agreement's cost at each host count, the check as it was before beside it."""
    counts = [int(n) for n in settings.args.hosts.split(",")]
    hosts = Hosts()
    try:
        for count in counts:
            hosts.use(count)
            hosts.run("tally", count)  # warm-up: the clients' first requests
            reps = []
            for rep in range(settings.reps):
                measured = {}
                for algorithm in harness.rotate(ALGORITHMS, rep):
                    measured[algorithm] = hosts.run(algorithm, count)
                new, old = measured["tally"], measured["every_host_reads_every_other"]
                row = dict(new)
                row["ops_over_hosts"] = new["ops"] / count
                row.update({f"before_{name}": value for name, value in old.items()})
                row["before_over_now_coordinator_cpu"] = (
                    old["coordinator_cpu_s"] / new["coordinator_cpu_s"]
                )
                reps.append(row)
                print(
                    f"  {count} hosts, rep {rep}: coordinator {new['coordinator_cpu_s']:.3f} s "
                    f"(before {old['coordinator_cpu_s']:.3f} s), ops {new['ops']} "
                    f"(before {old['ops']}), wall {new['wall_s']:.3f} s "
                    f"(before {old['wall_s']:.3f} s)",
                    flush=True,
                )
            case = f"agreement, {count} hosts"
            report.add_case(
                case,
                {"hosts": count, "emulators": EMULATORS, "fields_bytes": len(json.dumps(FIELDS))},
                reps,
                units={
                    "coordinator_cpu_s": "s",
                    "before_coordinator_cpu_s": "s",
                    "wall_s": "s",
                    "before_wall_s": "s",
                },
            )
            report.target(case, "ops_over_hosts", "<=", 4, "store operations / hosts")
            report.target(case, "max_round_trips", "<=", 3, "round trips of a host")
    finally:
        hosts.close()


GLOBAL_BATCH = 4096
"""The global batch of the order and state parts: 8 rows a host at 512 hosts of one replica."""
LENGTHS = (10**6, 10**8, 10**9)
"""Samples an epoch of the order and state parts."""
TARGET_LENGTH = 10**9
"""The epoch length the order's targets are set at (<= 20 ms and <= 16 MB to a first batch)."""
ORDER_STEPS_TIMED = 200
"""Steps timed after an epoch's first, for the order's steady cost a step."""


def order_rep(length: int, hosts: int, seed: int) -> dict:
    """Host 0's order at `length` samples among `hosts` hosts: its first batch of an epoch and
    of a restore half-way through one (the sampler made, then the step planned: the time, then
    apart, since tracing slows each allocation, the traced peak memory), then its steady cost a
    step and a row it makes."""
    from feedpipe.core.sampler import Sampler
    from feedpipe.core.split import HostShare

    share = HostShare(GLOBAL_BATCH, hosts, 0, 1).rows

    def first_batch(start: int) -> Sampler:
        sampler = Sampler(length, GLOBAL_BATCH, shuffle=True, seed=seed, share=share)
        steps = sampler.steps(1, start)
        next(steps)
        steps.close()
        return sampler

    row: dict[str, float] = {}
    half = -(-length // GLOBAL_BATCH) // 2
    for name, start in (("epoch", 0), ("restore", half)):
        sampler, seconds, peak = harness.timed_then_traced(functools.partial(first_batch, start))
        row[f"first_{name}_ms"], row[f"first_{name}_mb"] = 1e3 * seconds, peak / 1e6
    steps = sampler.steps(2)
    next(steps)
    started = time.perf_counter()
    for _ in range(ORDER_STEPS_TIMED):
        next(steps)
    row["step_us"] = 1e6 * (time.perf_counter() - started) / ORDER_STEPS_TIMED
    row["us_per_own_row"] = row["step_us"] / len(share)
    return row


def order(report: harness.Report, settings: harness.Settings) -> None:
    """What the order costs one host, at each host count and epoch length."""
    counts = [int(n) for n in settings.args.hosts.split(",")]
    for length in LENGTHS:
        for count in counts:
            order_rep(length, count, settings.seed)  # warm-up: numpy's first calls
            reps = [order_rep(length, count, settings.seed + rep) for rep in range(settings.reps)]
            case = f"order, N={length:.0e}, {count} hosts"
            report.add_case(
                case,
                {"length": length, "hosts": count, "global_batch": GLOBAL_BATCH},
                reps,
                units={
                    "first_epoch_ms": "ms",
                    "first_epoch_mb": "MB",
                    "first_restore_ms": "ms",
                    "first_restore_mb": "MB",
                    "step_us": "µs",
                    "us_per_own_row": "µs",
                },
            )
            print(f"  {case}: {report.cases[-1]['metrics']['first_epoch_ms']['median']:.1f} ms")
            for name in ("epoch", "restore") if length == TARGET_LENGTH else ():
                label = f"first batch of {'an epoch' if name == 'epoch' else 'a restore'}"
                report.target(case, f"first_{name}_ms", "<=", 20, f"{label}, ms")
                report.target(case, f"first_{name}_mb", "<=", 16, f"{label}, MB")


def state(report: harness.Report, settings: harness.Settings) -> None:
    """A host's state mid-epoch at each epoch length: the position and the order's fields, and
    with errors="skip" the default budget of skips spent (`kernels_bench.skip_state`)."""
    from feedpipe.core.state import Position, Stream
    from kernels_bench.skip_state import skip_state_bytes

    for length in LENGTHS:
        steps = -(-length // GLOBAL_BATCH)
        stream = Stream(length, GLOBAL_BATCH, GLOBAL_BATCH, 1, settings.seed, True, steps)
        plain = len(json.dumps(stream.state(Position(3, steps // 2))))
        reps = []
        for _ in range(settings.reps):
            skips = skip_state_bytes(length)
            reps.append(
                {
                    "state_bytes": plain,
                    "with_skips_bytes": plain + skips["state_bytes"],
                    "skips": skips["budget"],
                    "skip_ledger_peak_bytes": skips["booking_peak_bytes"],
                }
            )
        case = f"state, N={length:.0e}"
        report.add_case(
            case,
            {"length": length, "global_batch": GLOBAL_BATCH, "max_skipped": 0.01},
            reps,
            units={"state_bytes": "B", "with_skips_bytes": "B", "skip_ledger_peak_bytes": "B"},
        )
        report.target(case, "with_skips_bytes", "<=", 1e6, "state with skips, bytes")


PARTS: dict[str, Callable[[harness.Report, harness.Settings], None]] = {
    "agreement": agreement,
    "order": order,
    "state": state,
}
"""Each part of a many-hosts job measured here, by name."""


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    parts = settings.args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts names {', '.join(unknown)}; choose from {', '.join(PARTS)}.")
    report = harness.Report(
        "many_hosts",
        "what the parts every host shares cost as hosts grow to 512 (emulated by a few "
        "processes against one coordinator): the agreement check's coordinator CPU, store "
        "operations and round trips, against the check as it was; a host's order (its first "
        "batch of an epoch or a restore, its steps) and its state, at N = 1e6, 1e8, 1e9",
        settings,
        "kernels_bench.many_hosts",
    )
    for part in parts:
        print(f"{part}:", flush=True)
        PARTS[part](report, settings)
    report.finish()


if __name__ == "__main__":
    main()
