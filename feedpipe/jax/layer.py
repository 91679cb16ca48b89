"""The JAX layer: what the core needs from JAX to stage batches.

Devices are JAX devices or a `jax.sharding.Mesh`: this process's devices of a 1-D mesh
(`feedpipe.jax.devices`). Each replica's rows are copied on streams of feedpipe's own on CUDA
GPUs, else by `jax.device_put` (`feedpipe.jax.stage`); `copy_path` says which and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optree
from jax.sharding import NamedSharding, PartitionSpec

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
from feedpipe.core.pinned import page_locker
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.stage import Narrowing, refuse_unstageable
from feedpipe.jax import agreement
from feedpipe.jax.devices import process_share, resolve_mesh
from feedpipe.jax.stage import Stager, device_fence

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


class JaxLayer:
    """Stages on JAX devices: this process's devices of a 1-D mesh (or the mesh given)."""

    name = "jax"

    def __init__(self, devices: Any, strategy: Any, global_batch_size: int):
        if strategy is not None:
            raise TypeError(
                f"`strategy`={strategy!r} is TensorFlow's; a JAX feeder shards by device: pass "
                "devices=jax.devices() (or a jax.sharding.Mesh) and no strategy."
            )
        self.mesh = resolve_mesh(devices)
        self.sharding = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names))
        """The global batch's sharding: axis 0 split over every device of the mesh in order."""
        self.devices, self.share = process_share(global_batch_size, self.mesh)
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
