"""On a CUDA GPU with PyTorch, does feedpipe copy from its host slots at the rate of torch's own
pinned copies, keep a real torch step at depth 2 as busy as batches already on the device, and
train as fast as a DataLoader with 8 workers and pinned memory?

Three parts (`--parts copy,rs,train`), each answered as ratios of peers measured side by side in
one run, peers in rotating order in each repetition, medians over repetitions:

* copy: one batch of `--copy-mb` (2, 16, 64) MiB, each copy timed alone until it is done, the
  median per repetition. `slot`: the PyTorch feeder's own staging of a pooled, shared,
  page-locked slot (`TorchLayer`'s stager: `torch.from_numpy(region).to(device,
  non_blocking=True)` on a CUDA stream of its own, then a wait on its event), as the feeder
  stages every batch; `slot_pageable`: the same from a slot that is not page-locked;
  `torch_pinned`: torch's own `torch.empty(n, pin_memory=True)` then `.to(device,
  non_blocking=True)` and `torch.cuda.synchronize()`. Targets: slot / torch pinned >= 0.8 at
  2 MiB, >= 0.95 at 16 and 64 MiB.
* rs (R/S, DESIGN.md): a real torch training step (an MLP: the flattened 96x96x3 image into
  `--hidden` units, a weight-tied hidden layer applied `repeat` times, cross-entropy, SGD),
  `repeat` calibrated so that the step alone takes about each of `--step-ms` (30 and 5), fed by
  `fp.Feeder((x, y), B, devices=[cuda], depth=2, shuffle=True)` from arrays in host memory,
  against the same step on batches already on the device (pre-staged, reused). Steps are
  enqueued without waiting, as a training loop does; the clock stops when
  `torch.cuda.synchronize()` returns after the last one. Targets: R/S >= 0.98 with the 30 ms
  step, >= 0.95 with the 5 ms step.
* train: the same kind of model as `gpu_fit.py`'s in torch (4 stride-2 3x3 convolutions,
  32-256 channels, ReLU, global average pooling, linear 10; channels-last; SGD,
  cross-entropy) on `--batch` (256) x 96x96x3 float32 images from `harness.images.ImageSource`, a
  map-style Python source whose `__getitem__` costs about `--batch-ms` / B of GIL-holding CPU
  (34 ms a batch), `--steps` (48) steps an epoch, `--epochs` (3) per session, each session a
  fresh loader built inside the timed window. Peers: `resident` (the step on batches already on
  the device: the step's own rate), `feedpipe` (`fp.Feeder(source, B, devices=[cuda],
  workers=8, shuffle=True)`, the step on `batch.distributed()`), `dataloader`
  (`torch.utils.data.DataLoader(source, batch_size=B, shuffle=True, num_workers=8,
  pin_memory=True, persistent_workers=True)`, each field `.to(device, non_blocking=True)`),
  `stateful` (torchdata's `StatefulDataLoader`, the same arguments; where torchdata is
  installed) and `feeder_alone` (the same feeder iterated with no step: its producers' rate).
  Each epoch ends with `torch.cuda.synchronize()`. Reported apart: the first epoch (from
  building the loader to the end of its first epoch, start-up included) and the steady state
  (the epochs after the first). Target: feedpipe / dataloader >= 1.0 in the steady state
  (feedpipe / stateful, feedpipe / min(resident, feeder_alone), and the first epoch reported).

Persistent workers are the strong peer for the steady state (no new pool each epoch); their
first epoch is DataLoader's default's. feedpipe's workers are spawned interpreters that import
numpy and `kernels_bench.harness.images` (numpy and the standard library at the top), never
torch.

Run on the GPU machine (PyTorch with CUDA; no JAX, TensorFlow or Keras needed; torchdata only
for the `stateful` peer: where it is not installed, carry its wheel, pure Python, in `.whl`
with `python3 -m pip download --no-deps -d .whl torchdata==0.11.0`, which `gpu_run.sh`
installs), from the repository root:

    PYTHONPATH=$PWD python3 -m kernels_bench.torch_gpu

or with the GPU tests, as `GPU_RUN=torch bash kernels_bench/gpu_run.sh` (about 4 minutes);
writes `kernels_bench/results/torch_gpu.json`. `--smoke` shrinks every part (small batches, 2
workers, 3 repetitions, devices=[cpu] unless `--device` says otherwise) so that it runs on a
CPU-only PyTorch in about a minute, as a check that the script works, and writes
`torch_gpu_smoke.json` instead; on the CPU the feeder's batches are the slot's memory itself
and `.to("cpu")` copies nothing, so its "copy rates" are not copy rates and no target is
taken.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from kernels_bench import harness, torch_cpu
from kernels_bench.harness.accelerator import (
    Report,
    add_copy_rs_args,
    command_line,
    nvidia_smi,
    page_locker_info,
    parse_run,
)
from kernels_bench.harness.images import CONV_WIDTHS, NUM_CLASSES, SAMPLE_SHAPE, ImageSource
from kernels_bench.harness.parts import (
    add_rs_case,
    calibrate_repeat,
    copies_per_rep,
    copy_reps,
    epoch_metrics,
    feeder_params,
    rs_reps,
    session_params,
    session_reps,
    session_units,
)

PARTS = ("copy", "rs", "train")
COPY_PEERS = ("slot", "slot_pageable", "torch_pinned")
COPY_TARGETS = {2: 0.8, 16: 0.95, 64: 0.95}
"""slot / torch pinned, by copy size in MiB (the stager polls its event for about the copy's
time, then sleeps: a sleeping wait alone gave 0.415 / 0.685 / 0.867 on an H100)."""
TRAIN_PEERS = ("resident", "feedpipe", "dataloader", "stateful", "feeder_alone")


# ---- device, environment -------------------------------------------------------------------


class Device:
    """The torch device under test and what waiting for it means."""

    def __init__(self, torch, name: str):
        self.torch = torch
        self.device = torch.device(name)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"

    def synchronize(self) -> None:
        """Waits for every kernel and copy queued on the device (nothing to wait for on CPU)."""
        if self.cuda:
            self.torch.cuda.synchronize(self.device)


def accelerator(dev: Device) -> dict:
    """The device, the versions around it and the page locker feedpipe found."""
    torch = dev.torch
    info = {
        "device": str(dev.device),
        "versions": {
            p: harness.version(p) for p in ("torch", "torchdata", "numpy", "optree", "psutil")
        },
        "torch_cuda": torch.version.cuda,
        "page_locker": page_locker_info(),
        "nvidia_smi": nvidia_smi(),
        "frameworks_loaded": {m: m in sys.modules for m in ("tensorflow", "jax", "keras")},
    }
    if dev.cuda:
        info["device_name"] = torch.cuda.get_device_name(dev.device)
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return info


# ---- copy: the feeder's staging from a slot against torch's pinned copy --------------------


def slot_transfer(dev: Device, nbytes: int, page_locked: bool) -> tuple[object, Callable]:
    """The PyTorch feeder's stager over one pooled, shared slot of `nbytes` (one float32 row),
    filled, page-locked by the pool when asked (and where the layer finds a page locker); the
    objects to keep alive and a call that stages the slot once and waits for its copy."""
    from feedpipe.core.recorder import StatsRecorder
    from feedpipe.core.sampler import Step
    from feedpipe.core.slots import SlotLayout, SlotPool
    from feedpipe.core.sources import SampleSpec
    from feedpipe.core.split import ReplicaSplit
    from feedpipe.torch.layer import TorchLayer

    layer = TorchLayer([dev.device], None, 1)
    layout = SlotLayout(SampleSpec.of(np.zeros(nbytes // 4, np.float32)), ReplicaSplit(1, 1))
    lock = layer.page_lock if page_locked else None
    pool = SlotPool(layout, 1, shared=True, page_lock=lock)
    slot = pool.take(threading.Event())
    slot.buffer[...] = 1  # every page touched before anything is timed
    stats = StatsRecorder(2)
    stager = layer.stager(layout, stats)
    step = Step(0, 0, np.zeros(1, np.int64), 1)
    cpu = [0.0]

    def transfer() -> None:
        started = time.thread_time()
        stager.stage(step, slot.buffer)  # returns once its own copy is done
        cpu[0] += time.thread_time() - started

    transfer.cpu_s, transfer.stats = cpu, stats
    return (layer, pool, slot, stager), transfer


def staging_per_copy(transfer: Callable) -> dict:
    """The stager's ms per copy in each stage and its thread's CPU ms per copy (polling costs
    CPU while it waits), from a `slot_transfer`'s counters."""
    stats = transfer.stats
    copies = max(stats.copies, 1)
    return {
        "stage_ms": {k: v * 1e3 / copies for k, v in stats.stage_s.items() if v},
        "cpu_ms_per_copy": transfer.cpu_s[0] * 1e3 / copies,
        "copies": stats.copies,
    }


def pinned_transfer(dev: Device, nbytes: int) -> tuple[object, Callable]:
    """torch's own pinned copy: `torch.empty(n, pin_memory=True)`, then `.to(device,
    non_blocking=True)` and a wait for the device."""
    torch = dev.torch
    pinned = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=dev.cuda)
    pinned.fill_(1.0)

    def transfer() -> None:
        pinned.to(dev.device, non_blocking=True)
        dev.synchronize()

    return pinned, transfer


def run_copy(report: Report, settings: harness.Settings, dev: Device) -> None:
    applies = dev.cuda and not settings.args.smoke
    for mb in settings.args.copy_mb:
        nbytes = int(mb * 2**20)
        owners, peers = [], {}
        for peer, (owner, transfer) in (
            ("slot", slot_transfer(dev, nbytes, page_locked=True)),
            ("slot_pageable", slot_transfer(dev, nbytes, page_locked=False)),
            ("torch_pinned", pinned_transfer(dev, nbytes)),
        ):
            owners.append(owner)
            peers[peer] = transfer
        pool = owners[0][1]
        copies = copies_per_rep(settings, nbytes)
        reps = copy_reps(settings, peers, nbytes, copies)
        case = f"copy {mb:g} MiB"
        report.add_case(
            case,
            {
                "bytes": nbytes,
                "copies_per_rep": copies,
                "device": str(dev.device),
                "slot_page_locked": bool(pool.page_locked),
                "slot_page_lock_reason": pool.page_lock_reason,
                "peers": {
                    "slot": (
                        "the PyTorch feeder's stager (TorchLayer) from a page-locked slot: "
                        "torch.from_numpy(region).to(device, non_blocking=True) on its own "
                        "stream, then its event's wait"
                    ),
                    "slot_pageable": "the same stager from a slot that is not page-locked",
                    "torch_pinned": (
                        "torch.empty(n, pin_memory=True).to(device, non_blocking=True) + "
                        "torch.cuda.synchronize()"
                    ),
                },
            },
            reps,
            units={f"{peer}_gb_s": "GB/s (1e9 bytes)" for peer in COPY_PEERS},
            extra={"slot_staging": staging_per_copy(peers["slot"])},
        )
        threshold = COPY_TARGETS.get(round(mb))
        if threshold is not None:
            report.target(
                case,
                "slot_over_torch_pinned",
                ">=",
                threshold,
                "the feeder's staging from a page-locked slot / torch pinned copy",
                applies=applies,
                why_not=f"device {dev.device}{' (--smoke)' if settings.args.smoke else ''}: "
                "no copy to a GPU was made; reported only",
            )
        del owners, peers, pool
        gc.collect()


# ---- R/S: a real torch step, fed or on pre-staged batches ----------------------------------


class MLPStep:
    """An SGD step of an MLP whose hidden layer is applied `repeat` times; never waits."""

    def __init__(self, features: int, hidden: int, repeat: int, dev: Device, seed: int):
        torch = dev.torch
        torch.manual_seed(seed)
        self.repeat = repeat
        self.w_in = torch.nn.Linear(features, hidden).to(dev.device)
        self.w_hidden = torch.nn.Linear(hidden, hidden).to(dev.device)
        self.w_out = torch.nn.Linear(hidden, NUM_CLASSES).to(dev.device)
        parameters = [
            *self.w_in.parameters(),
            *self.w_hidden.parameters(),
            *self.w_out.parameters(),
        ]
        self.optimizer = torch.optim.SGD(parameters, lr=1e-4)
        self.torch = torch

    def __call__(self, x, y) -> None:
        torch = self.torch
        h = torch.tanh(self.w_in(x.reshape(x.shape[0], -1)))
        for _ in range(self.repeat):
            h = torch.tanh(self.w_hidden(h))
        loss = torch.nn.functional.cross_entropy(self.w_out(h), y.long())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def run_steps(step, dev: Device, batches: Iterator, count: int) -> float:
    """Enqueues `count` steps on `batches` without waiting; seconds until the device is done."""
    started = time.perf_counter()
    for _ in range(count):
        x, y = next(batches)
        step(x, y)
    dev.synchronize()
    return time.perf_counter() - started


def calibrate_step(features, hidden, batch, dev: Device, seed, target_s) -> tuple[MLPStep, float]:
    """A step whose `repeat` makes it take about `target_s` alone on `batch`: a probe, then
    refinements at about the target."""

    def run(step: MLPStep, count: int) -> float:
        run_steps(step, dev, itertools.repeat(batch), 3)  # the allocator, cuBLAS's handles
        return run_steps(step, dev, itertools.repeat(batch), count)

    def build(repeat: int) -> MLPStep:
        return MLPStep(features, hidden, repeat, dev, seed)

    step, _, step_s = calibrate_repeat(build, run, target_s, tries=4)
    return step, step_s


def run_rs(report: Report, settings: harness.Settings, dev: Device, step_ms: float) -> None:
    import feedpipe as fp

    torch = dev.torch
    args = settings.args
    batch = args.rs_batch
    x, y = ImageSource(batch * args.rs_batches, 0.0).arrays()
    features = math.prod(SAMPLE_SHAPE)
    staged = [
        (
            torch.from_numpy(x[i : i + batch]).to(dev.device),
            torch.from_numpy(y[i : i + batch]).to(dev.device),
        )
        for i in range(0, 4 * batch, batch)
    ]
    step, step_s = calibrate_step(
        features, args.hidden, staged[0], dev, settings.seed, step_ms / 1e3
    )
    print(
        f"R/S: step of {step.repeat} hidden layers ({args.hidden} units) takes "
        f"{step_s * 1e3:.1f} ms alone on {batch} x {SAMPLE_SHAPE} "
        f"({x[:batch].nbytes / 2**20:.1f} MiB a batch)",
        flush=True,
    )
    feeder = fp.Feeder(
        (x, y), batch, devices=[dev.device], depth=2, shuffle=True, seed=settings.seed
    )
    fed = (b.distributed()[0] for b in harness.endless(feeder))
    peers = {"real": fed, "synthetic": itertools.cycle(staged)}

    def run(batches: Iterator, count: int) -> float:
        return run_steps(step, dev, batches, count)

    for batches in peers.values():
        run(batches, 3)
    steps = settings.pick(max(10, args.rs_steps // 4), args.rs_steps)
    before = feeder.stats()
    reps = rs_reps(settings, peers, run, steps)
    add_rs_case(
        report,
        step_ms,
        {"device": str(dev.device)},
        batch=batch,
        batch_bytes=x[:batch].nbytes + y[:batch].nbytes,
        hidden=args.hidden,
        repeat=step.repeat,
        step_s=step_s,
        steps=steps,
        reps=reps,
        feeder=feeder,
        before=before,
        applies=dev.cuda and not args.smoke,
        why_not=f"device {dev.device}: the step and the feeder share the CPU; reported only",
    )
    fed.close()
    feeder.close()


# ---- train: a convnet from a Python source, feedpipe against DataLoader ---------------------


class ConvStep:
    """An SGD step of `gpu_fit.py`'s model, in torch: NHWC batches, channels-last convolutions."""

    def __init__(self, dev: Device, seed: int):
        torch = dev.torch
        torch.manual_seed(seed)
        layers, channels = [], 3
        for width in CONV_WIDTHS:
            layers += [torch.nn.Conv2d(channels, width, 3, stride=2, padding=1), torch.nn.ReLU()]
            channels = width
        layers += [
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(channels, NUM_CLASSES),
        ]
        self.model = torch.nn.Sequential(*layers).to(dev.device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.torch = torch

    def __call__(self, x, y) -> None:
        logits = self.model(x.permute(0, 3, 1, 2))  # NHWC memory read as channels-last NCHW
        loss = self.torch.nn.functional.cross_entropy(logits, y.long())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


class TrainPeers:
    """Builds each peer's input inside the timed window, runs its epochs, tears it down."""

    def __init__(self, dev: Device, step: ConvStep, source, resident, args):
        self.dev = dev
        self.step = step
        self.source = source
        self.resident = resident
        self.args = args
        self.feeder_stats = None

    def batches(self, peer: str, loader) -> Iterator[tuple]:
        """One epoch of `(x, y)` on the device, as `peer`'s users write the loop; nothing of a
        batch is held here while the next one is asked for."""
        device = self.dev.device
        if peer == "resident":
            yield from itertools.islice(itertools.cycle(self.resident), self.args.steps)
        elif peer in ("feedpipe", "feeder_alone"):
            for batch in loader:
                inputs = batch.distributed()[0]
                del batch
                yield inputs
                del inputs
        else:
            for x, y in loader:
                inputs = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                del x, y
                yield inputs
                del inputs

    def session(self, peer: str, epochs: int, source=None, workers: int | None = None) -> dict:
        """A fresh `peer` over `epochs` epochs; its figures."""
        source = self.source if source is None else source
        workers = self.args.workers if workers is None else workers
        steps = len(source) // self.args.batch
        started = time.perf_counter()
        loader = None
        if peer != "resident":
            kind = "feedpipe" if peer == "feeder_alone" else peer
            with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital
                warnings.filterwarnings("ignore", message=".*set_vital.*")
                loader = torch_cpu.build(
                    kind,
                    source,
                    self.args.batch,
                    workers,
                    self.args.seed,
                    device=self.dev.device,
                    pin_memory=self.dev.cuda,
                )
        ends, seen = [], []
        try:
            for _ in range(epochs):
                count = 0
                for x, y in self.batches(peer, loader):
                    if peer != "feeder_alone":
                        self.step(x, y)
                    del x, y
                    count += 1
                self.dev.synchronize()
                ends.append(time.perf_counter())
                seen.append(count)
        finally:
            if loader is not None:
                if peer == "feedpipe":
                    self.feeder_stats = loader.stats()
                torch_cpu.close("feedpipe" if peer == "feeder_alone" else peer, loader)
            del loader
            gc.collect()
        expected = self.args.steps if peer == "resident" else steps
        return epoch_metrics(peer, started, ends, seen, expected, epochs)


def train_ratios(values: dict, peers: list[str]) -> None:
    for phase in ("steady", "epoch1"):
        for peer in peers:
            if peer not in ("resident", "feedpipe", "feeder_alone") and "feedpipe" in peers:
                values[f"feedpipe_over_{peer}_{phase}"] = (
                    values[f"feedpipe_{phase}_steps_s"] / values[f"{peer}_{phase}_steps_s"]
                )
            if peer not in ("resident", "feeder_alone") and "resident" in peers:
                values[f"{peer}_over_resident_{phase}"] = (
                    values[f"{peer}_{phase}_steps_s"] / values[f"resident_{phase}_steps_s"]
                )
    if {"feedpipe", "resident", "feeder_alone"} <= set(peers):
        bound = min(values["resident_steady_steps_s"], values["feeder_alone_steady_steps_s"])
        values["feedpipe_over_bound_steady"] = values["feedpipe_steady_steps_s"] / bound


def run_train(report: Report, settings: harness.Settings, dev: Device) -> None:
    torch = dev.torch
    args = settings.args
    if args.epochs < 2:
        raise SystemExit(f"--epochs={args.epochs}: the steady state is the epochs after the first.")
    peers = [p.strip() for p in args.train_peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(TRAIN_PEERS))
    if unknown:
        raise SystemExit(f"--train-peers={args.train_peers}: unknown {unknown}; use {TRAIN_PEERS}.")
    peers = [p for p in TRAIN_PEERS if p in peers]
    if "stateful" in peers and not torch_cpu.have_torchdata():
        peers.remove("stateful")
        report.note(
            "train: torchdata is not installed here; the StatefulDataLoader peer was left out."
        )
    shape = tuple(int(v) for v in str(args.shape).split(","))
    length = args.batch * args.steps
    source = ImageSource(length, args.batch_ms / 1e3 / args.batch, shape)
    xs, ys = source.prefix(4 * args.batch).arrays()
    resident = [
        (
            torch.from_numpy(xs[i : i + args.batch]).to(dev.device),
            torch.from_numpy(ys[i : i + args.batch]).to(dev.device),
        )
        for i in range(0, 4 * args.batch, args.batch)
    ]
    step = ConvStep(dev, settings.seed)
    training = TrainPeers(dev, step, source, resident, args)
    small = source.prefix(2 * args.batch)
    for peer in peers:  # imports, cuDNN's algorithm choice, the allocator; never timed
        training.session(peer, 2, source=small, workers=min(args.workers, 2))
    print(
        f"train: source {source.calibrated_s * args.batch * 1e3:.1f} ms of CPU per batch of "
        f"{args.batch} x {shape}, {args.workers} workers, {args.steps} steps x {args.epochs} "
        f"epochs; peers {', '.join(peers)}",
        flush=True,
    )
    reps = session_reps(
        settings, peers, lambda peer: training.session(peer, args.epochs), train_ratios
    )
    stats = training.feeder_stats
    case = "train from a Python source"
    loader_args = f"batch_size={args.batch}, shuffle=True, num_workers={args.workers}"
    pin = f"pin_memory={dev.cuda}, persistent_workers=True"
    report.add_case(
        case,
        {
            "device": str(dev.device),
            "model": f"convnet {list(CONV_WIDTHS)} stride 2, global pool, linear {NUM_CLASSES}",
            **session_params(source, args.batch, shape, args.steps, args.epochs, args.workers),
            "peers": {
                "resident": "the step on 4 batches already on the device, cycled",
                "feedpipe": (
                    f"fp.Feeder(source, {args.batch}, devices=[{dev.device}], "
                    f"workers={args.workers}, shuffle=True); step(*batch.distributed()[0])"
                ),
                "dataloader": (
                    f"torch.utils.data.DataLoader(source, {loader_args}, {pin}); "
                    "x.to(device, non_blocking=True)"
                ),
                "stateful": (
                    f"torchdata StatefulDataLoader(source, {loader_args}, {pin})"
                    if "stateful" in peers
                    else "torchdata not installed or not asked for: left out"
                ),
                "feeder_alone": "the same feeder iterated with no step: its producers' rate",
            },
            **feeder_params(stats),
        },
        reps,
        units={**session_units(peers), "other_cores": "cores"},
    )
    if {"feedpipe", "dataloader"} <= set(peers):
        report.target(
            case,
            "feedpipe_over_dataloader_steady",
            ">=",
            1.0,
            f"feeder / DataLoader(num_workers={args.workers}, pin_memory={dev.cuda}), steady "
            "steps/s",
            applies=dev.cuda and not args.smoke,
            why_not=f"device {dev.device}: reported only",
        )


# ---- the command ------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke", action="store_true", help="tiny everything, CPU, about a minute (a check)"
    )
    parser.add_argument("--device", default=None, help="torch device (default cuda; cpu: smoke)")
    parser.add_argument("--parts", default=",".join(PARTS), help="any of copy,rs,train")
    add_copy_rs_args(parser)
    parser.add_argument("--batch", type=int, default=256, help="train: global batch")
    parser.add_argument("--shape", default="96,96,3", help="train: image shape")
    parser.add_argument("--steps", type=int, default=48, help="train: steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="train: epochs per session")
    parser.add_argument("--workers", type=int, default=8, help="train: worker processes")
    parser.add_argument(
        "--batch-ms", type=float, default=34.0, help="train: the source's CPU per batch"
    )
    parser.add_argument(
        "--train-peers",
        default=",".join(TRAIN_PEERS),
        help="train: any of " + ",".join(TRAIN_PEERS),
    )


def smoke(args: argparse.Namespace) -> None:
    """Shrinks every part to run on a CPU in about a minute."""
    args.quick = True
    args.device = args.device or "cpu"
    args.copy_mb = "2,16"
    args.step_ms = "10"
    args.hidden = 128
    args.rs_batch = 16
    args.rs_batches = 4
    args.rs_steps = 40
    args.batch = 16
    args.shape = "32,32,3"
    args.steps = 6
    args.epochs = 2
    args.workers = 2
    args.batch_ms = 8.0


def main(argv=None) -> None:
    settings, parts = parse_run(__doc__, add_args, smoke, PARTS, argv)
    args = settings.args

    # The slots are page-locked by the locker feedpipe finds before torch loads CUDA.
    from feedpipe.core.pinned import page_locker

    page_locker()
    import torch

    name = args.device or "cuda"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "No CUDA device for PyTorch here; pass --smoke to check the script on CPU."
        )
    dev = Device(torch, name)
    report = Report(
        "torch_gpu_smoke" if args.smoke else "torch_gpu",
        "PyTorch on one GPU: the feeder's staging from a page-locked slot / torch's pinned copy "
        "(16, 64 MiB), R/S of a torch step at depth 2 (30 and 5 ms), and training from a "
        "Python source: fp.Feeder / DataLoader(num_workers=8, pin_memory=True), steady state "
        "and first epoch",
        settings,
        "kernels_bench.torch_gpu",
        command=command_line("python -m kernels_bench.torch_gpu", args, PARTS),
    )
    report.accelerator = accelerator(dev)
    print(f"device: {report.accelerator.get('device_name', dev.device)}; parts: {', '.join(parts)}")
    if not dev.cuda:
        report.note(
            f"Run on {dev.device}, not a GPU: every figure checks that the script works; none "
            "is a GPU figure. On the CPU the feeder's batches are its slots' memory and "
            ".to('cpu') copies nothing, so the copy case's GB/s are not copy rates."
        )
    if "copy" in parts:
        run_copy(report, settings, dev)
    if "rs" in parts:
        for step_ms in args.step_ms:
            run_rs(report, settings, dev, step_ms)
    if "train" in parts:
        run_train(report, settings, dev)
    report.note(
        "Each ratio is taken within one repetition (peers in rotating order), then the median "
        "over repetitions. copy: each copy timed alone until it is done, the median per "
        "repetition; GB/s are 1e9 bytes. R/S: steps enqueued without waiting, the clock "
        "stopped when torch.cuda.synchronize() returns; the feeder's stats are over the timed "
        "steps. train: each loader built inside the timed window; epoch 1 includes its "
        "start-up; steady = the epochs after the first; each epoch ends with a synchronize."
    )
    report.note(
        "Frameworks imported: "
        + ", ".join(f"{m}={m in sys.modules}" for m in ("tensorflow", "jax", "keras", "torch"))
    )
    report.finish(
        columns=[
            "slot_gb_s",
            "torch_pinned_gb_s",
            "slot_over_torch_pinned",
            "slot_pageable_over_torch_pinned",
            "real_over_synthetic",
            "synthetic_step_ms",
            "feedpipe_over_dataloader_steady",
            "feedpipe_over_stateful_steady",
            "feedpipe_over_bound_steady",
            "feedpipe_over_resident_steady",
            "dataloader_over_resident_steady",
            "feedpipe_over_dataloader_epoch1",
            "feedpipe_over_stateful_epoch1",
        ]
    )


if __name__ == "__main__":
    main()
