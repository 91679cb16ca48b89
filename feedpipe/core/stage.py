"""Stage: the few operations a framework provides to put batches on its devices, and the host
stager every framework shares.

A framework layer (`feedpipe.tf`, `feedpipe.jax`) is a `Layer`: it names this host's replica
devices and its share of each global batch, refuses fields it cannot hold, and makes a `Stager`
that turns a filled host slot into the batch its training step takes, placed on each device
asynchronously. Everything before that (source, order, producers, slots, state) is the core's.

A source whose outputs already sit in memory of their own (DALI's, on the host or a GPU) hands
them over as `Imported` instead of a slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from feedpipe.core.copy_engine import CopyPath
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout
from feedpipe.core.source import SampleSpec
from feedpipe.core.split import HostShare
from feedpipe.core.stats import StatsRecorder

_DLPACK_CPU = 1
"""DLPack's device type of host memory (kDLCPU)."""


class Staged(Protocol):
    """What a stager makes of one step: the consumer reads these, the hand-off counts them."""

    num_valid: int
    epoch: int
    step: int


class Stager(Protocol):
    """Turns a leased host slot (or `Imported` memory) into the batch the consumer takes."""

    def stage(self, step: Step, leased: np.ndarray | Imported) -> Staged:
        """The batch of `step`, from bytes leased until every array made of them is gone."""


class Layer(Protocol):
    """What a framework provides to stage batches on its devices."""

    name: str
    """The framework's name, as `fp.Feeder(framework=...)` takes it."""
    devices: tuple[Any, ...]
    """This host's replica devices, in replica order."""
    share: HostShare
    """This host's rows of each global batch."""
    page_lock: Any
    """A `feedpipe.core.pinned` locker for host slots copied to an accelerator, or None."""
    copy_path: CopyPath
    """How batches cross from their host slots to the devices, and why that way."""

    def check_stageable(self, spec: SampleSpec) -> None:
        """Refuses, at construction, a field the framework cannot hold, naming it and the fix."""

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        """A stager that puts each replica's regions of a slot on its device, recording the
        copies it can time in `stats`."""

    def close(self) -> None:
        """Lets go of what the layer holds on the devices for staging; idempotent."""


def refuse_unstageable(spec: SampleSpec, framework: str, device: Any, place: Callable) -> None:
    """Refuses, at construction, a field whose dtype `place` (one array onto `device`) cannot
    handle, naming the field and the fix, instead of failing at the first batch."""
    for leaf in spec.leaves:
        try:
            place(np.zeros(1, leaf.dtype))
        except Exception as error:
            raise TypeError(
                f"Field {leaf.name} has dtype {leaf.dtype}, which {framework} cannot stage on "
                f"{device} ({type(error).__name__}: {str(error).splitlines()[0][:120]}); cast "
                "it in `transform` or beforehand, e.g. to float16, bfloat16 or int8."
            ) from error


class Imported:
    """A batch already in memory another library owns: `replicas[replica][field]`, each an
    object that speaks DLPack and holds `per_replica` rows. It takes no slot."""

    __slots__ = ("replicas",)

    def __init__(self, replicas: list[list[Any]]):
        self.replicas = replicas

    def lease(self, give_back: Any) -> Imported:
        """Itself: its memory is kept alive by the tensors made from it, not by a slot."""
        return self


def host_array(tensor: Any) -> np.ndarray:
    """The values of an imported tensor as a host array: a view of host memory, or a copy of
    device memory (DALI's GPU tensors copy themselves out with `as_cpu`)."""
    if tensor.__dlpack_device__()[0] == _DLPACK_CPU:
        return np.from_dlpack(tensor)
    return np.asarray(tensor.as_cpu())


class HostBatch:
    """A global batch on the host: one array per field, padding rows last unless `real` says
    which rows are real (sources that fill each replica from its own shard)."""

    __slots__ = ("arrays", "epoch", "num_valid", "real", "step")

    def __init__(
        self,
        arrays: list[np.ndarray],
        num_valid: int,
        epoch: int,
        step: int,
        real: np.ndarray | None = None,
    ):
        self.arrays = arrays
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step
        self.real = real


class HostStager:
    """Keeps batches on the host as whole arrays (for a framework's own input pipeline): the
    global batch, or this host's rows of it under a multi-host setup. The arrays are views of
    the leased slot, which returns to the pool once the framework frees the last of them.
    """

    def __init__(self, layout: SlotLayout):
        self.layout = layout
        split = layout.split
        self._real = MaskCache(split.num_replicas, split.per_replica, _read_only_rows)
        """A step's real rows, where they are not simply the first `num_valid`."""

    def stage(self, step: Step, leased: np.ndarray | Imported) -> HostBatch:
        if isinstance(leased, Imported):  # one copy: the replicas' rows joined in fresh memory
            fields = zip(*leased.replicas, strict=True)
            arrays = [np.concatenate([host_array(part) for part in field]) for field in fields]
        else:
            arrays = self.layout.global_views(leased)
        real = None
        if step.replica_valid is not None or step.first_row:
            real = self._real(step)
        return HostBatch(arrays, step.num_valid, step.epoch, step.index, real)


def _read_only_rows(parts: np.ndarray) -> np.ndarray:
    """The real rows of the batch as one boolean array, read-only since batches share it."""
    rows = parts.reshape(-1)
    rows.flags.writeable = False
    return rows


class MaskCache:
    """A step's masks of real rows, made by `make` once per pattern of real rows and reused:
    masks are immutable, and all but an epoch's last step share one pattern. `make` takes one
    boolean array per replica and returns what the framework's batch holds."""

    def __init__(self, num_replicas: int, per_replica: int, make: Callable[[np.ndarray], Any]):
        self.num_replicas = num_replicas
        self.per_replica = per_replica
        self._make = make
        self._made: dict[Any, Any] = {}

    def __call__(self, step: Step) -> Any:
        key = step.replica_valid or step.num_valid
        if key not in self._made:
            real = step.real_rows(self.num_replicas, self.per_replica)
            self._made[key] = self._make(real.reshape(-1, self.per_replica))
        return self._made[key]


class DeviceBatch:
    """One global batch whose rows already sit on the devices: what a framework's step takes.

    Attributes:
      replicas: one entry per device of this host, in replica order: the sample's structure
        with every field an array of the framework on that device, whose leading dimension is
        the per-replica batch.
      masks: one boolean array `[per_replica_batch]` per device; True marks a real sample,
        False a padding row (only the last batch of an epoch has any).
      num_valid: real samples in the global batch (of every host: the same number on each, so
        each normalises its loss by it).
      epoch, step: where the batch sits in the stream.
    """

    __slots__ = ("epoch", "masks", "num_valid", "replicas", "step")

    def __init__(self, replicas: tuple, masks: tuple, num_valid: int, epoch: int, step: int):
        self.replicas = replicas
        self.masks = masks
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )
