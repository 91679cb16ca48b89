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

Two cases, each peer one session of `--epochs` (4) epochs on a fresh loader, peers in rotating
order in each of `--reps` rounds: `train step`, where each batch goes through a small fixed
torch step (an MLP 3072-256-10, cross-entropy, SGD, forward and backward, `torch` on
`--torch-threads` (1) intra-op threads so that the step does not spread over the cores the
workers use), and `source only`, where each batch is dropped as it arrives (the loaders' own
rate and cost). Reported per peer: `<peer>_epoch1_s` (from building the loader to the end of
its first epoch: start-up included), `<peer>_steady_samples_s` (the epochs after the first),
`<peer>_main_cpu_ms` and `<peer>_tree_cpu_ms` (CPU per batch over the steady epochs: this
process, every thread; and with the loader's worker processes). Ratios within a round, then
medians: `feedpipe_over_<peer>_steady` (samples/s) and `feedpipe_over_<peer>_epoch1` (the
peer's first-epoch time over feedpipe's), above 1 where feedpipe is faster;
`feedpipe_main_cpu_over_<peer>` and `feedpipe_tree_cpu_over_<peer>` (CPU per batch, feedpipe's
over the peer's), below 1 where feedpipe spends less. Targets: feedpipe / dataloader and
feedpipe / stateful >= 1.0 in the steady state of `train step`; the first epoch and `source
only` are reported. `other_cores` is the CPU other processes on the machine used during the
round (above ~0.1 core the round did not measure the peers alone). Where other work shares
the cores, the CPU per batch stays within a few percent from round to round while the rates
do not; on a quiet machine whose cores the workers and the step fill, the rates follow it.

Run: `python -m kernels_bench.torch_cpu [--quick]` (PyTorch installed, and torchdata for the
`stateful` peer, which is left out without it; no TensorFlow or JAX needed); writes
`kernels_bench/results/torch_cpu.json`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
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
    parser.add_argument("--epochs", type=int, default=4, help="epochs per session (>= 2)")
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
    """Stops `loader`'s workers now, so that none runs into the next peer's session."""
    if peer == "feedpipe":
        loader.close()
        return
    # DataLoader keeps a persistent pool in its last iterator and stops it only when that
    # iterator is collected; stop it here instead.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def session(peer: str, source, args, step: TrainStep | None, epochs: int, batches: int) -> dict:
    """One fresh loader of `peer`, `epochs` epochs of `batches`; its figures."""
    started = time.perf_counter()
    loader = build(peer, source, args.batch, args.workers, args.seed)
    ends, cpu, seen = [], [], []
    try:
        for _ in range(epochs):
            count = 0
            for item in loader:
                if step is not None:
                    step(*inputs(peer, item))
                del item
                count += 1
            ends.append(time.perf_counter())
            cpu.append((time.process_time(), tree_cpu_s()))
            seen.append(count)
    finally:
        close(peer, loader)
        del loader
        gc.collect()
    if seen != [batches] * epochs:
        raise RuntimeError(f"{peer}: expected {epochs} epochs of {batches} batches, saw {seen}")
    steady_batches = batches * (epochs - 1)
    return {
        f"{peer}_epoch1_s": ends[0] - started,
        f"{peer}_steady_samples_s": steady_batches * args.batch / (ends[-1] - ends[0]),
        f"{peer}_main_cpu_ms": (cpu[-1][0] - cpu[0][0]) / steady_batches * 1e3,
        f"{peer}_tree_cpu_ms": (cpu[-1][1] - cpu[0][1]) / steady_batches * 1e3,
    }


def tree_cpu_s() -> float:
    """CPU-seconds of this process, its live child processes and those it has waited for (a
    DataLoader without persistent workers ends its pool every epoch)."""
    ended = os.times()
    return harness.tree_cpu_s() + ended.children_user + ended.children_system


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
        for where in ("main", "tree"):
            values[f"feedpipe_{where}_cpu_over_{peer}"] = (
                values[f"feedpipe_{where}_cpu_ms"] / values[f"{peer}_{where}_cpu_ms"]
            )


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
    except ImportError:
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
    for peer in peers:  # imports, the operating system's caches; never timed
        session(peer, warm_source, args, step, 2, small)

    for case in cases:
        case_step = step if CASES[case] else None
        reps = []
        for rep in range(settings.reps):
            values: dict = {}
            with harness.OtherLoad() as other:
                for peer in harness.rotate(peers, rep):
                    values.update(session(peer, source, args, case_step, epochs, batches))
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
                "epochs_per_session": epochs,
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
        "Each session builds its loader inside the timed window: epoch1 = from building the "
        "loader to the end of its first epoch (worker start-up included), steady = the epochs "
        "after the first. Ratios within a round (peers in rotating order), medians over rounds. "
        "main/tree CPU: CPU-ms per batch over the steady epochs, this process (every thread) "
        "and with its live child processes (the loader's workers). other_cores: CPU (in "
        "cores) used by other processes on the machine during the round."
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
