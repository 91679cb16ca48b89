"""Stage: puts each replica's rows on its TensorFlow device.

A replica's region of a host slot is handed to TensorFlow through DLPack, which wraps the
memory without copying, and is then placed on the replica's device: on a GPU that is the one
host-to-device copy; on a CPU device it is free. The slot stays leased until every tensor made
from it is gone (see `feedpipe.core.slots`).

A source whose outputs already sit in memory of their own (DALI's, on the host or a GPU) hands
them over as `Imported`: DLPack wraps them where they are, so a GPU output is never copied
through host memory and a host output is never copied at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from feedpipe._internals.tf import copy_to_device
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import HostShare
from feedpipe.core.stage import Imported, MaskCache, refuse_unstageable
from feedpipe.tf.batch import Batch

_DLPACK_KINDS = frozenset("biufc")
"""dtype kinds DLPack carries; others (bfloat16, float8) travel as unsigned ints of their width."""


def to_device(array: np.ndarray, device: str) -> tf.Tensor:
    """A tensor on `device` over `array`'s memory: zero-copy on the host, one copy to a GPU."""
    if array.dtype.kind not in _DLPACK_KINDS:
        carrier = array.view(f"u{array.dtype.itemsize}")
        with tf.device(device):
            return tf.bitcast(to_device(carrier, device), tf.as_dtype(array.dtype))
    return copy_to_device(tf.experimental.dlpack.from_dlpack(array.__dlpack__()), device)


def check_stageable(spec: SampleSpec, device: str) -> None:
    """Refuses, at construction, a field TensorFlow cannot hold, naming it and the fix,
    instead of failing at the first batch."""
    for leaf in spec.leaves:
        if not leaf.dtype.isnative:
            raise TypeError(
                f"Field {leaf.name} has the non-native byte order of dtype {leaf.dtype.str}; "
                "TensorFlow takes native byte order only: convert it once, e.g. "
                f"array.astype(array.dtype.newbyteorder('=')), or in `transform`."
            )
    refuse_unstageable(spec, "TensorFlow", device, lambda array: to_device(array, device))


def import_to_device(tensor: Any, device: str) -> tf.Tensor:
    """A tensor on `device` over the memory of `tensor`, any object that speaks DLPack: no copy
    where it already sits on `device` (or on a CPU device, for a CPU device)."""
    imported = tf.experimental.dlpack.from_dlpack(tensor.__dlpack__())
    return imported if imported.device == device else copy_to_device(imported, device)


class Stager:
    """Turns filled host slots into `Batch`es whose tensors sit on each replica's device."""

    def __init__(
        self,
        devices: Sequence[str],
        layout: SlotLayout,
        strategy=None,
        share: HostShare | None = None,
    ):
        self.devices = tuple(devices)
        self.layout = layout
        self.strategy = strategy
        self.share = share or HostShare(layout.split.global_batch_size, 1, 0, len(self.devices))
        self.masks = MaskCache(len(self.devices), layout.split.per_replica, self._place_masks)
        """Per-device masks of a step's real rows."""

    def _place_masks(self, parts: np.ndarray) -> tuple[tf.Tensor, ...]:
        masks = []
        for device, part in zip(self.devices, parts, strict=True):
            with tf.device(device):
                masks.append(tf.constant(part))
        return tuple(masks)

    def stage(self, step: Step, leased: np.ndarray | Imported) -> Batch:
        """The batch in the `leased` bytes of a slot (or `Imported`), placed on the devices."""
        unflatten = self.layout.spec.unflatten
        if isinstance(leased, Imported):
            per_replica, place = leased.replicas, import_to_device
        else:
            per_replica, place = self.layout.views(leased), to_device
        replicas = tuple(
            unflatten([place(region, device) for region in regions])
            for device, regions in zip(self.devices, per_replica, strict=True)
        )
        return Batch(
            replicas,
            self.masks(step),
            step.num_valid,
            step.epoch,
            step.index,
            self.strategy,
            self.share,
        )
