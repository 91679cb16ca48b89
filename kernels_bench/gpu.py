"""On a GPU, does feedpipe copy at the link's rate beside the running step, keep a real step
fed, and feed Keras 3 on JAX as fast as in-memory arrays or its own producers allow?

Four questions, each answered as ratios of peers measured side by side in one run:

* copy: the host-to-device copy rate from feedpipe's own host slots (a `SlotPool` of shared
  slots, as worker processes fill them, page-locked through `feedpipe.core.pinned`), each copy
  timed alone to its array being ready, at 2, 16 and 64 MiB: feedpipe's copy engine (its own
  CUDA stream, then `jax.dlpack.from_dlpack`, as the JAX feeder stages), and for contrast
  `jax.device_put` from the same slot and from a pageable one. The ceiling: PyTorch's copy of
  the same bytes from its own pinned memory (`torch.empty(n, pin_memory=True).to("cuda",
  non_blocking=True)` + `torch.cuda.synchronize()`), and from the page-locked slot itself.
  Targets: engine / torch pinned >= 0.9 at 16 and 64 MiB, >= 0.75 at 2 MiB. PyTorch is
  optional; without it the ratios are not taken.
* busy: the time from issuing one R/S batch's copy (27 MiB, page-locked) to its being ready,
  issued just after a `--step-ms` jitted step was dispatched, over the same on an idle GPU, for
  the copy engine and for `jax.device_put` (whose copy waits for the step). Target: engine
  busy / idle <= 1.5.
* R/S (DESIGN.md): a real jitted training step (an MLP: the flattened 96x96x3 image into
  `--hidden` units, a weight-tied hidden layer applied `repeat` times in a `lax.scan`, softmax
  cross-entropy, SGD, parameters donated), `repeat` calibrated so that the step alone takes
  about each of `--step-ms` (30 and 5 on a GPU), fed by `fp.Feeder((x, y), B, devices=[gpu],
  depth=2, shuffle=True)` from arrays in host memory, against the same step on batches already
  on the device (pre-staged, reused). Steps are dispatched without waiting, as a training loop
  does; the clock stops when the last step's parameters are ready. Targets: R/S >= 0.98 with
  the 30 ms step and with the 5 ms step (the feeder's `stats().stage_ms` says where each batch's
  staging time went).
* fit: Keras 3 on JAX, a convnet (4 stride-2 3x3 convolutions, 32-256 channels, global pooling,
  dense 10; SGD, sparse cross-entropy from logits) on 256 x 96x96x3 float32 batches, fed from a
  Python map-style source whose `__getitem__` costs about `--batch-ms` / 256 of CPU (34 ms per
  batch: a GIL-holding loop plus building the image, calibrated when the source is built).
  Peers, one `fit` each of `--epochs` epochs of `--steps` steps, in rotating order per
  repetition, one model (compiled once per input structure, before the repetitions):
  `fit(x, y)` on the same images in memory (the reference: no source cost at all),
  `fit(feeder, callbacks=[feeder.fit_callback()])` over `fp.Feeder(source, 256, workers=8)`,
  `fit(PyDataset)` (`keras.utils.PyDataset(workers=8, use_multiprocessing=True)`, each
  `__getitem__` stacking 256 samples), and Grain (`grain.MapDataset.source(source).batch(256)
  .to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=8))`, which `fit`
  takes through Keras's Grain adapter); beside them the producers' own ceiling, the same
  feeder iterated with no model. Each peer's input is built inside the timed call; the first
  epoch (start-up included) and the steady state (the epochs after the first, each with its
  input's restart) are reported apart. Target: fit(feeder) >= 0.9 x min(fit(x, y), the
  ceiling) in the steady state. A second case, `--fast-batch-ms` (10) of CPU per batch, which
  the workers outrun, runs fit(x, y) and fit(feeder) alone: targets >= 0.95 in the steady
  state, and a fit(feeder) after the first in the process (every timed one: the warm-up fitted
  first) takes <= 1.2x fit(x, y)'s time over its first epoch, its input's start-up included.
  Each session also counts the train step's compilations (`<peer>_compiles`). Grain is
  optional; without it its peer is left out.

What runs where: feedpipe's worker processes unpickle `ImageSource` from this module, which
imports only numpy and the standard library at the top, so they never import a framework.
PyDataset's workers are forked from this process (they inherit what it loaded, as Keras does);
Grain's are spawned, and Grain itself imports JAX.

On a CUDA machine with JAX (and PyTorch, optionally) but no TensorFlow and no package index,
carry as wheels what it lacks: Keras 3 (keras, namex, optree; its other needs, absl-py, rich,
h5py, ml-dtypes and packaging, are usually there) and Grain (grain, array_record, portpicker;
it also needs absl-py, cloudpickle, etils, protobuf and psutil). feedpipe itself runs from the
checkout (it needs numpy, optree and cloudpickle). From the repository root on a machine with
pip, for the GPU machine's Python (3.12 here; ~7 MB):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl keras==3.15.1 namex==0.1.0 optree==0.20.0 \
        grain==0.2.18 array_record==0.8.6 portpicker==1.6.0

Then, on the GPU machine, in the repository root with `.whl` carried beside the checkout, the
one command, which also runs the JAX GPU tests first (`tests/gpu/test_gpu_jax.py`), then
PyTorch's half (`kernels_bench.torch_gpu` and its tests), `kernels_bench.startup` with 8
workers and `kernels_bench.gather` on the machine's cores:

    bash kernels_bench/gpu_run.sh

which takes about 6 minutes, writes `kernels_bench/results/gpu.json` (4 repetitions) and the
others, and copies them with their logs to `$OUT` (`GPU_RUN=jax` runs this half alone).
`--smoke` shrinks every part (a few small batches, 2 workers, 3 repetitions, under 2 minutes)
so that it runs on CPU JAX as a check that the script works, and writes `gpu_smoke.json`
instead: its figures are labelled with the platform they came from, and on a CPU device
`jax.device_put` may wrap host memory instead of copying it, so its "copy rates" are not copy
rates. The JSON records the device, the versions, whether the slots were page-locked and, if
not, why.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from kernels_bench import harness
from kernels_bench.gil_source import _typical, spin

SAMPLE_SHAPE = (96, 96, 3)
NUM_CLASSES = 10
PARTS = ("copy", "busy", "rs", "fit")
FIT_PEERS = ("arrays", "feedpipe", "pydataset", "grain")
COPY_PEERS = ("engine", "slot_locked", "slot_pageable", "torch_pinned", "torch_slot_locked")
COPY_TARGETS = {2: 0.75, 16: 0.9, 64: 0.9}
FENCES_PER_BATCH = 0.1
"""Fences the copy engine may enqueue per batch per device in the steady state."""
"""engine / torch pinned, by copy size in MiB (smaller copies pay the fixed costs more)."""
CONV_WIDTHS = (32, 64, 128, 256)


# ---- the source (numpy and the standard library only: worker processes import this) -------


class ImageSource:
    """`length` float32 images with int32 labels, each costing about `sample_s` of CPU in Python.

    The cost is a GIL-holding integer loop (`gil_source.spin`) plus building the image, as a
    decode and augment written in Python would hold the interpreter. The loop's length is
    calibrated once, in the process that builds the source, and travels with the pickle, so
    every process and every peer does the same work per sample. `image(i)` alone is free of
    the loop: `arrays()` builds the same images in memory for `fit(x, y)`.
    """

    def __init__(self, length: int, sample_s: float, shape: tuple[int, ...] = SAMPLE_SHAPE):
        self.length = length
        self.shape = tuple(shape)
        self._pattern: np.ndarray | None = None
        self.iterations = 0
        self.build_s = _typical(self.__getitem__, 0)
        """What building one image alone took (the part of a sample that is not the loop)."""
        if sample_s > self.build_s:
            self.iterations = 2_000
            per_iteration_s = _typical(spin, self.iterations) / self.iterations
            for _ in range(2):  # a first guess from a probe, then refined at about the target
                self.iterations = max(0, round((sample_s - self.build_s) / per_iteration_s))
                measured = _typical(self.__getitem__, 0)
                if self.iterations:
                    per_iteration_s = max(measured - self.build_s, 1e-9) / self.iterations
        self.calibrated_s = _typical(self.__getitem__, 0)
        """What one sample took when calibrated."""

    def prefix(self, length: int) -> ImageSource:
        """The first `length` samples, each costing what this source's do."""
        other = copy.copy(self)
        other.length = length
        return other

    @property
    def pattern(self) -> np.ndarray:
        """The base image, made on first use in each process (not pickled)."""
        if self._pattern is None:
            size = math.prod(self.shape)
            self._pattern = (np.arange(size, dtype=np.float32) / size).reshape(self.shape)
        return self._pattern

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pattern": None}

    def __len__(self) -> int:
        return self.length

    def image(self, index: int) -> np.ndarray:
        return self.pattern + np.float32((index % 251) / 251.0)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        index = int(index)
        spin(self.iterations)
        return self.image(index), np.int32(index % NUM_CLASSES)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample in memory, made without the per-sample cost: `(x, y)`."""
        count = self.length
        x = np.empty((count, *self.shape), np.float32)
        for i in range(count):
            x[i] = self.image(i)
        return x, (np.arange(count) % NUM_CLASSES).astype(np.int32)

    def as_dict(self) -> dict:
        return {
            "kind": "GIL-holding Python loop + image build per sample",
            "shape": list(self.shape),
            "iterations": self.iterations,
            "build_s": self.build_s,
            "calibrated_sample_s": self.calibrated_s,
            "length": self.length,
        }


def make_batch(source: ImageSource, number: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `number` of `source`: its samples read one by one and stacked (PyDataset's)."""
    samples = [source[i] for i in range(number * batch, (number + 1) * batch)]
    return np.stack([x for x, _ in samples]), np.stack([y for _, y in samples])


# ---- set-up and environment ------------------------------------------------------------------


def configure_environment() -> None:
    """What every framework reads when it loads: quiet logs, JAX for Keras, and no JAX
    pre-allocation (PyTorch copies to the same GPU in the copy part)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise SystemExit(f"KERAS_BACKEND={backend}: this benchmark runs Keras on JAX; unset it.")


def _torch():
    """PyTorch with a CUDA device, or None (it is optional)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def nvidia_smi() -> list[dict] | None:
    """What `nvidia-smi` says of each GPU: name, driver, memory and the PCIe link in use."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = fields.split(",")
    return [
        dict(zip(names, (value.strip() for value in line.split(",")), strict=False))
        for line in out.strip().splitlines()
    ]


def page_locker_info() -> dict:
    """The page locker feedpipe found, for the JSON."""
    from feedpipe.core.pinned import page_locker

    locker = page_locker()
    return {"available": locker.available, "library": locker.library, "reason": locker.reason}


def accelerator() -> dict:
    """The device, the versions around it and the page locker feedpipe found."""
    import jax

    device = jax.devices()[0]
    info = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": [str(d) for d in jax.devices()],
        "versions": {
            p: harness.version(p)
            for p in (
                "jax",
                "jaxlib",
                "jax-cuda13-plugin",
                "jax-cuda12-plugin",
                "keras",
                "grain",
                "torch",
                "optree",
                "numpy",
            )
        },
        "page_locker": page_locker_info(),
        "nvidia_smi": nvidia_smi(),
        "tensorflow_loaded": "tensorflow" in sys.modules,
    }
    torch = _torch()
    if torch is not None:
        info["torch_cuda"] = torch.version.cuda
        info["torch_device"] = torch.cuda.get_device_name(0)
    return info


class Report(harness.Report):
    """The harness's report with the accelerator's description beside the environment."""

    def __init__(self, *args, command: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command
        self.accelerator: dict = {}

    def as_dict(self) -> dict:
        return {**super().as_dict(), "accelerator": self.accelerator}


# ---- shared with torch_gpu.py: the bookkeeping of each part, whatever the framework ----------


def median_time_s(transfer: Callable[[], None], count: int) -> float:
    """The median time of one `transfer()` over `count`, each timed alone."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        transfer()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copies_per_rep(settings: harness.Settings, nbytes: int) -> int:
    """How many copies of `nbytes` each peer makes per repetition: about 1 GiB, 10 to 60."""
    return settings.pick(8, max(10, min(60, (1024 * 2**20) // nbytes)))


def copy_reps(
    settings: harness.Settings, peers: dict[str, Callable[[], None]], nbytes: int, copies: int
) -> list[dict]:
    """Each peer's copy of `nbytes` warmed up (3 copies: the first allocations, the driver's
    first use), then per repetition, peers in rotating order, its GB/s from the median of
    `copies` copies, and each peer's rate over `torch_pinned` where that peer ran."""
    for transfer in peers.values():
        for _ in range(3):
            transfer()
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            values[f"{peer}_gb_s"] = nbytes / median_time_s(peers[peer], copies) / 1e9
        for peer in peers:
            if peer != "torch_pinned" and "torch_pinned_gb_s" in values:
                values[f"{peer}_over_torch_pinned"] = (
                    values[f"{peer}_gb_s"] / values["torch_pinned_gb_s"]
                )
        reps.append(values)
    return reps


def calibrate_repeat(
    build: Callable[[int], object],
    run: Callable[[object, int], float],
    target_s: float,
    tries: int,
) -> tuple[object, int, float]:
    """The step `build(repeat)` whose `repeat` makes it take about `target_s` alone, where
    `run(step, count)` warms the step up and returns the seconds `count` more steps took: a
    probe at 4, then up to `tries - 1` refinements at about the target. Returns the step, its
    `repeat` and its time per step."""
    repeat = 4
    for _ in range(tries):
        step = build(repeat)
        count = max(3, min(20, round(0.5 / max(target_s, 1e-3))))
        step_s = run(step, count) / count
        wanted = max(1, round(repeat * target_s / step_s))
        if abs(wanted - repeat) <= max(1, 0.1 * repeat):
            return step, repeat, step_s
        repeat = wanted
    return build(repeat), repeat, step_s


def rs_reps(
    settings: harness.Settings,
    peers: dict[str, Iterator],
    run: Callable[[Iterator, int], float],
    steps: int,
) -> list[dict]:
    """Per repetition, peers in rotating order, `steps` steps on each peer's batches (`run`
    returns the seconds they took): steps/s, real / synthetic and the synthetic step's ms."""
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            values[f"{peer}_steps_s"] = steps / run(peers[peer], steps)
        values["real_over_synthetic"] = values["real_steps_s"] / values["synthetic_steps_s"]
        values["synthetic_step_ms"] = 1e3 / values["synthetic_steps_s"]
        reps.append(values)
    return reps


RS_TARGETS = {30.0: 0.98, 5.0: 0.98}
"""R/S target by the step's own time, ms: a 5 ms step leaves gathering and copying 27 MiB a
fifth of the time a 30 ms step leaves them, with the same fixed costs per batch."""


def add_rs_case(
    report: harness.Report,
    step_ms: float,
    where: dict,
    *,
    batch: int,
    batch_bytes: int,
    hidden: int,
    repeat: int,
    step_s: float,
    steps: int,
    reps: list[dict],
    feeder,
    before,
    applies: bool,
    why_not: str,
    more_stats: Callable[[object, object], dict] | None = None,
) -> None:
    """Adds the R/S case of a `step_ms` step and its target to `report`, before `feeder`
    closes: `where` names the device, `before` is the feeder's stats before the timed steps,
    and `more_stats(stats, before)` adds what this framework's feeder reports beyond that."""
    stats = feeder.stats()
    copies = stats.copies - before.copies
    copy_s = stats.copy_s - before.copy_s
    staged = max(stats.staged_batches - before.staged_batches, 1)
    stage_ms = {
        stage: (seconds - before.stage_s.get(stage, 0.0)) * 1e3 / staged
        for stage, seconds in stats.stage_s.items()
    }
    description = feeder.describe()
    case = f"real over synthetic, {step_ms:g} ms step"
    report.add_case(
        case,
        {
            **where,
            "global_batch": batch,
            "batch_bytes": batch_bytes,
            "depth": 2,
            "hidden": hidden,
            "repeat": repeat,
            "calibrated_step_ms": step_s * 1e3,
            "steps_per_peer": steps,
            "page_locked": stats.page_locked,
            "page_lock_reason": stats.page_lock_reason,
            "copy_path": description.copy_path,
            "copy_path_reason": description.copy_path_reason,
        },
        reps,
        units={"real_steps_s": "steps/s", "synthetic_steps_s": "steps/s"},
        extra={
            "feeder_stats": {
                "copy_gb_per_s": (
                    (stats.copied_bytes - before.copied_bytes) / copy_s / 1e9 if copy_s else None
                ),
                "copy_ms_per_step": copy_s / copies * 1e3 if copies else None,
                "copies": copies,
                "input_bound_fraction": stats.input_bound_fraction,
                "mean_occupancy": stats.mean_occupancy,
                "stage_ms_per_batch": stage_ms,
                "fences_per_batch": (stats.fences - before.fences) / copies if copies else None,
                **(more_stats(stats, before) if more_stats else {}),
                "summary": str(stats),
            }
        },
    )
    report.target(
        case,
        "real_over_synthetic",
        ">=",
        RS_TARGETS.get(step_ms, 0.95),
        f"R/S at depth 2, {step_ms:g} ms step",
        applies=applies,
        why_not=why_not,
    )


def epoch_metrics(
    peer: str, started: float, ends: list[float], seen: list[int], steps: int, epochs: int
) -> dict:
    """A session's first epoch (from `started`, its input's start-up included) and its steady
    state (the epochs after the first), checked to have run `epochs` epochs of `steps` steps:
    `ends` are the epochs' end times, `seen` their step counts."""
    if len(ends) != epochs or seen != [steps] * epochs:
        raise RuntimeError(f"{peer}: expected {epochs} epochs of {steps} steps, saw steps {seen}")
    return {
        f"{peer}_epoch1_s": ends[0] - started,
        f"{peer}_epoch1_steps_s": steps / (ends[0] - started),
        f"{peer}_steady_steps_s": steps * (epochs - 1) / (ends[-1] - ends[0]),
    }


def session_reps(
    settings: harness.Settings,
    peers: list[str],
    session: Callable[[str], dict],
    ratios: Callable[[dict, list[str]], None],
) -> list[dict]:
    """Per repetition, peers in rotating order, one `session(peer)` each (its `epoch_metrics`),
    then `ratios`, and the cores other processes used meanwhile."""
    reps = []
    for rep in range(settings.reps):
        values: dict = {}
        with harness.OtherLoad() as other:
            for peer in harness.rotate(peers, rep):
                values.update(session(peer))
                print(
                    f"  rep {rep} {peer}: epoch 1 {values[f'{peer}_epoch1_s']:.2f} s, steady "
                    f"{values[f'{peer}_steady_steps_s']:.1f} steps/s",
                    flush=True,
                )
        ratios(values, peers)
        values["other_cores"] = other.cores
        reps.append(values)
    return reps


def session_units(peers: list[str]) -> dict:
    """The units of each peer's `epoch_metrics`."""
    return {
        **{f"{p}_epoch1_s": "s" for p in peers},
        **{f"{p}_{m}_steps_s": "steps/s" for p in peers for m in ("epoch1", "steady")},
    }


def session_params(
    source: ImageSource, batch: int, shape: tuple[int, ...], steps: int, epochs: int, workers: int
) -> dict:
    """What every session of the fit (or train) part ran on."""
    return {
        "global_batch": batch,
        "sample_shape": list(shape),
        "batch_bytes": batch * math.prod(shape) * 4,
        "steps_per_epoch": steps,
        "epochs_per_session": epochs,
        "workers": workers,
        "source": source.as_dict(),
        "source_batch_ms": source.calibrated_s * batch * 1e3,
    }


def feeder_params(stats) -> dict:
    """What the feeder's last session said of its copies and of waiting for input."""
    return {
        "feeder_copy_path": None if stats is None else stats.copy_path,
        "feeder_page_locked": None if stats is None else stats.page_locked,
        "feeder_page_lock_reason": None if stats is None else stats.page_lock_reason,
        "feeder_input_bound_fraction": None if stats is None else stats.input_bound_fraction,
    }


def add_copy_rs_args(parser: argparse.ArgumentParser) -> None:
    """The copy and R/S parts' options."""
    parser.add_argument("--copy-mb", default="2,16,64", help="copy sizes, MiB")
    parser.add_argument(
        "--step-ms", default="30,5", help="R/S: the step's own time, ms (one case each)"
    )
    parser.add_argument("--hidden", type=int, default=4096, help="R/S: hidden units")
    parser.add_argument("--rs-batch", type=int, default=256, help="R/S: global batch")
    parser.add_argument("--rs-batches", type=int, default=8, help="R/S: batches in memory")
    parser.add_argument("--rs-steps", type=int, default=100, help="R/S: timed steps per peer")


def parse_run(
    doc: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    smoke: Callable[[argparse.Namespace], None],
    parts: tuple[str, ...],
    argv,
) -> tuple[harness.Settings, list[str]]:
    """The settings (shrunk by `smoke` under --smoke, --copy-mb and --step-ms as lists) and
    the parts asked for, checked against `parts`."""
    settings = harness.parse_settings(doc, add_args, argv)
    args = settings.args
    if args.smoke:
        smoke(args)
        settings = harness.Settings(args)
    args.copy_mb = [float(v) for v in str(args.copy_mb).split(",")]
    args.step_ms = [float(v) for v in str(args.step_ms).split(",")]
    asked = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(asked) - set(parts)
    if unknown:
        raise SystemExit(f"--parts={args.parts}: unknown {sorted(unknown)}; use {parts}.")
    return settings, asked


def command_line(base: str, args: argparse.Namespace, parts: tuple[str, ...]) -> str:
    """`base` with the options that say which run this was."""
    return (
        base
        + (" --smoke" if args.smoke else "")
        + (f" --parts {args.parts}" if args.parts != ",".join(parts) else "")
    )


# ---- copy: feedpipe's slots against PyTorch's pinned memory ----------------------------------


def _slot_region(nbytes: int, page_lock) -> tuple[object, np.ndarray]:
    """A pooled, shared feedpipe slot of `nbytes` (one float32 field, one row), filled, and its
    region; page-locked by the pool when `page_lock` is a locker."""
    from feedpipe.core.slots import SlotLayout, SlotPool
    from feedpipe.core.sources import SampleSpec
    from feedpipe.core.split import ReplicaSplit

    layout = SlotLayout(SampleSpec.of(np.zeros(nbytes // 4, np.float32)), ReplicaSplit(1, 1))
    pool = SlotPool(layout, 1, shared=True, page_lock=page_lock)
    slot = pool.take(threading.Event())
    region = slot.regions[0][0]
    region[...] = 1.0  # touch every page before anything is timed
    return (pool, slot), region


def copy_engine(region: np.ndarray, device):
    """feedpipe's copy engine for `region`'s layout on `device`, as the JAX feeder makes it, or
    (None, why not)."""
    from feedpipe.core.copy_engine import CopyEngine, cuda_devices
    from feedpipe.core.sources import SampleSpec
    from feedpipe.jax.stage import device_fence

    if device.platform != "gpu":
        return None, f"platform {device.platform}: feedpipe's own copy streams need a CUDA GPU"
    memories, reason = cuda_devices([device.local_hardware_id])
    if memories is None:
        return None, reason
    spec = SampleSpec.of(np.zeros(region.shape[1:], region.dtype))
    return CopyEngine(memories, spec, region.shape[0], 2, [device_fence(device)]), reason


class EngineTransfer:
    """Copies `region` with the engine and imports it, as the JAX feeder stages a batch, timing
    each stage and the staging thread's CPU as the feeder's `stats()` do."""

    def __init__(self, engine, region: np.ndarray, device):
        from feedpipe.core.copy_engine import STAGES

        self.engine, self.device = engine, device
        self.region = region  # alive while its address is copied from
        self.sources = [[(region.ctypes.data, region.nbytes)]]
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self.copies = 0
        self.cpu_s = 0.0
        self.take = None

    def __call__(self) -> None:
        from feedpipe.jax.stage import importer

        cpu = time.thread_time()
        with self.engine.copy(self.sources, self.stage_s) as exports:
            if self.take is None:
                self.take = importer(exports[0][0], self.device)
            array = self.take(exports[0][0], self.device)
        self.cpu_s += time.thread_time() - cpu
        self.copies += 1
        array.block_until_ready()

    def per_copy(self) -> dict:
        """Each stage's mean ms, the fences and the staging thread's CPU ms, per copy."""
        copies = max(self.copies, 1)
        return {
            "engine_stage_ms": {k: v * 1e3 / copies for k, v in self.stage_s.items()},
            "engine_fences_per_copy": self.engine.fences / copies,
            "engine_cpu_ms_per_copy": self.cpu_s * 1e3 / copies,
            "engine_import": getattr(self.take, "__name__", None),
        }


def _jax_transfer(jax, region: np.ndarray, device) -> Callable[[], None]:
    def transfer():
        jax.device_put(region, device).block_until_ready()

    return transfer


def _torch_transfer(torch, tensor) -> Callable[[], None]:
    def transfer():
        tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    return transfer


def run_copy(report: Report, settings: harness.Settings, device, torch) -> None:
    import jax

    from feedpipe.core.pinned import page_locker

    locker = page_locker()
    for mb in settings.args.copy_mb:
        nbytes = int(mb * 2**20)
        locked_owner, locked = _slot_region(nbytes, locker)
        pageable_owner, pageable = _slot_region(nbytes, None)
        pool = locked_owner[0]
        copies = copies_per_rep(settings, nbytes)

        engine, engine_reason = copy_engine(locked, device)
        peers: dict[str, Callable[[], None]] = {
            "slot_locked": _jax_transfer(jax, locked, device),
            "slot_pageable": _jax_transfer(jax, pageable, device),
        }
        if engine is not None:
            peers["engine"] = EngineTransfer(engine, locked, device)
        if torch is not None:
            pinned = torch.ones(nbytes // 4, dtype=torch.float32, pin_memory=True)
            peers["torch_pinned"] = _torch_transfer(torch, pinned)
            peers["torch_slot_locked"] = _torch_transfer(torch, torch.from_numpy(locked))
        reps = copy_reps(settings, peers, nbytes, copies)
        for values in reps:
            values["slot_locked_over_pageable"] = (
                values["slot_locked_gb_s"] / values["slot_pageable_gb_s"]
            )
            if engine is not None:
                values["engine_over_slot_locked"] = (
                    values["engine_gb_s"] / values["slot_locked_gb_s"]
                )
        case = f"copy {mb:g} MiB"
        report.add_case(
            case,
            {
                "bytes": nbytes,
                "copies_per_rep": copies,
                "platform": device.platform,
                "slot_page_locked": bool(pool.page_locked),
                "slot_page_lock_reason": pool.page_lock_reason,
                "page_lock_s": pool.page_lock_s,
                "torch": torch is not None,
                "engine": engine is not None,
                "engine_reason": engine_reason,
                "peers": {
                    "engine": "feedpipe's copy engine (own CUDA stream) + jax.dlpack.from_dlpack",
                    "slot_locked": "jax.device_put from the page-locked slot",
                    "slot_pageable": "jax.device_put from a pageable slot",
                    "torch_pinned": "torch pinned tensor .to('cuda', non_blocking=True)",
                    "torch_slot_locked": "torch.from_numpy(page-locked slot).to('cuda')",
                },
            },
            reps,
            units={f"{peer}_gb_s": "GB/s (1e9 bytes)" for peer in COPY_PEERS},
            extra=peers["engine"].per_copy() if engine is not None else None,
        )
        if engine is not None:
            report.target(
                case,
                "engine_fences_per_copy",
                "<=",
                FENCES_PER_BATCH,
                "fences per copy on the copy engine, over every repetition",
                value=report.cases[-1]["engine_fences_per_copy"],
            )
        if torch is not None:
            report.target(
                case,
                "engine_over_torch_pinned",
                ">=",
                COPY_TARGETS.get(round(mb), 0.9),
                "feedpipe's copy engine from a page-locked slot / torch pinned copy",
                applies=engine is not None,
                why_not=f"no copy engine here: {engine_reason}",
            )
        if engine is not None:
            engine.close()
        del locked_owner, pageable_owner, locked, pageable, peers, engine
        gc.collect()


# ---- busy: a copy issued while a step runs, against one on an idle GPU --------------------


def _time_ready(transfer: Callable[[], None], before: Callable[[], object] | None) -> float:
    """Seconds from issuing `transfer` to its batch being ready; `before` dispatches a step
    first (without waiting) and is waited for after the clock stops."""
    import jax

    running = before() if before is not None else None
    started = time.perf_counter()
    transfer()
    elapsed = time.perf_counter() - started
    if running is not None:
        jax.block_until_ready(running)
    return elapsed


def run_busy(report: Report, settings: harness.Settings, device) -> None:
    """Does a batch's copy wait for the step the device runs? Copy-ready time of one R/S batch
    (27 MiB) issued just after a ~`--step-ms` jitted step was dispatched, over the same copy on
    an idle device, for feedpipe's copy engine and for `jax.device_put`."""
    import jax

    from feedpipe.core.pinned import page_locker

    args = settings.args
    batch = args.rs_batch
    x, y = ImageSource(batch, 0.0).arrays()
    features = math.prod(SAMPLE_SHAPE)
    step, repeat, step_s = calibrate_step(
        features, args.hidden, (x, y), device, settings.seed, args.step_ms[0] / 1e3
    )
    staged = jax.device_put((x, y), device)
    params = [init_params(features, args.hidden, device, settings.seed)]

    def run_step():
        params[0], loss = step(params[0], *staged)
        return loss

    owner, locked = _slot_region(x.nbytes, page_locker())
    locked[...] = x.reshape(locked.shape)
    engine, engine_reason = copy_engine(locked, device)
    peers = {"device_put": _jax_transfer(jax, locked, device)}
    if engine is not None:
        peers["engine"] = EngineTransfer(engine, locked, device)
    tries = settings.pick(5, 15)
    for transfer in peers.values():  # warm-up
        for before in (None, run_step):
            _time_ready(transfer, before)
    reps = []
    for rep in range(settings.reps):
        values = {}
        for peer in harness.rotate(list(peers), rep):
            for phase, before in (("idle", None), ("busy", run_step)):
                times = [_time_ready(peers[peer], before) for _ in range(tries)]
                values[f"{peer}_{phase}_ms"] = statistics.median(times) * 1e3
            values[f"{peer}_busy_over_idle"] = values[f"{peer}_busy_ms"] / values[f"{peer}_idle_ms"]
        reps.append(values)
    case = "copy ready while a step runs"
    report.add_case(
        case,
        {
            "platform": device.platform,
            "bytes": int(locked.nbytes),
            "calibrated_step_ms": step_s * 1e3,
            "repeat": repeat,
            "tries_per_rep": tries,
            "engine": engine is not None,
            "engine_reason": engine_reason,
            "page_locked": bool(owner[0].page_locked),
        },
        reps,
        units={f"{p}_{phase}_ms": "ms" for p in peers for phase in ("idle", "busy")},
    )
    report.target(
        case,
        "engine_busy_over_idle",
        "<=",
        1.5,
        "copy-ready time with a step running / on an idle GPU, feedpipe's copy engine",
        applies=engine is not None,
        why_not=f"no copy engine here: {engine_reason}",
    )
    if engine is not None:
        engine.close()
    del owner, locked, peers, engine
    gc.collect()


# ---- R/S: a real jitted step, fed or on pre-staged batches ---------------------------------


def make_train_step(repeat: int):
    """A jitted SGD step of an MLP whose hidden layer is applied `repeat` times."""
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y):
        h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["w_in"])

        def layer(h, _):
            return jnp.tanh(h @ params["w_hidden"]), None

        h, _ = jax.lax.scan(layer, h, None, length=repeat)
        logits = h @ params["w_out"]
        log_p = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


def init_params(features: int, hidden: int, device, seed: int) -> dict:
    import jax

    rng = np.random.default_rng(seed)
    params = {
        "w_in": rng.standard_normal((features, hidden), np.float32) / np.sqrt(features),
        "w_hidden": rng.standard_normal((hidden, hidden), np.float32) / np.sqrt(hidden),
        "w_out": rng.standard_normal((hidden, NUM_CLASSES), np.float32) / np.sqrt(hidden),
    }
    return jax.device_put(params, device)


def _run_steps(step, params, batches: Iterator, count: int) -> tuple[dict, float]:
    """Dispatches `count` steps on `batches`; seconds until the last one's parameters are ready."""
    import jax

    started = time.perf_counter()
    for _ in range(count):
        x, y = next(batches)
        params, _ = step(params, x, y)
    jax.block_until_ready(params)
    return params, time.perf_counter() - started


def calibrate_step(features, hidden, batch, device, seed, target_s) -> tuple[Callable, int, float]:
    """A step whose `repeat` makes it take about `target_s` alone on `batch`: a probe, then a
    refinement at about the target."""
    import jax

    x, y = jax.device_put(batch, device)

    def run(step, count: int) -> float:
        params = init_params(features, hidden, device, seed)
        params, _ = _run_steps(step, params, itertools.repeat((x, y)), 3)  # compile, warm
        return _run_steps(step, params, itertools.repeat((x, y)), count)[1]

    return calibrate_repeat(make_train_step, run, target_s, tries=3)


def run_rs(report: Report, settings: harness.Settings, device, step_ms: float) -> None:
    import jax

    import feedpipe as fp

    args = settings.args
    batch = args.rs_batch
    x, y = ImageSource(batch * args.rs_batches, 0.0).arrays()
    features = math.prod(SAMPLE_SHAPE)
    step, repeat, step_s = calibrate_step(
        features, args.hidden, (x[:batch], y[:batch]), device, settings.seed, step_ms / 1e3
    )
    print(
        f"R/S: step of {repeat} hidden layers ({args.hidden} units) takes {step_s * 1e3:.1f} ms "
        f"alone on {batch} x {SAMPLE_SHAPE} ({x[:batch].nbytes / 2**20:.1f} MiB a batch)",
        flush=True,
    )
    staged = [
        tuple(jax.device_put((x[i : i + batch], y[i : i + batch]), device))
        for i in range(0, 4 * batch, batch)
    ]
    feeder = fp.Feeder((x, y), batch, devices=[device], depth=2, shuffle=True, seed=settings.seed)
    fed = (b.replicas[0] for b in harness.endless(feeder))
    peers = {"real": fed, "synthetic": itertools.cycle(staged)}
    params = [init_params(features, args.hidden, device, settings.seed)]

    def run(batches: Iterator, count: int) -> float:
        params[0], elapsed = _run_steps(step, params[0], batches, count)
        return elapsed

    for batches in peers.values():
        run(batches, 3)
    steps = settings.pick(args.rs_steps // 4, args.rs_steps)
    before = feeder.stats()
    reps = rs_reps(settings, peers, run, steps)
    add_rs_case(
        report,
        step_ms,
        {"platform": device.platform},
        batch=batch,
        batch_bytes=x[:batch].nbytes + y[:batch].nbytes,
        hidden=args.hidden,
        repeat=repeat,
        step_s=step_s,
        steps=steps,
        reps=reps,
        feeder=feeder,
        before=before,
        applies=device.platform == "gpu",
        why_not=f"platform {device.platform}: the step and the feeder share the CPU",
        more_stats=lambda stats, before: {
            "device_blocks": stats.device_blocks,
            "fence_wait_s": stats.fence_wait_s - before.fence_wait_s,
        },
    )
    feeder.close()


# ---- fit: Keras 3 on JAX from a Python source --------------------------------------------------


def convnet(shape: tuple[int, ...], seed: int):
    """The fit part's model, the same initial weights for a given seed. (Seeded per layer:
    `keras.utils.set_random_seed` would import TensorFlow wherever it is installed.)"""
    import keras

    def init(layer: int):
        return keras.initializers.GlorotUniform(seed=seed * 100 + layer)

    inputs = keras.Input(shape)
    h = inputs
    for layer, width in enumerate(CONV_WIDTHS):
        h = keras.layers.Conv2D(
            width, 3, strides=2, padding="same", activation="relu", kernel_initializer=init(layer)
        )(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(len(CONV_WIDTHS)))(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def pydataset(source: ImageSource, batch: int, workers: int):
    """A `keras.utils.PyDataset` whose batch `i` stacks samples `i*batch ...` of `source`."""
    import keras

    class SourceBatches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=max(workers, 1), use_multiprocessing=workers > 0)

        def __len__(self):
            return len(source) // batch

        def __getitem__(self, number):
            return make_batch(source, number, batch)

    return SourceBatches()


def grain_dataset(source: ImageSource, batch: int, workers: int):
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():
        # Grain reads its absl flags when it starts workers; outside `absl.app.run` (and
        # without TensorFlow, whose import parses them) nobody has: take their defaults.
        flags.FLAGS.mark_as_parsed()

    dataset = grain.MapDataset.source(source).batch(batch, drop_remainder=True).to_iter_dataset()
    if workers:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return dataset


def have_grain() -> bool:
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


def feeder_input(source: ImageSource, batch: int, workers: int, seed: int):
    import jax

    import feedpipe as fp

    return fp.Feeder(source, batch, devices=jax.devices()[:1], workers=workers, seed=seed)


def make_clock():
    """A callback that reads the wall clock at the end of every step and every epoch."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_ends: list[float] = []
            self.steps: list[int] = []

        def on_epoch_begin(self, epoch, logs=None):
            self.steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.steps[-1] += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append(time.perf_counter())

    return Clock()


class FitPeers:
    """Builds each peer's input, fits the model on it, and tears it down."""

    def __init__(self, model, source: ImageSource, arrays, batch: int, workers: int, seed: int):
        self.model = model
        self.source = source
        self.arrays = arrays
        self.batch = batch
        self.workers = workers
        self.seed = seed
        self.feeder_stats: list = []

    def fit(self, peer: str, epochs: int, source: ImageSource | None = None, workers=None):
        """One `fit` of `epochs` on `peer`'s input built now; (start, Clock)."""
        source = self.source if source is None else source
        workers = self.workers if workers is None else workers
        clock = make_clock()
        callbacks = [clock]
        started = time.perf_counter()
        closing = None
        if peer == "ceiling":
            with feeder_input(source, self.batch, workers, self.seed) as data:
                for epoch in range(epochs):
                    clock.on_epoch_begin(epoch)
                    for batch in data:
                        del batch
                        clock.on_train_batch_end(0)
                    clock.on_epoch_end(epoch)
        elif peer == "arrays":
            count = len(source) // self.batch * self.batch
            x, y = self.arrays
            self.model.fit(
                x[:count],
                y[:count],
                batch_size=self.batch,
                epochs=epochs,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        else:
            if peer == "feedpipe":
                data = feeder_input(source, self.batch, workers, self.seed)
                callbacks.insert(0, data.fit_callback())
                closing = data.close
            elif peer == "pydataset":
                data = pydataset(source, self.batch, workers)
            elif peer == "grain":
                data = grain_dataset(source, self.batch, workers)
            else:
                raise ValueError(peer)
            try:
                self.model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
            finally:
                if peer == "feedpipe":
                    self.feeder_stats.append(data.stats())
                if closing is not None:
                    closing()
                del data
                gc.collect()
        return started, clock

    def session(self, peer: str, epochs: int) -> dict:
        """One timed `fit` of `epochs` on `peer`'s input: its `epoch_metrics`, and how many
        times the model's train step was compiled during it (`<peer>_compiles`)."""
        with train_step_compilations() as compiled:
            started, clock = self.fit(peer, epochs)
        steps = len(self.source) // self.batch
        metrics = epoch_metrics(peer, started, clock.epoch_ends, clock.steps, steps, epochs)
        return {**metrics, f"{peer}_compiles": len(compiled)}

    def warm_up(self, peers) -> None:
        """One untimed fit per peer over 2 batches: compiles the step for each input structure
        and pays each kind of input's one-off imports."""
        small = self.source.prefix(2 * self.batch)
        for peer in peers:
            self.fit(peer, 1, source=small, workers=min(self.workers, 1))


@contextlib.contextmanager
def train_step_compilations() -> Iterator[list[float]]:
    """The seconds of each XLA compilation of a Keras train step made inside, as a list (JAX
    records every compilation as an event with the function's name)."""
    import jax

    compiled: list[float] = []

    def listen(event: str, duration_s: float, **details) -> None:
        if event == COMPILE_EVENT and details.get("fun_name") == "jit(train_step)":
            compiled.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def fit_ratios(values: dict, peers: list[str]) -> None:
    for phase in ("steady", "epoch1"):
        for peer in peers:
            if peer != "arrays":
                values[f"{peer}_over_arrays_{phase}"] = (
                    values[f"{peer}_{phase}_steps_s"] / values[f"arrays_{phase}_steps_s"]
                )
            if peer not in ("arrays", "feedpipe") and "feedpipe" in peers:
                values[f"feedpipe_over_{peer}_{phase}"] = (
                    values[f"feedpipe_{phase}_steps_s"] / values[f"{peer}_{phase}_steps_s"]
                )
    if "feedpipe" in peers:
        values["feedpipe_epoch1_s_over_arrays"] = (
            values["feedpipe_epoch1_s"] / values["arrays_epoch1_s"]
        )
    if "ceiling" in peers:
        bound = min(values["arrays_steady_steps_s"], values["ceiling_steady_steps_s"])
        values["feedpipe_over_bound_steady"] = values["feedpipe_steady_steps_s"] / bound


def run_fit_comparison(
    report: harness.Report,
    settings: harness.Settings,
    *,
    case: str,
    shape: tuple[int, ...],
    batch: int,
    steps: int,
    epochs: int,
    workers: int,
    sample_s: float | Callable[[float], float],
    peers: list[str] | None = None,
) -> dict:
    """Keras 3 on JAX: `fit` of one model on each peer's input, in rotating order per
    repetition, and the feeder's producers alone (`ceiling`: the same feeder iterated with no
    model); adds `case` to `report` and returns its params. `sample_s` may be a function of
    the step's own time on arrays (seconds), measured after warm-up."""
    import keras

    if epochs < 2:
        raise SystemExit(f"--epochs={epochs}: the steady state is the epochs after the first.")
    peers = list(peers or FIT_PEERS)
    if "feedpipe" in peers:
        peers.append("ceiling")
    if "grain" in peers and not have_grain():
        peers.remove("grain")
        report.note(f"{case}: Grain is not installed here; its peer was left out.")
    model = convnet(shape, settings.seed)
    length = batch * steps
    images = ImageSource(length, 0.0, shape)
    arrays = images.arrays()
    fitting = FitPeers(model, images, arrays, batch, workers, settings.seed)
    fitting.warm_up(["arrays"])
    _, clock = fitting.fit("arrays", 2)
    step_s = (clock.epoch_ends[1] - clock.epoch_ends[0]) / steps
    per_sample = sample_s(step_s) if callable(sample_s) else sample_s
    source = ImageSource(length, per_sample, shape)
    fitting.source = source
    print(
        f"fit: step on arrays {step_s * 1e3:.1f} ms; source {source.calibrated_s * batch * 1e3:.1f}"
        f" ms of CPU per batch of {batch} x {shape}, {workers} workers, {steps} steps x {epochs}"
        f" epochs; peers {', '.join(peers)}",
        flush=True,
    )
    fitting.warm_up(peers)
    reps = session_reps(settings, peers, lambda peer: fitting.session(peer, epochs), fit_ratios)
    stats = fitting.feeder_stats[-1] if fitting.feeder_stats else None
    params = {
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "model": f"convnet {list(CONV_WIDTHS)} stride 2, global pool, dense {NUM_CLASSES}",
        **session_params(source, batch, shape, steps, epochs, workers),
        "arrays_step_ms": step_s * 1e3,
        "source_serial_over_step": source.calibrated_s * batch / step_s,
        "peers": {
            "arrays": "model.fit(x, y, batch_size=B, shuffle=False)",
            "feedpipe": (
                f"model.fit(fp.Feeder(source, B, devices=jax.devices()[:1], workers={workers}),"
                " callbacks=[feeder.fit_callback()])"
            ),
            "pydataset": f"keras.utils.PyDataset(workers={workers}, use_multiprocessing=True)",
            "grain": (
                "grain.MapDataset.source(source).batch(B).to_iter_dataset().mp_prefetch("
                f"grain.MultiprocessingOptions(num_workers={workers}))"
                if "grain" in peers
                else "not installed or not asked for: left out"
            ),
            "ceiling": "the same feeder iterated with no model: the producers' own rate",
        },
        **feeder_params(stats),
    }
    report.add_case(case, params, reps, units=session_units(peers))
    return params


def fit_peers(text: str) -> list[str]:
    """The peers named in `text` ("arrays,feedpipe,..."), checked; `arrays` always runs."""
    named = [p.strip() for p in text.split(",") if p.strip()]
    unknown = set(named) - set(FIT_PEERS)
    if unknown:
        raise SystemExit(f"--fit-peers={text}: unknown {sorted(unknown)}; use {FIT_PEERS}.")
    return [p for p in FIT_PEERS if p in named or p == "arrays"]


def run_fit(report: Report, settings: harness.Settings) -> None:
    import jax

    args = settings.args
    platform = jax.devices()[0].platform
    applies = platform == "gpu" and not args.smoke
    why_not = f"platform {platform}{' (--smoke)' if args.smoke else ''}: reported only"
    cases = [
        # (case, CPU per batch ms, peers, the metric, its threshold, what it says)
        (
            "keras jax fit",
            args.batch_ms,
            fit_peers(args.fit_peers),
            "feedpipe_over_bound_steady",
            0.9,
            "fit(feeder) / min(fit(x, y), the feeder alone), steady state",
        ),
        (
            "keras jax fit, fast source",
            args.fast_batch_ms,
            ["arrays", "feedpipe"],
            "feedpipe_over_arrays_steady",
            0.95,
            "fit(feeder) / fit(x, y), steady state, a source its workers can run ahead of",
        ),
    ]
    for case, batch_ms, peers, metric, threshold, label in cases:
        if not batch_ms:
            continue
        run_fit_comparison(
            report,
            settings,
            case=case,
            shape=SAMPLE_SHAPE,
            batch=args.batch,
            steps=args.steps,
            epochs=args.epochs,
            workers=args.workers,
            sample_s=batch_ms / 1e3 / args.batch,
            peers=peers,
        )
        report.target(case, metric, ">=", threshold, label, applies=applies, why_not=why_not)
        if case == "keras jax fit, fast source":
            target_second_fit(report, case, applies=applies, why_not=why_not)


def target_second_fit(report: Report, case: str, **applies) -> None:
    """The target of a `fit(feeder)` that is not the process's first (every timed one: the
    warm-up fitted first): its first epoch, start-up included, within 1.2x fit(x, y)'s."""
    report.target(
        case,
        "feedpipe_epoch1_s_over_arrays",
        "<=",
        1.2,
        "a second fit(feeder) in the process, first epoch (start-up included) / fit(x, y)'s",
        **applies,
    )


# ---- the command ------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke", action="store_true", help="tiny everything, CPU JAX, < 2 minutes (a check)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="any of copy,rs,fit")
    add_copy_rs_args(parser)
    parser.add_argument("--batch", type=int, default=256, help="fit: global batch")
    parser.add_argument("--steps", type=int, default=48, help="fit: steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="fit: epochs per session")
    parser.add_argument("--workers", type=int, default=8, help="fit: worker processes")
    parser.add_argument(
        "--fit-peers", default=",".join(FIT_PEERS), help="fit: the peers beside fit(x, y)"
    )
    parser.add_argument(
        "--batch-ms", type=float, default=34.0, help="fit: the source's CPU per batch"
    )
    parser.add_argument(
        "--fast-batch-ms",
        type=float,
        default=10.0,
        help="fit, second case (arrays and feedpipe): a source the workers outrun; 0: skip",
    )


def smoke(args: argparse.Namespace) -> None:
    """Shrinks every part to run on CPU JAX in under 2 minutes."""
    args.quick = True
    args.copy_mb = "2,16"
    args.step_ms = "20"
    args.fast_batch_ms = 0.0
    args.hidden = 256
    args.rs_batch = 32
    args.rs_batches = 4
    args.rs_steps = 60
    args.batch = 32
    args.steps = 6
    args.epochs = 2
    args.workers = 2


def main(argv=None) -> None:
    configure_environment()
    settings, parts = parse_run(__doc__, add_args, smoke, PARTS, argv)
    args = settings.args

    import jax

    device = jax.devices()[0]
    report = Report(
        "gpu_smoke" if args.smoke else "gpu",
        "copy rate of feedpipe's copy engine from its slots / torch pinned, copy-ready time "
        "with a step running / idle, R/S of a jitted step at depth 2 (30 and 5 ms), and "
        "Keras 3 JAX fit(feeder) / min(fit(arrays), the feeder alone) beside PyDataset and "
        "Grain, on one accelerator",
        settings,
        "kernels_bench.gpu",
        command=command_line("KERAS_BACKEND=jax python -m kernels_bench.gpu", args, PARTS),
    )
    print(f"device: {device.device_kind} ({device.platform}); parts: {', '.join(parts)}")
    if device.platform != "gpu":
        report.note(
            f"Run on {device.platform} ({device.device_kind}), not a GPU: every figure checks "
            "that the script works; none is a GPU figure. On a CPU device jax.device_put may "
            "wrap host memory instead of copying it, so the copy case's GB/s are not copy rates."
        )
    if "copy" in parts:
        # The slots are page-locked by the locker a JAX-only process finds: looked for before
        # PyTorch (optional) loads its own CUDA runtime.
        from feedpipe.core.pinned import page_locker

        page_locker()
        torch = _torch()
        if torch is None:
            report.note(
                "copy: no PyTorch with CUDA in this environment, so no pinned-copy ceiling was "
                "measured and the target (the copy engine from a page-locked slot / torch "
                "pinned) was not taken."
            )
        run_copy(report, settings, device, torch)
    report.accelerator = accelerator()
    if "busy" in parts:
        run_busy(report, settings, device)
    if "rs" in parts:
        for step_ms in args.step_ms:
            run_rs(report, settings, device, step_ms)
    if "fit" in parts:
        run_fit(report, settings)
    report.note(
        "Each ratio is taken within one repetition (peers in rotating order), then the median "
        "over repetitions. copy: each copy timed alone to block_until_ready / synchronize, the "
        "median per repetition; GB/s are 1e9 bytes. busy: the copy issued just after a step "
        "was dispatched, timed to its batch being ready, median of the tries per repetition. "
        "R/S: steps dispatched without waiting, the "
        "clock stopped when the last parameters are ready; the feeder's stats are over the "
        "timed steps. fit: one model, compiled for each input structure before the "
        "repetitions; each peer's input built inside the timed call; epoch 1 includes its "
        "start-up; steady = the epochs after the first."
    )
    report.finish(
        columns=[
            "engine_gb_s",
            "slot_locked_gb_s",
            "torch_pinned_gb_s",
            "engine_over_torch_pinned",
            "slot_locked_over_torch_pinned",
            "engine_busy_over_idle",
            "device_put_busy_over_idle",
            "real_over_synthetic",
            "synthetic_step_ms",
            "feedpipe_over_bound_steady",
            "feedpipe_over_arrays_steady",
            "feedpipe_over_pydataset_steady",
            "feedpipe_over_grain_steady",
            "feedpipe_over_arrays_epoch1",
            "feedpipe_over_pydataset_epoch1",
            "feedpipe_over_grain_epoch1",
        ]
    )


if __name__ == "__main__":
    main()
