"""The JAX layer: what the core needs from JAX to stage batches.

On CUDA GPUs each replica's regions of a page-locked host slot are copied by the core's copy
engine (`feedpipe.core.copy_engine`) on a stream of feedpipe's own, beside the running step, and
handed to JAX with DLPack, which wraps the device memory where it is. `jax.device_put` would
instead wait for every step queued before it (XLA's GPU client allocates in step with its compute
stream). The staging thread waits for its own copies only; the slot returns once they are done.

Elsewhere (another accelerator, no CUDA in the process, `FEEDPIPE_COPY_STREAM=0`, a dtype DLPack
cannot name), each replica's regions go to its device with one `jax.device_put`, and the staging
thread waits for that copy before handing the batch over; `copy_path` says which and why.

On a CPU device JAX would wrap the slot's memory instead, and let it go only at its next call
after the array dies: a producer waiting for that slot makes no such call, so the slot came back
only with the consumer's next step (one batch of look-ahead lost, and a one-off slot whenever
the consumer starved). There the slot is copied out whole, one memcpy into fresh aligned memory
whose regions JAX wraps as they are (a region that is not aligned, it copies again), and the
slot returns as soon as the batch is staged. Each field becomes one global array in one call
(`jax.make_array_from_callback`), as a plain loop's `jax.device_put(rows, sharding)` makes it.
A `device_put` per device and `jax.make_array_from_single_device_arrays` per field took ~0.35
ms a batch (256 rows of 784 float32 and a label, 4 host devices), this ~0.09 ms: on CPU
devices that time is taken from the step's own cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from feedpipe._internals.jax import jax_dlpack_import
from feedpipe.core.agreement import Tally
from feedpipe.core.copy_engine import (
    NO_COPY,
    OWN_STREAMS,
    CopyEngine,
    CopyPath,
    DeviceMemory,
    cuda_devices,
    undeliverable_field,
)
from feedpipe.core.dlpack import Export
from feedpipe.core.pinned import page_locker
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout, aligned_copy
from feedpipe.core.source import SampleSpec
from feedpipe.core.split import HostShare
from feedpipe.core.stage import Imported, MaskCache, Narrowing, refuse_unstageable
from feedpipe.jax import agreement
from feedpipe.jax.batch import Batch

BATCH_AXIS = "batch"
"""The mesh axis name of the default 1-D mesh, as `keras.distribution.DataParallel` names it."""


def _process_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Devices ordered by process, then id: process `p`'s replicas are then contiguous, and so
    are its rows of each global batch (`feedpipe.core.split`)."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _mesh(devices: Any) -> Mesh:
    """The mesh to shard global batches over: the one given, or a 1-D mesh over `devices`
    (None: every device of every process)."""
    if isinstance(devices, Mesh):
        return devices
    if devices is None:
        devices = _process_major(jax.devices())
    else:
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` is empty; pass jax.devices() or a list of them.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"`devices`={devices} names a device twice; list each once.")
        if jax.process_count() > 1:
            devices = _process_major(devices)
    return Mesh(np.array(devices), (BATCH_AXIS,))


def _share(global_batch_size: int, mesh: Mesh) -> tuple[tuple[jax.Device, ...], HostShare]:
    """This process's devices, in mesh order, and its rows of each global batch."""
    flat = list(mesh.devices.flat)
    mine = jax.process_index()
    local = tuple(d for d in flat if d.process_index == mine)
    processes = sorted({d.process_index for d in flat})
    if not local:
        raise ValueError(
            f"`devices` holds no device of this process ({mine}); pass jax.devices(), whose "
            "devices include this process's."
        )
    if len(processes) == 1:
        return local, HostShare(global_batch_size, local_replicas=len(local))
    counts = {p: sum(d.process_index == p for d in flat) for p in processes}
    host = processes.index(mine)
    contiguous = flat[host * len(local) : (host + 1) * len(local)] == list(local)
    if len(set(counts.values())) != 1 or not contiguous:
        raise ValueError(
            f"The mesh's devices per process are {counts}, in the order "
            f"{[d.process_index for d in flat]}: each process must hold as many devices, "
            "contiguous along the batch axis, so that it makes a contiguous share of each "
            "global batch; use the default (devices=None) or order them by process."
        )
    return local, HostShare(global_batch_size, len(processes), host, len(local))


DEVICE_PUT = "jax.device_put"
"""`CopyPath.name` where JAX's own transfer copies to the devices."""


def _device_memories(
    devices: Sequence[jax.Device],
) -> tuple[list[DeviceMemory] | None, CopyPath]:
    """Streams and memory of feedpipe's own on each device, where they can be made, and the
    copy path that follows."""
    if all(d.platform == "cpu" for d in devices):
        return None, NO_COPY
    platform = f"{devices[0].platform} ({devices[0].client.platform_version})"
    if not all("cuda" in d.client.platform_version.lower() for d in devices):
        return None, CopyPath(
            DEVICE_PUT, f"the devices are {platform}: feedpipe's own copy streams need CUDA"
        )
    memories, reason = cuda_devices([d.local_hardware_id for d in devices])
    return memories, CopyPath(OWN_STREAMS if memories else DEVICE_PUT, reason)


_bump = jax.jit(lambda token: token + 1)


def _public_import(export: Export, device: jax.Device) -> jax.Array:
    return jax.dlpack.from_dlpack(export, device, copy=False)


def _direct_import() -> Callable[[Export, jax.Device], jax.Array] | None:
    """JAX's DLPack import without the Python around it (`jax_dlpack_import`), or None. An
    export's bytes are complete before it is made, so it needs no stream; its dtype is already
    JAX's, so no wrap."""
    to_array = jax_dlpack_import()
    if to_array is None:
        return None

    def take(export: Export, device: jax.Device) -> jax.Array:
        return to_array(export.__dlpack__(), device, export.device[0])

    return take


def importer(export: Export, device: jax.Device) -> Callable[[Export, jax.Device], jax.Array]:
    """The cheapest import that gives what `jax.dlpack.from_dlpack` gives, tried on `export`
    (the array it makes is dropped at once): the direct import where it works, else the public
    one."""
    direct = _direct_import()
    if direct is None:
        return _public_import
    try:
        probe = direct(export, device)
    except (TypeError, AttributeError):
        return _public_import
    same = (
        isinstance(probe, jax.Array)
        and probe.shape == export.shape
        and probe.dtype == export.dtype
        and probe.devices() == {device}
    )
    return direct if same else _public_import


def device_fence(device: jax.Device):
    """A function that enqueues a tiny computation on `device`: ready once every step enqueued
    there before it has run (one compute stream per device runs them in order)."""
    token = jax.device_put(np.zeros((), np.int32), device)
    # Compiled now: the first fence is sent some batches into the steady state.
    _bump(token).block_until_ready()
    return lambda: _bump(token)


class JaxLayer:
    """Stages on JAX devices: this process's devices of a 1-D mesh (or the mesh given)."""

    name = "jax"

    def __init__(self, devices: Any, strategy: Any, global_batch_size: int):
        if strategy is not None:
            raise TypeError(
                f"`strategy`={strategy!r} is TensorFlow's; a JAX feeder shards by device: pass "
                "devices=jax.devices() (or a jax.sharding.Mesh) and no strategy."
            )
        self.mesh = _mesh(devices)
        self.sharding = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        """The global batch's sharding: axis 0 split over every device of the mesh in order."""
        self.devices, self.share = _share(global_batch_size, self.mesh)
        self.processes = sorted({d.process_index for d in self.mesh.devices.flat})
        """The processes whose devices the mesh holds, in host order."""
        self.accelerated = any(d.platform != "cpu" for d in self.devices)
        """Whether the devices are accelerators: copies to them are timed and page-locked."""
        self.page_lock = page_locker() if self.accelerated else None
        self._memories, self.copy_path = _device_memories(self.devices)
        self._engine: CopyEngine | None = None
        self.narrowing: Narrowing | None = None
        """The fields JAX narrows, and their check (set by `check_stageable`)."""

    def check_stageable(self, spec: SampleSpec, values: Sequence[np.ndarray] | None) -> SampleSpec:
        """Refuses a field JAX cannot place, or whose values JAX would narrow (int64, uint64,
        float64, complex128 with `jax_enable_x64` off, JAX's default); returns the fields as
        they arrive: a 64-bit field whose every value fits arrives as the 32-bit dtype."""
        device = self.devices[0]
        refuse_unstageable(
            spec, "JAX", device, lambda array: jax.device_put(array, device).block_until_ready()
        )
        self.narrowing = Narrowing(
            spec,
            values,
            jax.dtypes.canonicalize_dtype,
            "JAX",
            "jax_enable_x64 is off: jax.config.update('jax_enable_x64', True) before building "
            "the feeder, or JAX_ENABLE_X64=1 in the environment",
        )
        arriving = self.narrowing.spec
        undeliverable = self._memories and undeliverable_field(arriving)
        if undeliverable:
            self._close_memories()
            self.copy_path = CopyPath(DEVICE_PUT, f"{undeliverable}, so JAX copies it")
        return arriving

    def tally(self, payload: bytes) -> Tally:
        """Every process's `payload` compared with the first's, through the distributed
        runtime (`feedpipe.jax.agreement`)."""
        return agreement.tally(self.processes, payload)

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        # One engine for the feeder's life: its device pool's layout never changes.
        if self._memories is not None and self._engine is None:
            fences = [device_fence(device) for device in self.devices]
            self._engine = CopyEngine(
                self._memories, self.narrowing.spec, layout.split.per_replica, stats.depth, fences
            )
        stats.copy_path = self.copy_path.name
        return Stager(self, layout, stats, self._engine)

    def _close_memories(self) -> None:
        memories, self._memories = self._memories, None
        for memory in memories or ():
            memory.close()

    def close(self) -> None:
        """Frees the device blocks nothing reads any more (the rest as the consumer lets go of
        them); idempotent."""
        if self._engine is not None:
            self._engine.close()
        elif self._memories is not None:
            self._close_memories()

    def global_array(self, regions: Sequence[np.ndarray]) -> jax.Array:
        """One field's global array, axis 0 sharded over the mesh, whose shard on each device of
        this process is that replica's region of host memory (`regions`, in device order): JAX
        wraps a region aligned to 64 bytes as it is, on a CPU device."""
        first_row = self.share.rows.start
        per_replica = len(regions[0])
        shape = (self.share.global_batch_size, *regions[0].shape[1:])
        return jax.make_array_from_callback(
            shape,
            self.sharding,
            lambda index: regions[((index[0].start or 0) - first_row) // per_replica],
        )

    def global_arrays(self, per_device: Sequence[Any]) -> Any:
        """The global arrays, axis 0 sharded over the mesh, whose shards are `per_device`'s
        leaves (one structure per device of this process): no copy is made."""
        size = self.share.global_batch_size
        treespec = optree.tree_structure(per_device[0])
        fields = [
            jax.make_array_from_single_device_arrays(
                (size, *shards[0].shape[1:]), self.sharding, list(shards)
            )
            for shards in zip(*(optree.tree_leaves(one) for one in per_device), strict=True)
        ]
        return optree.tree_unflatten(treespec, fields)


class Stager:
    """Turns filled host slots into `Batch`es whose arrays sit on each replica's device."""

    def __init__(
        self,
        layer: JaxLayer,
        layout: SlotLayout,
        stats: StatsRecorder,
        engine: CopyEngine | None,
    ):
        self.layer = layer
        self.layout = layout
        self.stats = stats
        self.engine = engine
        self.masks = MaskCache(len(layer.devices), layout.split.per_replica, self._place_masks)
        """A step's masks: per device, and as one global array (made once per pattern)."""
        self._import: Callable[[Export, jax.Device], jax.Array] | None = None
        """How the engine's exports become arrays (chosen at the first batch, `importer`)."""

    def _place_masks(self, parts: np.ndarray) -> tuple[tuple[jax.Array, ...], jax.Array]:
        per_device = tuple(
            jax.device_put(part.copy(), device)
            for part, device in zip(parts, self.layer.devices, strict=True)
        )
        return per_device, self.layer.global_arrays(per_device)

    def stage(self, step: Step, leased: np.ndarray | Imported) -> Batch:
        """The batch in the `leased` bytes of a slot, placed on the devices; returns once the
        copies are done."""
        if isinstance(leased, Imported):
            raise TypeError("A JAX feeder stages from host slots; DALI outputs go to TensorFlow.")
        if self.engine is None and not self.layer.accelerated:
            return self._stage_on_cpu(step, leased)
        unflatten = self.layout.spec.unflatten
        devices = self.layer.devices
        if self.engine is not None:
            placed = self._copy_on_own_streams(devices, step, leased)
        else:
            views = self._narrowed(step, self.layout.views(leased))
            stage_s = self.stats.stage_s
            started = time.perf_counter()
            placed = [jax.device_put(v, d) for d, v in zip(devices, views, strict=True)]
            issued = time.perf_counter()
            jax.block_until_ready(placed)
            copied = time.perf_counter()
            stage_s["copy issued"] += issued - started
            stage_s["copy waited"] += copied - issued
            self.stats.copied(self.layout.batch_bytes, copied - started)
        replicas = tuple(unflatten(arrays) for arrays in placed)
        masks, mask = self.masks(step)
        return Batch(replicas, masks, step.num_valid, step.epoch, step.index, mask, self.layer)

    def _stage_on_cpu(self, step: Step, leased: np.ndarray) -> Batch:
        """The batch as global arrays over fresh host memory: one copy of the slot, whose
        aligned regions become the shards as they are. The replicas' arrays are those shards,
        taken out when first asked for (`Batch.replicas`)."""
        views = self._narrowed(step, self.layout.views(aligned_copy(leased)))
        fields = [self.layer.global_array(regions) for regions in zip(*views, strict=True)]
        masks, mask = self.masks(step)
        inputs = self.layout.spec.unflatten(fields)
        return Batch(None, masks, step.num_valid, step.epoch, step.index, mask, self.layer, inputs)

    def _narrowed(self, step: Step, views: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """Each replica's regions, the fields JAX narrows cast on the host, each value checked
        where it was not read at construction."""
        narrowing = self.layer.narrowing
        if narrowing is None or not narrowing.fields:
            return views
        per_replica = self.layout.split.per_replica

        def where(replica: int):
            def sample(row: int) -> str:
                host_row = replica * per_replica + row
                if step.rows is not None and host_row < len(step.rows):
                    return f"sample {int(step.rows[host_row])} (epoch {step.epoch})"
                return f"row {host_row} of step {step.index} of epoch {step.epoch}"

            return sample

        return [narrowing.narrowed(regions, where(r)) for r, regions in enumerate(views)]

    def _copy_on_own_streams(
        self, devices: Sequence[jax.Device], step: Step, leased: np.ndarray
    ) -> list:
        """Each replica's fields on its device, copied by the engine and imported without a copy."""
        engine, stats = self.engine, self.stats
        stage_s = stats.stage_s
        copying_s = stage_s["copy issued"] + stage_s["copy waited"]
        narrowing = self.layer.narrowing
        if narrowing is not None and narrowing.fields:
            views = self._narrowed(step, self.layout.views(leased))  # alive until copied
            sources = [[(view.ctypes.data, view.nbytes) for view in row] for row in views]
        else:
            base = leased.ctypes.data
            sources = [[(base + offset, size) for offset, size in row] for row in self.layout.spans]
        with engine.copy(sources, stage_s) as exports:
            if self._import is None:
                self._import = importer(exports[0][0], devices[0])
            take = self._import
            placed = [
                [take(export, device) for export in fields]
                for device, fields in zip(devices, exports, strict=True)
            ]
        stats.copied(
            self.layout.batch_bytes,
            stage_s["copy issued"] + stage_s["copy waited"] - copying_s,
        )
        stats.device_blocks = engine.blocks
        stats.fence_wait_s = engine.fence_wait_s
        stats.fences = engine.fences
        return placed
