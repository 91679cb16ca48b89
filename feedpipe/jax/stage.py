"""Stage: puts each replica's rows on its JAX device.

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
from typing import TYPE_CHECKING

import jax
import numpy as np

from feedpipe._internals.jax import jax_dlpack_import
from feedpipe.core.copy_engine import CopyEngine
from feedpipe.core.dlpack import Export
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.sampler import Step
from feedpipe.core.slots import SlotLayout, aligned_copy
from feedpipe.core.stage import Imported, MaskCache
from feedpipe.jax.batch import Batch

if TYPE_CHECKING:
    from feedpipe.jax.layer import JaxLayer


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
