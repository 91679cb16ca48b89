"""The copy engine: host slots to device memory on streams of feedpipe's own, beside the step.

A framework's own host-to-device copy can wait for its compute: XLA's GPU client (and
TensorFlow's) makes each copy wait until every step queued before it has run, so a batch staged
`depth` steps ahead still arrives only when the running step ends. The engine copies instead on
a non-blocking CUDA stream of its own per device, into blocks of device memory it allocated
itself, and hands each block's fields to the framework through DLPack (`feedpipe.core.dlpack`),
which wraps them where they are. The staging thread waits for its own copies, never for compute.

A block is written again only when nothing can still read it: every array made from it has
been released by the framework, *and* a fence (a tiny computation the framework enqueued on the
device after those releases) has run, since a framework may release a buffer once its last
reader is enqueued, before it has run.

A layer asks `cuda_devices()` for each of its GPUs' streams; where that is impossible (no CUDA
in the process, `FEEDPIPE_COPY_STREAM=0`, a device that is no CUDA GPU, a dtype DLPack cannot
name), it keeps its framework's own copy, and its `CopyPath` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from feedpipe.core._cuda import OUT_OF_MEMORY, CudaDevice, CudaError, Driver, switched_off
from feedpipe.core.dlpack import Export, type_code
from feedpipe.core.slots import round_up
from feedpipe.core.source import SampleSpec

SWITCH = "FEEDPIPE_COPY_STREAM"
"""The environment variable that turns the engine off (`0`) or on (`1`, the default)."""
BLOCK_ALIGN = 256
"""Each field of a block starts on a 256-byte boundary: XLA checks its arguments' alignment,
and CUDA's allocations are aligned so."""
IN_FLIGHT = 3
"""Blocks per device beyond `depth` before the engine waits for a fence: one being copied,
one read by the running step, one by the step queued behind it."""

OWN_STREAMS = "feedpipe streams"
"""`CopyPath.name` where the engine copies on its own stream per device."""


@dataclasses.dataclass(frozen=True, slots=True)
class CopyPath:
    """How a batch crosses from its host slot to the devices, and why that way."""

    name: str
    """"feedpipe streams" (the engine's own CUDA stream per device), the framework's own copy
    ("jax.device_put", "tensorflow"), or "none" (the devices are CPUs: nothing crosses)."""
    reason: str
    """Why this path, in a sentence."""


class DeviceMemory(Protocol):
    """One device's memory and copy stream, as the engine uses them (`CudaDevice` on a GPU)."""

    dlpack_type: int
    """DLPack's device type of the memory."""
    ordinal: int
    """DLPack's device id: the device's index among this process's devices of its kind."""

    def allocate(self, nbytes: int) -> int: ...
    def free(self, address: int) -> None: ...
    def copy(self, pairs: list[tuple[int, int, int]]) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


class Fence(Protocol):
    """A computation the framework enqueued on a device: ready once all work enqueued on that
    device before it has run (a `jax.Array` is one)."""

    def is_ready(self) -> bool: ...
    def block_until_ready(self) -> Any: ...


NO_COPY = CopyPath("none", "the devices are CPUs: no batch crosses to an accelerator")


def cuda_devices(ordinals: Sequence[int]) -> tuple[list[CudaDevice] | None, str]:
    """A stream and memory of feedpipe's own on each CUDA device `ordinals` names, or None, with
    the reason either way."""
    if switched_off(SWITCH, "copy on feedpipe's own CUDA streams"):
        return None, f"feedpipe's own copy streams were turned off with {SWITCH}=0"
    try:
        driver = Driver.find()
        devices = [CudaDevice(driver, ordinal) for ordinal in ordinals]
    except CudaError as error:
        return None, f"feedpipe cannot make CUDA streams of its own: {error}"
    return devices, (
        "each device's batch is copied on a non-blocking CUDA stream of feedpipe's own, beside "
        "the running step, and handed over with DLPack"
    )


def undeliverable_field(spec: SampleSpec) -> str | None:
    """Why DLPack cannot hand over some field of `spec`, or None where it can hand over all."""
    for leaf in spec.leaves:
        if type_code(leaf.dtype) is None:
            return f"field {leaf.name} has dtype {leaf.dtype}, which DLPack has no type for"
    return None


class _Block:
    """Device memory for one replica's fields of one batch, and who still reads it."""

    __slots__ = ("address", "handed", "released")

    def __init__(self, address: int):
        self.address = address
        self.handed: deque = deque()
        """A token per array made from the block (appended in the staging thread)."""
        self.released: deque = deque()
        """A token per such array the framework released (appended from any thread)."""

    def read(self) -> bool:
        """Whether some array made from the block may still be alive."""
        handed = len(self.handed)  # first: `released` only grows, and never past `handed`
        return len(self.released) < handed


class BlockPool:
    """One device's blocks, allocated once and reused.

    Invariant: a block is written only when it is free: every array made from it released, and a
    fence enqueued after the last release has run. At most `limit` blocks exist unless the
    consumer holds more batches than that; the pool then makes one more rather than wait for a
    batch that only the consumer can free.
    """

    def __init__(
        self, memory: DeviceMemory, block_bytes: int, limit: int, fence: Callable[[], Fence]
    ):
        self.memory = memory
        self.block_bytes = block_bytes
        self.limit = limit
        self._fence = fence
        self._free: list[_Block] = []
        self._out: list[_Block] = []
        """Handed over; some array made from it may still be read."""
        self._fencing: deque[tuple[Fence, list[_Block]]] = deque()
        """Released blocks behind the fence enqueued after their release, oldest first."""
        self.allocated = 0
        """Blocks made so far."""
        self.fence_waits = 0
        """Times the staging thread waited for a fence: the device ran behind by more than
        `limit` batches (so the step, not the input, set the pace)."""
        self.fence_wait_s = 0.0

    def acquire(self) -> _Block:
        """A free block: reused where one is, else made (waiting for a fence only when `limit`
        blocks exist and some of them wait for no one but the device)."""
        self._collect()
        if not self._free and self._fencing and self.allocated >= self.limit:
            started = time.perf_counter()
            fence, blocks = self._fencing.popleft()
            fence.block_until_ready()
            self._free.extend(blocks)
            self.fence_waits += 1
            self.fence_wait_s += time.perf_counter() - started
        if self._free:
            block = self._free.pop()
            block.handed.clear()
            block.released.clear()
            return block
        block = _Block(self._allocate())
        self.allocated += 1
        return block

    def _allocate(self) -> int:
        try:
            return self.memory.allocate(self.block_bytes)
        except CudaError as error:
            if error.code != OUT_OF_MEMORY:
                raise
            raise MemoryError(
                f"feedpipe could not allocate {self.block_bytes / 2**20:.4g} MiB on GPU "
                f"{self.memory.ordinal} for a staged batch ({self.allocated} such blocks made "
                "so far): the framework holds the rest of the device's memory. JAX preallocates "
                "75 % of it: lower that with XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.6), or turn "
                "it off with XLA_PYTHON_CLIENT_PREALLOCATE=false; or use the framework's own "
                f"copy with {SWITCH}=0."
            ) from error

    def hand_over(self, block: _Block) -> None:
        """The arrays made from `block` are the framework's now."""
        self._out.append(block)

    def _collect(self) -> None:
        """Puts one fence behind the blocks released since the last call; frees the blocks
        behind every fence that has run."""
        released = [block for block in self._out if not block.read()]
        if released:
            self._out = [block for block in self._out if block not in released]
            self._fencing.append((self._fence(), released))
        while self._fencing and self._fencing[0][0].is_ready():
            self._free.extend(self._fencing.popleft()[1])

    @property
    def held(self) -> int:
        """Blocks some array made from which may still be read."""
        return len(self._out)

    def close(self) -> bool:
        """Frees every block nothing reads any more (waiting for their fences); True when none
        is left. Blocks still held by the consumer's arrays are freed at a later call."""
        self._collect()
        while self._fencing:
            fence, blocks = self._fencing.popleft()
            fence.block_until_ready()
            self._free.extend(blocks)
        for block in self._free:
            self.memory.free(block.address)
        self.allocated -= len(self._free)
        self._free.clear()
        return not self._out


_closing: set[BlockPool] = set()
"""Pools of closed engines whose blocks a consumer still held at the close."""


def _reclaim() -> None:
    """Frees what closed engines' consumers have let go of since."""
    for pool in list(_closing):
        if pool.close():
            pool.memory.close()
            _closing.discard(pool)


class CopyEngine:
    """Copies each replica's regions of a host slot into a block of its device's memory on the
    device's own stream, and exports each field with DLPack.

    Invariant: per device, at most `depth + IN_FLIGHT` blocks exist, plus one for each batch the
    consumer holds beyond those; each is written only when nothing can read it.
    """

    def __init__(
        self,
        memories: Sequence[DeviceMemory],
        spec: SampleSpec,
        per_replica: int,
        depth: int,
        fences: Sequence[Callable[[], Fence]],
    ):
        _reclaim()
        self.memories = list(memories)
        self._fields = []
        """Each field's (offset in a block, dtype, shape of one replica's rows), as it arrives."""
        offset = 0
        for leaf in spec.leaves:
            self._fields.append((offset, leaf.dtype, (per_replica, *leaf.shape)))
            offset += round_up(per_replica * leaf.row_bytes, BLOCK_ALIGN)
        self.block_bytes = max(offset, BLOCK_ALIGN)
        self.pools = [
            BlockPool(memory, self.block_bytes, depth + IN_FLIGHT, fence)
            for memory, fence in zip(self.memories, fences, strict=True)
        ]
        self.copy_s = 0.0
        """Time the staging thread waited for its copies."""
        self._finalizer = weakref.finalize(self, _close_pools, self.pools)
        # At exit the framework may be half torn down, and the process's end frees the memory.
        self._finalizer.atexit = False

    @contextlib.contextmanager
    def copy(self, regions: Sequence[Sequence[np.ndarray]]) -> Iterator[list[list[Export]]]:
        """Copies `regions[replica][field]` (host arrays, page-locked where they are a slot's) to
        each replica's device
        and yields `exports[replica][field]` once the copies are done, for the framework to
        import inside the block; the blocks are the framework's once the block ends."""
        blocks = []
        try:
            for pool in self.pools:
                blocks.append(pool.acquire())
            started = time.perf_counter()
            for memory, block, fields in zip(self.memories, blocks, regions, strict=True):
                memory.copy(
                    [
                        (block.address + offset, region.ctypes.data, region.nbytes)
                        for (offset, _, _), region in zip(self._fields, fields, strict=True)
                        if region.nbytes
                    ]
                )
            for memory in self.memories:
                memory.wait()
            self.copy_s += time.perf_counter() - started
            yield [
                [
                    Export(
                        block.address + offset,
                        shape,
                        dtype,
                        (memory.dlpack_type, memory.ordinal),
                        block.handed,
                        block.released,
                    )
                    for offset, dtype, shape in self._fields
                ]
                for memory, block in zip(self.memories, blocks, strict=True)
            ]
        finally:
            for pool, block in zip(self.pools, blocks, strict=False):
                pool.hand_over(block)

    @property
    def blocks(self) -> int:
        """Device blocks allocated now, over every device."""
        return sum(pool.allocated for pool in self.pools)

    @property
    def fence_wait_s(self) -> float:
        return sum(pool.fence_wait_s for pool in self.pools)

    def close(self) -> None:
        """Frees the blocks nothing reads; the rest once the consumer lets go of them (checked
        whenever an engine is made or closed). Idempotent."""
        self._finalizer()
        _reclaim()


def _close_pools(pools: list[BlockPool]) -> None:
    for pool in pools:
        if pool.close():
            pool.memory.close()
        else:
            _closing.add(pool)
