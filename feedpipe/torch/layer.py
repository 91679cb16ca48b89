"""The PyTorch layer: what the core needs from PyTorch to stage batches.

Devices are `torch.device`s (or strings such as "cuda:0" with `framework="torch"`). PyTorch
trains one device per process (`DistributedDataParallel`), so the default is this process's
device: under `torch.distributed` each process is a host of the core's split, and stages its
rank's rows of every global batch, in the order every layer shares.

On a CUDA device each replica's regions of a page-locked slot are copied by torch's own
`copy_(non_blocking=True)` on a stream of the feeder's own per device, beside the running step.
The staging thread waits for an event recorded after its own copies (never for the step),
polling it for about the copy's time, then sleeping on it; then the slot returns. The
consumer's stream waits on that event as the batch is handed over (`Batch.handed_over`), which
also tells torch's caching allocator that the consumer's stream reads the memory, so that it is
not given to a later copy while a step still reads it.

On the CPU each replica's rows are the slot's memory itself (`torch.from_numpy`, no copy): a
tensor keeps its lease, and the slot returns when the last tensor made from it is freed, which
PyTorch does at once (reference counting).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from feedpipe.core._sync import poll_then_sleep
from feedpipe.core.agreement import Tally
from feedpipe.core.copy_engine import NO_COPY, CopyPath, LinkRate
from feedpipe.core.pinned import page_locker
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout
from feedpipe.core.source import SampleSpec
from feedpipe.core.split import HostShare
from feedpipe.core.stage import Imported, MaskCache, refuse_unstageable
from feedpipe.torch import agreement
from feedpipe.torch.batch import Batch

OWN_STREAM = "torch stream"
"""`CopyPath.name` where torch copies on a CUDA stream of the feeder's own."""


_CARRIERS = {1: np.uint8, 2: np.int16}
"""The integer dtype of each width that carries a float's bits where torch.from_numpy refuses
the float's own numpy dtype."""


@functools.cache
def _carried(dtype: np.dtype) -> tuple[np.dtype, torch.dtype] | None:
    """For ml_dtypes' floats that torch holds too (bfloat16, float8_e4m3fn, float8_e5m2, ...)
    but `torch.from_numpy` refuses: the integer dtype their bits cross as and torch's dtype of
    the same name. None for every other dtype (torch's int4 packs two values a byte, where
    ml_dtypes' takes one)."""
    floats = dtype.name == "bfloat16" or dtype.name.startswith("float8")
    if dtype.type.__module__ != "ml_dtypes" or not floats:
        return None
    theirs = getattr(torch, dtype.name, None)
    carrier = _CARRIERS.get(dtype.itemsize)
    if not isinstance(theirs, torch.dtype) or theirs.itemsize != dtype.itemsize or not carrier:
        return None
    return np.dtype(carrier), theirs


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """`torch.from_numpy(array)`, over the same memory, for ml_dtypes' bfloat16 and float8
    fields too (see `_carried`): each arrives as torch's dtype of that name."""
    carried = _carried(array.dtype)
    if carried is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(carried[0])).view(carried[1])


def _world() -> tuple[int, int]:
    """This process's rank and the number of processes under `torch.distributed` (0 and 1
    where it is not initialized).

    A process that `torchrun` started as one of several (`WORLD_SIZE` > 1) but whose process
    group is not initialized yet is refused: its feeder would be a one-process feeder, so
    every process would feed every sample, and nothing would fail (as `DistributedSampler`
    refuses to guess a rank).
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"This process is one of WORLD_SIZE={launched} (as torchrun starts them), but "
            "torch.distributed is not initialized in it: its feeder would feed every sample "
            "to every process. Call torch.distributed.init_process_group() before building "
            "the feeder."
        )
    return 0, 1


def _default_device() -> torch.device:
    """This process's device: its GPU (`LOCAL_RANK`, as `torchrun` sets it, where the process
    sees that many GPUs; else the current CUDA device, as where a scheduler shows each process
    its own GPU alone), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def _counted(kind: str) -> int | None:
    """How many devices of `kind` ("cuda", "mps", "xpu") this process sees, where torch has a
    module that counts them; None where it has none (then a copy onto one tells)."""
    module = getattr(torch, kind, None)
    if not hasattr(module, "is_available") or not hasattr(module, "device_count"):
        return None
    return module.device_count() if module.is_available() else 0


def _refuse_absent(given: Any, device: torch.device) -> None:
    """Refuses `device` (as `given`) where this process has no such device, naming the devices
    it has: a copy onto it would fail at construction as if the field's dtype were at fault."""
    count = _counted(device.type)
    if count is None or (count and (device.index or 0) < count):
        return
    if count:
        kind = "CUDA" if device.type == "cuda" else device.type
        why = f"PyTorch sees {count} {kind} device{'s' if count > 1 else ''}"
    elif device.type == "cuda" and torch.version.cuda is None:
        why = "this PyTorch is built without CUDA"
    elif device.type == "cuda":
        why = (
            "PyTorch sees no CUDA device (torch.cuda.is_available() is False: no NVIDIA "
            "driver, or no GPU visible to this process, see CUDA_VISIBLE_DEVICES)"
        )
    else:
        why = f"PyTorch sees no {device.type} device (torch.{device.type}.is_available() is False)"
    present = ["cpu"] + [
        f"{kind}:{index}" for kind in ("cuda", "mps", "xpu") for index in range(_counted(kind) or 0)
    ]
    raise ValueError(
        f"`devices` names {given!r}, which is not a device of this process: {why}; the devices "
        f"are {', '.join(present)}. Leave `devices` unset for this process's device."
    )


def resolve_devices(devices: Any) -> tuple[torch.device, ...]:
    """The replica devices, as `torch.device`s with their index: `devices` given, else this
    process's one device. The CPU may be listed more than once (several replicas on the host,
    as tests and tower-style steps run); an accelerator only once."""
    if devices is None:
        return (_default_device(),)
    if isinstance(devices, (str, torch.device)):
        raise TypeError(
            f"`devices`={devices!r} must be a list of devices, e.g. [torch.device('cuda:0')] "
            "or ['cuda:0', 'cuda:1']."
        )
    resolved = []
    for device in devices:
        try:
            one = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"`devices` holds {device!r}, which is not a PyTorch device ({error}); pass "
                "torch.device objects or strings such as 'cuda:0' or 'cpu'."
            ) from error
        _refuse_absent(device, one)
        if one.type == "cuda" and one.index is None:
            one = torch.device("cuda", torch.cuda.current_device())
        resolved.append(one)
    if not resolved:
        raise ValueError("`devices` is empty; pass [torch.device('cuda:0')] or ['cpu'].")
    accelerators = [d for d in resolved if d.type != "cpu"]
    if len(set(accelerators)) != len(accelerators):
        raise ValueError(f"`devices`={resolved} names a device twice; list each GPU once.")
    if 0 < len(accelerators) < len(resolved):
        raise ValueError(
            f"`devices`={resolved} mixes the CPU with accelerators; stage on one kind."
        )
    return tuple(resolved)


class TorchLayer:
    """Stages on PyTorch devices: this process's, under `torch.distributed` one share of each
    global batch per process (rank order)."""

    name = "torch"

    def __init__(self, devices: Any, strategy: Any, global_batch_size: int):
        if strategy is not None:
            raise TypeError(
                f"`strategy`={strategy!r} is TensorFlow's; a PyTorch feeder takes its devices "
                "(devices=[torch.device('cuda:0')]) and, with several processes, its rank from "
                "torch.distributed."
            )
        self.devices = resolve_devices(devices)
        self.rank, self.world_size = _world()
        self.share = HostShare(global_batch_size, self.world_size, self.rank, len(self.devices))
        self.cuda = all(d.type == "cuda" for d in self.devices)
        """Whether every device is a CUDA GPU: copies then run on streams of the feeder's own."""
        self.accelerated = any(d.type != "cpu" for d in self.devices)
        self.page_lock = page_locker() if self.accelerated else None
        if self.cuda:
            self.copy_path = CopyPath(
                OWN_STREAM,
                "each replica's rows are copied from a page-locked slot on a CUDA stream of the "
                "feeder's own; the step's stream waits only for its own batch's copy",
            )
        elif self.accelerated:
            self.copy_path = CopyPath(
                "tensor.to", f"the devices are {self.devices[0].type}: torch copies in order"
            )
        else:
            self.copy_path = NO_COPY

    def check_stageable(self, spec: SampleSpec, values: Sequence[np.ndarray] | None) -> SampleSpec:
        """Refuses a field PyTorch cannot hold (float128, ml_dtypes' int4); PyTorch keeps every
        dtype it takes, ml_dtypes' bfloat16 and float8 included (`from_numpy`), so the fields
        arrive as they are (`values` is not read)."""
        device = self.devices[0]
        refuse_unstageable(spec, "PyTorch", device, lambda a: from_numpy(a).to(device))
        return spec

    def tally(self, payload: bytes) -> Tally:
        """Every rank's `payload` compared with rank 0's, through the process group's store
        (`feedpipe.torch.agreement`)."""
        return agreement.tally(self.rank, self.world_size, payload)

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        stats.copy_path = self.copy_path.name
        return Stager(self, layout, stats)

    def close(self) -> None:
        """Torch's allocator owns the device memory: nothing to let go of."""


class Stager:
    """Turns filled host slots into `Batch`es whose tensors sit on each replica's device."""

    def __init__(self, layer: TorchLayer, layout: SlotLayout, stats: StatsRecorder):
        self.layer = layer
        self.layout = layout
        self.stats = stats
        self.streams = (
            [torch.cuda.Stream(device) for device in layer.devices] if layer.cuda else None
        )
        """Each CUDA device's copy stream, the feeder's own."""
        self.masks = MaskCache(len(layer.devices), layout.split.per_replica, self._place_masks)
        self.link = LinkRate()
        """The copies' rate so far: how long a wait polls before it sleeps."""
        self.replica_bytes = layout.spec.row_bytes * layout.split.per_replica
        """Bytes each device's copy moves a batch."""

    def _place_masks(self, parts: np.ndarray) -> tuple[torch.Tensor, ...]:
        """A pattern's masks, made once and kept, each batch given copies of its own (see
        `Batch`); on CUDA copied on the feeder's own streams (a copy on the default stream
        would wait for every step queued there)."""
        devices = self.layer.devices
        if self.streams is None:
            return tuple(
                torch.from_numpy(p.copy()).to(d) for p, d in zip(parts, devices, strict=True)
            )
        masks = []
        for part, device, stream in zip(parts, devices, self.streams, strict=True):
            with torch.cuda.stream(stream):
                masks.append(torch.from_numpy(part.copy()).to(device, non_blocking=True))
        for stream in self.streams:
            stream.synchronize()  # its own copies alone: the part's host memory is then free
        return tuple(masks)

    def stage(self, step: Step, leased: np.ndarray | Imported) -> Batch:
        """The batch in the `leased` bytes of a slot, placed on the devices; returns once the
        copies are done (on CUDA: its own copies, on its own streams)."""
        if isinstance(leased, Imported):
            raise TypeError(
                "A PyTorch feeder stages from host slots; DALI outputs go to TensorFlow."
            )
        unflatten = self.layout.spec.unflatten
        views = self.layout.views(leased)
        pattern = self.masks(step)
        copies = None
        if self.streams is not None:  # each mask copied on its device's stream too
            placed, masks, copies = self._copy_on_own_streams(views, pattern)
        else:
            masks = tuple(mask.clone() for mask in pattern)
            if self.layer.accelerated:
                started = time.perf_counter()
                placed = [
                    [from_numpy(region).to(device) for region in regions]
                    for device, regions in zip(self.layer.devices, views, strict=True)
                ]
                copied = time.perf_counter() - started
                self.stats.stage_s["copy waited"] += copied  # issued and waited in one call
                self.stats.copied(self.layout.batch_bytes, copied)
            else:
                placed = [[from_numpy(region) for region in regions] for regions in views]
        replicas = tuple(unflatten(tensors) for tensors in placed)
        return Batch(replicas, masks, step.num_valid, step.epoch, step.index, copies)

    def _copy_on_own_streams(self, views: list, pattern: tuple) -> tuple[list, tuple, list]:
        """Each replica's regions, and a copy of its mask of `pattern` (a bool per row),
        copied on its device's stream; waits for those copies alone."""
        stage_s = self.stats.stage_s
        started = time.perf_counter()
        placed, masks, copies = [], [], []
        for device, stream, regions, mask in zip(
            self.layer.devices, self.streams, views, pattern, strict=True
        ):
            with torch.cuda.stream(stream):
                placed.append(
                    [from_numpy(region).to(device, non_blocking=True) for region in regions]
                )
                masks.append(mask.clone())
            event = torch.cuda.Event(blocking=True)  # a wait past the poll sleeps
            event.record(stream)
            copies.append((device, event))
        issued = time.perf_counter()
        poll_s = self.link.expected_s(self.replica_bytes)
        for _, event in copies:  # the slot's bytes are read: it may return to the pool
            poll_then_sleep(event.query, event.synchronize, poll_s)
        copied = time.perf_counter()
        self.link.observed(self.replica_bytes, copied - started)
        stage_s["copy issued"] += issued - started
        stage_s["copy waited"] += copied - issued
        self.stats.copied(self.layout.batch_bytes, copied - started)
        return placed, tuple(masks), copies
