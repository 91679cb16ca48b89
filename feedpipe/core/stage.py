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

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from feedpipe.core.agreement import Tally
from feedpipe.core.copy_engine import CopyPath
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import LeafSpec, SampleSpec
from feedpipe.core.split import HostShare

_DLPACK_CPU = 1
"""DLPack's device type of host memory (kDLCPU)."""

VALUE_CHECK_MAX_BYTES = 1 << 30
"""The largest field whose values are read at construction to prove that a narrowing cast
loses nothing. 1 GiB is read at memory speed in about a second; a larger field would hold up
every construction that long (and a memory-mapped one would be read from disk), so it is judged
by its dtype alone."""

_CHECK_CHUNK_ELEMENTS = 1 << 20
"""Values cast back and compared at once: the check's scratch memory stays a few MiB."""


class Staged(Protocol):
    """What a stager makes of one step: the consumer reads these, the hand-off counts them."""

    num_valid: int
    epoch: int
    step: int

    def handed_over(self) -> None:
        """Called in the consumer's thread as the batch is handed to it."""


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

    def check_stageable(self, spec: SampleSpec, values: Sequence[np.ndarray] | None) -> SampleSpec:
        """Refuses, at construction, a field the framework cannot hold, naming it and the fix;
        returns each field as the step receives it (see `Narrowing`). `values` are every
        value of each field (the source's arrays, where batches are their rows as they are), or
        None where values are made later."""

    def tally(self, payload: bytes) -> Tally:
        """Every host's `payload` compared with host 0's, through the framework's own
        collectives or store (`feedpipe.core.agreement`); raises
        `feedpipe.core.agreement.NoAnswer` where a host did not answer in time. Called only
        where several hosts share the feeder (`share.num_hosts` > 1)."""

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        """A stager that puts each replica's regions of a slot on its device, recording the
        copies it can time in `stats`."""

    def close(self) -> None:
        """Lets go of what the layer holds on the devices for staging; idempotent."""


def refuse_unstageable(spec: SampleSpec, framework: str, device: Any, place: Callable) -> None:
    """Refuses, at construction, a field whose dtype `place` (one array onto `device`) cannot
    handle, naming the field and the fix, instead of failing at the first batch. A device that
    takes no array at all (float32 included) is refused as the device, not as a dtype."""
    why = _refusal_of(place, np.float32)
    if why is not None:
        raise ValueError(
            f"{framework} cannot place any array on {device} ({why[0]}); the device is at "
            "fault, not a field's dtype: pass devices this process has, or leave `devices` "
            "unset."
        ) from why[1]
    for leaf in spec.leaves:
        why = _refusal_of(place, leaf.dtype)
        if why is not None:
            raise TypeError(
                f"Field {leaf.name} has dtype {leaf.dtype}, which {framework} cannot stage on "
                f"{device} ({why[0]}); cast it in `transform` or beforehand, e.g. to float16, "
                "bfloat16 or int8."
            ) from why[1]


def _refusal_of(place: Callable, dtype: Any) -> tuple[str, Exception] | None:
    """Why `place` refuses an array of `dtype` (the error, and its first line), or None."""
    try:
        place(np.zeros(1, dtype))
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}", error
    return None


class Narrowing:
    """Fields a framework narrows (JAX's 64-bit types without x64), and the one rule for them: a
    value that would change is refused, naming the field, the dtype, the value and both fixes
    (cast it, or `widen`: make the framework keep the dtype).

    Fields whose values are known at construction (arrays in memory up to
    `VALUE_CHECK_MAX_BYTES`) are read then; the rest (a generator's, a map-style source's, a
    `transform`'s, a larger array's) are checked as each batch is staged, on the host, before
    anything crosses to a device. A field whose values all survive arrives narrowed, and the
    spec says so.
    """

    def __init__(
        self,
        spec: SampleSpec,
        values: Sequence[np.ndarray] | None,
        arrives: Callable[[np.dtype], np.dtype],
        framework: str,
        widen: str,
    ):
        self.framework = framework
        self.widen = widen
        self.fields: dict[int, np.dtype] = {}
        """Each narrowed field's index and the dtype it arrives as."""
        self.unread: set[int] = set()
        """Narrowed fields whose values were not read at construction: checked per batch."""
        leaves = []
        for index, leaf in enumerate(spec.leaves):
            narrow = np.dtype(arrives(leaf.dtype))
            if narrow != leaf.dtype:
                self.fields[index] = narrow
                field = None if values is None else values[index]
                if field is None or field.nbytes > VALUE_CHECK_MAX_BYTES:
                    self.unread.add(index)
                else:
                    self.check(leaf, field, narrow, lambda row: f"sample {row}")
            leaves.append(LeafSpec(leaf.name, leaf.shape, narrow))
        self.spec = SampleSpec(spec.treespec, tuple(leaves))
        """`spec` as the devices receive it."""
        self._given = spec

    def check(
        self, leaf: LeafSpec, values: np.ndarray, narrow: np.dtype, where: Callable[[int], str]
    ) -> None:
        """Raises unless every value of `values` (rows of field `leaf`) survives the cast to
        `narrow`; `where(row)` names the sample of a row."""
        changed = _first_changed(values, narrow)
        if changed is None:
            return
        row, value = changed
        with np.errstate(all="ignore"):
            becomes = np.asarray(value).astype(narrow).item()
        example = f"x.astype(np.{narrow})" + (
            " where every value fits, or ids remapped to a dense range"
            if narrow.kind in "iu"
            else " if that precision is enough"
        )
        raise ValueError(
            f"Field {leaf.name} has dtype {leaf.dtype}, which {self.framework} narrows to "
            f"{narrow}, and {where(row)} holds {value!r}, which would arrive as {becomes!r}; "
            f"cast it to a dtype that holds its values, beforehand or in `transform` (e.g. "
            f"{example}), or enable 64-bit types ({self.widen})."
        )

    def narrowed(self, regions: list[np.ndarray], where: Callable[[int], str]) -> list[np.ndarray]:
        """One replica's `regions[field]`, each narrowed field cast (and, where its values were
        not read at construction, checked first); the others as they are."""
        if not self.fields:
            return regions
        out = list(regions)
        for index, narrow in self.fields.items():
            if index in self.unread:
                self.check(self._given.leaves[index], regions[index], narrow, where)
            out[index] = regions[index].astype(narrow)
        return out


def _first_changed(values: np.ndarray, narrow: np.dtype) -> tuple[int, Any] | None:
    """The first sample of `values` whose cast to `narrow` changes a value, and that value;
    None where every value survives (NaN stays NaN). Reads `values` in chunks of rows, so no
    copy of the whole field is made."""
    if values.dtype.kind in "iu":
        info = np.iinfo(narrow)
        if values.size == 0 or (values.min() >= info.min and values.max() <= info.max):
            return None
    row_elements = max(1, values[:1].size)
    rows = max(1, _CHECK_CHUNK_ELEMENTS // row_elements)
    for start in range(0, len(values), rows):
        chunk = values[start : start + rows]
        with np.errstate(all="ignore"):  # overflow to inf is what is being looked for
            back = chunk.astype(narrow).astype(chunk.dtype)
        same = (back == chunk) | ((back != back) & (chunk != chunk))
        if not same.all():
            where = np.unravel_index(np.argmin(same), same.shape)
            return start + int(where[0]), chunk[where].item()
    return None


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
    which rows are real (sources that fill each replica from its own shard, skipped samples)."""

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

    def handed_over(self) -> None:
        """Host arrays are ready as soon as they are made: nothing to wait for."""


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
        if step.replica_valid is not None or step.first_row or step.skipped:
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
        key = (step.replica_valid, step.num_valid, step.skipped)
        if key not in self._made:
            real = step.real_rows(self.num_replicas, self.per_replica)
            self._made[key] = self._make(real.reshape(-1, self.per_replica))
        return self._made[key]
