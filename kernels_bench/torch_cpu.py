"""On the CPU, does `fp.Feeder` feed a PyTorch training loop from a GIL-holding Python source as
fast as `torch.utils.data.DataLoader` and torchdata's `StatefulDataLoader` with the same worker
processes, in the steady state and over the first epoch?

The source is `kernels_bench.gil_source.GilSource`: a map-style object whose `__getitem__(i)`
runs about `--sample-ms` of pure-Python integer arithmetic (the GIL held throughout, calibrated
once when it is built, the amount pickled with it) and returns `(x, y)`: float32 (32, 32, 3)
and an int64 label. Its module imports only numpy and the standard library, so feedpipe's
worker processes never import a framework. Global batch `--batch` (64), `--batches` (64) per
epoch, shuffled, `--workers` (2) worker processes for every peer:

* feedpipe: `fp.Feeder(source, B, devices=[torch.device("cpu")], workers=2, shuffle=True)`,
  each epoch one `for batch in feeder`, the step on `batch.distributed()[0]` (the slot's memory
  itself, `torch.from_numpy`); its workers are spawned interpreters, started when it is built,
  kept across epochs.
* dataloader: `torch.utils.data.DataLoader(source, batch_size=B, shuffle=True, num_workers=2,
  pin_memory=False, persistent_workers=True)` (default `prefetch_factor` 2, `default_collate`
  in the workers, batches passed back in shared memory; its workers are forked when the first
  iterator is made). `persistent_workers=True` is the strong peer for the steady state: with
  False (DataLoader's default) every epoch forks and feeds a new pool; its first epoch is the
  same. `--peers` adds it as `dataloader_fresh`.
* stateful: torchdata's `StatefulDataLoader` with the same arguments (`persistent_workers=True`).

Two cases: `train step`, where each batch goes through a small fixed torch step (an MLP
3072-256-10, cross-entropy, SGD, forward and backward, `torch` on `--torch-threads` (1) intra-op
threads so that the step does not spread over the cores the workers use), and `source only`,
where each batch is dropped as it arrives (the loaders' own rate and cost). Each of `--reps`
rounds builds a fresh loader of every peer and runs `--epochs` (4) epochs of each: first each
peer's loader is built and its first epoch run, one peer after another (timed together: the
first epoch, start-up included); then the later epochs are interleaved, one epoch of each peer
in turn, the order rotated every pass and every round, so that other work on the machine (on a
shared 2-core machine, an epoch of a second or so sees far less change in it than a whole
session does) weighs on every peer alike. Each epoch ends by asking for the next one's iterator,
as back-to-back epochs do, so each peer makes about 4 batches of its next epoch ahead (see
`PeerRun`).

Reported per peer: `<peer>_epoch1_s` (from building the loader to the end of its first epoch),
`<peer>_steady_samples_s` (the later epochs), and CPU per batch over the later epochs:
`<peer>_main_cpu_ms` (in this process: the loop's thread during the peer's epochs, steps
included, and feedpipe's own threads), `<peer>_workers_cpu_ms` (its worker processes) and
`<peer>_tree_cpu_ms` (both). Ratios within a round, then medians: `feedpipe_over_<peer>_steady`
(samples/s) and `feedpipe_over_<peer>_epoch1` (the peer's first-epoch time over feedpipe's),
above 1 where feedpipe is faster; `feedpipe_<where>_cpu_over_<peer>` (CPU per batch, feedpipe's
over the peer's, `<where>` main, workers or tree), below 1 where feedpipe spends less. Targets:
feedpipe / dataloader and feedpipe / stateful >= 1.0 in the steady state of `train step`; the
first epoch and `source only` are reported. `other_cores` is the CPU other processes on the
machine used during the round (above ~0.1 core the round did not measure the peers alone).
Where other work shares the cores, the CPU per batch changes little from round to round while
the rates do not; on a quiet machine whose cores the workers and the step fill, the rates
follow it.

Run: `python -m kernels_bench.torch_cpu [--quick]` (PyTorch installed, and torchdata for the
`stateful` peer, which is left out without it; no TensorFlow or JAX needed); writes
`kernels_bench/results/torch_cpu.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import sys
import threading
import time
import warnings

from kernels_bench import harness
from kernels_bench.gil_source import GilSource

PEERS = ("feedpipe", "dataloader", "stateful", "dataloader_fresh")
DEFAULT_PEERS = ("feedpipe", "dataloader", "stateful")
"""`dataloader_fresh` (DataLoader's default, a new pool every epoch) on request: its first
epoch is `dataloader`'s, and its steady state only adds a fork per epoch."""
CASES = {"train step": True, "source only": False}
"""Case name: whether each batch goes through the training step."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--batches", type=int, default=64, help="batches per epoch")
    parser.add_argument(
        "--epochs", type=int, default=4, help="epochs of each loader per round (>= 2)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes of each peer")
    parser.add_argument("--sample-ms", type=float, default=0.25, help="CPU per sample, ms")
    parser.add_argument("--hidden", type=int, default=256, help="the step's hidden units")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument(
        "--peers", default=",".join(DEFAULT_PEERS), help="any of " + ",".join(PEERS)
    )
    parser.add_argument("--cases", default=",".join(CASES), help="any of " + ",".join(CASES))


# ---- the step --------------------------------------------------------------------------------


class TrainStep:
    """One SGD step of a small MLP on `(x, y)`: forward, cross-entropy, backward, update."""

    def __init__(self, features: int, hidden: int, classes: int, seed: int):
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        self.model = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(features, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def __call__(self, x, y) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def time_alone_s(self, x, y, count: int = 50) -> float:
        """The step's own time on one batch already in memory (median of `count`)."""
        times = []
        for _ in range(count):
            started = time.perf_counter()
            self(x, y)
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]


# ---- the peers -------------------------------------------------------------------------------


def build(
    peer: str, source, batch: int, workers: int, seed: int, device=None, pin_memory: bool = False
):
    """The loader `peer` names over `source`, as a user builds it: feedpipe stages on `device`
    (the CPU by default), the DataLoaders leave their batches on the host, in pinned memory
    with `pin_memory`."""
    import torch

    if peer == "feedpipe":
        import feedpipe as fp

        device = torch.device("cpu") if device is None else device
        return fp.Feeder(source, batch, devices=[device], workers=workers, shuffle=True, seed=seed)
    kwargs = dict(
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=peer != "dataloader_fresh",
        generator=torch.Generator().manual_seed(seed),
    )
    if peer in ("dataloader", "dataloader_fresh"):
        return torch.utils.data.DataLoader(source, **kwargs)
    if peer == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return StatefulDataLoader(source, **kwargs)
    raise ValueError(peer)


def inputs(peer: str, item):
    """`(x, y)` of one batch as the step takes it."""
    if peer == "feedpipe":
        return item.distributed()[0]
    return item


def close(peer: str, loader) -> None:
    """Stops `loader`'s workers now, so that none runs on into the next round."""
    if peer == "feedpipe":
        loader.close()
        return
    # DataLoader keeps a persistent pool in its last iterator and stops it only when that
    # iterator is collected; stop it here instead.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


class WorkerClock:
    """CPU-seconds a loader's worker processes have used since it began (a worker that has
    ended counts what it had used when last read)."""

    def __init__(self, pids: set[int]):
        import psutil

        self.processes = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.processes.append(psutil.Process(pid))
        self.last = dict.fromkeys(pids, 0.0)
        self.start = self()

    def __call__(self) -> float:
        import psutil

        for process in self.processes:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                self.last[process.pid] = times.user + times.system
        return sum(self.last.values())

    def used_s(self) -> float:
        return self() - self.start


class ThreadClock:
    """CPU-seconds this process's threads named `prefix*` (feedpipe's) have used since it
    began (a thread that has ended counts what it had used when last read)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.last: dict[int, float] = {}
        self.start = self()

    def __call__(self) -> float:
        for thread in threading.enumerate():
            if thread.name.startswith(self.prefix) and thread.ident is not None:
                with contextlib.suppress(OSError):  # ended meanwhile
                    self.last[thread.ident] = harness.cpu_clock(thread.ident)()
        return sum(self.last.values())

    def used_s(self) -> float:
        return self() - self.start


class PeerRun:
    """One peer's loader through a round: its first epoch, then its later epochs one at a time,
    interleaved with the other peers' (see `run_round`).

    Each epoch ends by asking for the next epoch's iterator, as a loop running epochs back to
    back does: a DataLoader with persistent workers then hands its workers the next epoch's
    first `prefetch_factor` batches each, while feedpipe's pipeline, which runs on across an
    epoch's end, fills its `depth` and its slots in flight. Either makes about 4 batches of its
    next epoch while the other peers' epochs are timed, and starts its own with them.
    """

    def __init__(self, peer: str, source, args, step: TrainStep | None, batches: int):
        self.peer = peer
        self.source = source
        self.args = args
        self.step = step
        self.batches = batches
        self.seen: list[int] = []
        self.epoch1_s = 0.0
        self.steady_s = 0.0
        self.main_cpu_s = 0.0
        self.workers: WorkerClock | None = None
        self.threads: ThreadClock | None = None
        self.loader = self.iterator = None

    def first_epoch(self) -> None:
        """Builds the loader and runs its first epoch, both timed; finds its worker processes
        (a DataLoader without persistent workers has new ones every epoch: not followed)."""
        before = child_pids()
        started = time.perf_counter()
        self.loader = build(
            self.peer, self.source, self.args.batch, self.args.workers, self.args.seed
        )
        self.iterator = iter(self.loader)
        self._epoch()
        self.epoch1_s = time.perf_counter() - started
        if self.peer != "dataloader_fresh":
            self.workers = WorkerClock(child_pids() - before)
        if self.peer == "feedpipe":  # its producer thread works beside the loop
            self.threads = ThreadClock("feedpipe")

    def epoch(self) -> None:
        """One later epoch, timed, and the CPU of the loop's thread during it."""
        cpu, started = time.thread_time(), time.perf_counter()
        self._epoch()
        self.steady_s += time.perf_counter() - started
        self.main_cpu_s += time.thread_time() - cpu

    def _epoch(self) -> None:
        count = 0
        for item in self.iterator:
            if self.step is not None:
                self.step(*inputs(self.peer, item))
            del item
            count += 1
        self.seen.append(count)
        self.iterator = iter(self.loader)

    def figures(self) -> dict:
        epochs = len(self.seen)
        if self.seen != [self.batches] * epochs:
            raise RuntimeError(
                f"{self.peer}: expected {epochs} epochs of {self.batches} batches, saw {self.seen}"
            )
        steady = self.batches * (epochs - 1)
        workers_ms = None if self.workers is None else self.workers.used_s() / steady * 1e3
        threads_s = 0.0 if self.threads is None else self.threads.used_s()
        main_ms = (self.main_cpu_s + threads_s) / steady * 1e3
        return {
            f"{self.peer}_epoch1_s": self.epoch1_s,
            f"{self.peer}_steady_samples_s": steady * self.args.batch / self.steady_s,
            f"{self.peer}_main_cpu_ms": main_ms,
            f"{self.peer}_workers_cpu_ms": workers_ms,
            f"{self.peer}_tree_cpu_ms": None if workers_ms is None else main_ms + workers_ms,
        }

    def stop(self) -> None:
        """Stops the loader's workers now."""
        self.iterator = None
        if self.loader is not None:
            close(self.peer, self.loader)
            self.loader = None
        gc.collect()


def run_round(peers: list[str], rep: int, source, args, step, epochs: int, batches: int) -> dict:
    """One round: each peer's loader built and its first epoch run, one peer after another; then
    the later epochs interleaved, one epoch of each peer in turn, the order rotated every pass
    and every round, so that other work on the machine weighs on every peer alike."""
    runs = {peer: PeerRun(peer, source, args, step, batches) for peer in peers}
    values: dict = {}
    try:
        for peer in harness.rotate(peers, rep):
            runs[peer].first_epoch()
        for n in range(epochs - 1):
            for peer in harness.rotate(peers, rep + n + 1):
                runs[peer].epoch()
        for run in runs.values():
            values.update(run.figures())
    finally:
        for run in runs.values():
            run.stop()
    return values


def ratios(values: dict, peers: list[str]) -> None:
    if "feedpipe" not in peers:
        return
    for peer in peers:
        if peer == "feedpipe":
            continue
        values[f"feedpipe_over_{peer}_steady"] = (
            values["feedpipe_steady_samples_s"] / values[f"{peer}_steady_samples_s"]
        )
        values[f"feedpipe_over_{peer}_epoch1"] = (
            values[f"{peer}_epoch1_s"] / values["feedpipe_epoch1_s"]
        )
        for where in ("main", "workers", "tree"):
            ours, theirs = values[f"feedpipe_{where}_cpu_ms"], values[f"{peer}_{where}_cpu_ms"]
            if ours is not None and theirs is not None:
                values[f"feedpipe_{where}_cpu_over_{peer}"] = ours / theirs


def peer_calls(args) -> dict:
    loader_args = (
        f"batch_size={args.batch}, shuffle=True, num_workers={args.workers}, pin_memory=False"
    )
    return {
        "feedpipe": (
            f"fp.Feeder(source, {args.batch}, devices=[torch.device('cpu')], "
            f"workers={args.workers}, shuffle=True)"
        ),
        "dataloader": (
            f"torch.utils.data.DataLoader(source, {loader_args}, persistent_workers=True)"
        ),
        "stateful": (
            f"torchdata.stateful_dataloader.StatefulDataLoader(source, {loader_args}, "
            "persistent_workers=True)"
        ),
        "dataloader_fresh": (
            f"torch.utils.data.DataLoader(source, {loader_args}, persistent_workers=False)"
        ),
    }


# ---- the command -------------------------------------------------------------------------------


def have_torchdata() -> bool:
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except (ImportError, AttributeError):  # absent, or built against another torch
        return False
    return True


def names(text: str, known, option: str) -> list[str]:
    named = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(named) - set(known))
    if unknown or not named:
        raise SystemExit(f"{option}={text}: unknown {unknown}; use any of {','.join(known)}.")
    return [n for n in known if n in named]


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    if args.epochs < 2:
        raise SystemExit(f"--epochs={args.epochs}: the steady state is the epochs after the first.")
    peers = names(args.peers, PEERS, "--peers")
    if "stateful" in peers and not have_torchdata():
        peers.remove("stateful")
        print("torchdata is not installed: the StatefulDataLoader peer is left out", flush=True)
    cases = names(args.cases, CASES, "--cases")
    batches = settings.pick(max(8, args.batches // 2), args.batches)
    epochs = settings.pick(max(2, args.epochs - 1), args.epochs)

    import torch

    torch.set_num_threads(args.torch_threads)
    source = GilSource(batches * args.batch, args.sample_ms / 1e3)
    step = TrainStep(3 * 32 * 32, args.hidden, 10, args.seed)
    x = torch.from_numpy(source[0][0]).expand(args.batch, -1, -1, -1).contiguous()
    y = torch.zeros(args.batch, dtype=torch.int64)
    step_s = step.time_alone_s(x, y)
    source_batch_s = source.calibrated_s * args.batch
    print(
        f"source {source_batch_s * 1e3:.1f} ms of CPU per batch of {args.batch}, "
        f"{args.workers} workers; step alone {step_s * 1e3:.2f} ms; {batches} batches x "
        f"{epochs} epochs; peers {', '.join(peers)}",
        flush=True,
    )

    report = harness.Report(
        "torch_cpu",
        "PyTorch on the CPU from a GIL-holding Python source, 2 worker processes: fp.Feeder / "
        "DataLoader and / StatefulDataLoader (persistent workers), steady state and first epoch",
        settings,
        "kernels_bench.torch_cpu",
    )
    small = max(1, batches // 4)
    warm_source = copy.copy(source)
    warm_source.length = small * args.batch
    run_round(peers, 0, warm_source, args, step, 2, small)  # imports, caches; never timed

    for case in cases:
        case_step = step if CASES[case] else None
        reps = []
        for rep in range(settings.reps):
            with harness.OtherLoad() as other:
                values = run_round(peers, rep, source, args, case_step, epochs, batches)
            ratios(values, peers)
            values["other_cores"] = other.cores
            reps.append(values)
            print(
                f"  {case}, round {rep}: "
                + ", ".join(
                    f"{key}={value:.3f}"
                    for key, value in values.items()
                    if key.startswith("feedpipe_over") or key == "other_cores"
                ),
                flush=True,
            )
        report.add_case(
            case,
            {
                "global_batch": args.batch,
                "batches_per_epoch": batches,
                "epochs_per_round": epochs,
                "workers": args.workers,
                "source": source.as_dict(),
                "source_batch_ms": source_batch_s * 1e3,
                "step": (
                    f"MLP {3 * 32 * 32}-{args.hidden}-10, cross-entropy, SGD, forward + backward"
                    if CASES[case]
                    else "none: each batch dropped as it arrives"
                ),
                "step_alone_ms": step_s * 1e3 if CASES[case] else None,
                "torch_threads": args.torch_threads,
                "peers": {peer: call for peer, call in peer_calls(args).items() if peer in peers},
                "start_methods": {
                    "feedpipe": "spawned interpreters (python -m feedpipe.core._worker)",
                    "dataloader": f"torch.multiprocessing default: {_start_method()}",
                },
                "cores": len(os.sched_getaffinity(0)),
            },
            reps,
            units={
                **{f"{p}_epoch1_s": "s" for p in peers},
                **{f"{p}_steady_samples_s": "samples/s" for p in peers},
                **{f"{p}_{k}_cpu_ms": "CPU-ms per batch" for p in peers for k in ("main", "tree")},
                "other_cores": "cores",
            },
        )
    if "train step" in cases and "feedpipe" in peers:
        for peer, label in (("dataloader", "DataLoader"), ("stateful", "StatefulDataLoader")):
            if peer in peers:
                report.target(
                    "train step",
                    f"feedpipe_over_{peer}_steady",
                    ">=",
                    1.0,
                    f"fp.Feeder / {label} (persistent workers), steady samples/s",
                )
    report.note(
        "Per round, every peer's loader is built fresh: epoch1 = from building it to the end of "
        "its first epoch (worker start-up included), the peers one after another; steady = the "
        "later epochs, one epoch of each peer in turn, the order rotated every pass and round. "
        "Ratios within a round, medians over rounds. CPU-ms per batch over the later epochs: "
        "main = the loop's thread during the peer's epochs (the step included) and feedpipe's "
        "own threads; workers = the loader's worker processes; tree = both. other_cores: CPU "
        "(in cores) used by other processes on the machine during the round."
    )
    report.note(
        "Frameworks imported: "
        + ", ".join(f"{m}={m in sys.modules}" for m in ("tensorflow", "jax", "torch"))
    )
    report.finish(
        columns=[
            "feedpipe_over_dataloader_steady",
            "feedpipe_over_stateful_steady",
            "feedpipe_over_dataloader_fresh_steady",
            "feedpipe_over_dataloader_epoch1",
            "feedpipe_over_stateful_epoch1",
            "feedpipe_tree_cpu_over_dataloader",
            "feedpipe_tree_cpu_over_stateful",
            "feedpipe_main_cpu_over_dataloader",
            "other_cores",
        ]
    )


def _start_method() -> str:
    import torch.multiprocessing

    return torch.multiprocessing.get_start_method()


if __name__ == "__main__":
    main()
