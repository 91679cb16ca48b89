"""Stage: puts each replica's rows on its PyTorch device.

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
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from feedpipe.core._sync import poll_then_sleep
from feedpipe.core.copy_engine import LinkRate
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout
from feedpipe.core.stage import Imported, MaskCache
from feedpipe.torch.batch import Batch

if TYPE_CHECKING:
    from feedpipe.torch.layer import TorchLayer


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
