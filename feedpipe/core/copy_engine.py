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
reader is enqueued, before it has run. A fence costs a dispatch (0.05 to 0.16 ms on an H100,
as much as a 2 MiB copy), so one fence covers every block released since the last, and is sent
only as the blocks that need none run low: with `SPARE_BLOCKS` blocks beyond those in use, about
one batch in ten pays for a fence.

The staging thread waits for its copies by polling their event for about as long as the copy
should take (its bytes over the link's rate measured so far), then by sleeping on it: a sleeping
wait wakes tens of microseconds late, which at 2 MiB is as long as the copy itself.

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

from feedpipe.core import env
from feedpipe.core._cuda import OUT_OF_MEMORY, CudaDevice, CudaError, Driver
from feedpipe.core.dlpack import Export, type_code
from feedpipe.core.slots import round_up
from feedpipe.core.sources import SampleSpec

BLOCK_ALIGN = 256
"""Each field of a block starts on a 256-byte boundary: XLA checks its arguments' alignment,
and CUDA's allocations are aligned so."""
IN_FLIGHT = 3
"""Blocks per device beyond `depth` that are in use in the steady state: one being copied, one
read by the running step, one by the step queued behind it."""
SPARE_BLOCKS = 12
"""Blocks per device beyond those in use, released and waiting for their fence or free: the
more, the more releases one fence covers (about one fence per `SPARE_BLOCKS - LOW_WATER`
batches)."""
SPARE_BYTES = 2**30
"""Device memory the spare blocks of one device may take: fewer spares for large batches, whose
copy dwarfs a fence's dispatch anyway."""
LOW_WATER = 2
"""A fence is sent once the blocks that need none (free ones, and room to make more) fall to
this many: the fence then has that many batches' time to run before a block waits for it."""
STAGES = ("fence", "copy issued", "copy waited", "import")
"""What the staging thread does for each batch on the engine's path, in order, as timed:
acquiring a block (a fence sent or waited for), issuing the copies, waiting for them, and the
framework's import of the exports."""

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
    def wait(self, expected_s: float) -> None: ...
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
    if env.switched_off(env.COPY_STREAM):
        turned_off = env.setting(env.COPY_STREAM)
        return None, f"feedpipe's own copy streams were turned off with {turned_off}"
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
    """Device memory for one replica's fields of one batch, its exports, and who still reads it."""

    __slots__ = ("address", "exports", "handed", "released")

    def __init__(self, address: int, fields: Sequence[tuple[int, np.dtype, tuple]], device):
        self.address = address
        self.handed: deque = deque()
        """A token per array made from the block (appended in the staging thread)."""
        self.released: deque = deque()
        """A token per such array the framework released (appended from any thread)."""
        self.exports = [
            Export(address + offset, shape, dtype, device, self.handed, self.released)
            for offset, dtype, shape in fields
        ]
        """Each field's export, made once: a batch in the block hands these over."""

    def read(self) -> bool:
        """Whether some array made from the block may still be alive."""
        handed = len(self.handed)  # first: `released` only grows, and never past `handed`
        return len(self.released) < handed


def block_limit(depth: int, block_bytes: int) -> int:
    """Blocks one device's pool makes before it waits for a fence: those in use in the steady
    state, and the spares that let one fence cover many releases."""
    spares = min(SPARE_BLOCKS, max(LOW_WATER + 1, SPARE_BYTES // max(block_bytes, 1)))
    return depth + IN_FLIGHT + spares


class BlockPool:
    """One device's blocks, allocated once and reused.

    Invariant: a block is written only when it is free: every array made from it released, and a
    fence enqueued after the last release has run. At most `limit` blocks exist unless the
    consumer holds more batches than that; the pool then makes one more rather than wait for a
    batch that only the consumer can free.
    """

    def __init__(
        self,
        memory: DeviceMemory,
        fields: Sequence[tuple[int, np.dtype, tuple]],
        block_bytes: int,
        limit: int,
        fence: Callable[[], Fence],
    ):
        self.memory = memory
        self.fields = fields
        """Each field's (offset in a block, dtype, shape of one replica's rows)."""
        self.block_bytes = block_bytes
        self.limit = limit
        self._fence = fence
        self._free: list[_Block] = []
        self._out: list[_Block] = []
        """Handed over; some array made from it may still be read."""
        self._released: list[_Block] = []
        """Released since the last fence: no fence stands behind them yet."""
        self._fencing: deque[tuple[Fence, list[_Block]]] = deque()
        """Released blocks behind the fence enqueued after their release, oldest first."""
        self.allocated = 0
        """Blocks made so far."""
        self.fences = 0
        """Fences enqueued on the device."""
        self.fence_waits = 0
        """Times the staging thread waited for a fence: the device ran behind by more than
        `limit` batches (so the step, not the input, set the pace)."""
        self.fence_wait_s = 0.0

    def acquire(self) -> _Block:
        """A free block: reused where one is, else made (waiting for a fence only when `limit`
        blocks exist and some of them wait for no one but the device)."""
        self._collect()
        room = max(0, self.limit - self.allocated)
        if self._released and len(self._free) + room <= LOW_WATER:
            self._fences_released()
        if not self._free and not room and self._fencing:
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
        block = _Block(
            self._allocate(), self.fields, (self.memory.dlpack_type, self.memory.ordinal)
        )
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
                f"copy with {env.COPY_STREAM}=0."
            ) from error

    def hand_over(self, block: _Block) -> None:
        """The arrays made from `block` are the framework's now."""
        self._out.append(block)

    def _collect(self) -> None:
        """Moves the blocks released since the last call behind the next fence; frees the
        blocks behind every fence that has run."""
        released = [block for block in self._out if not block.read()]
        if released:
            self._out = [block for block in self._out if block not in released]
            self._released.extend(released)
        while self._fencing and self._fencing[0][0].is_ready():
            self._free.extend(self._fencing.popleft()[1])

    def _fences_released(self) -> None:
        """One fence behind every block released since the last."""
        self._fencing.append((self._fence(), self._released))
        self._released = []
        self.fences += 1

    @property
    def held(self) -> int:
        """Blocks some array made from which may still be read."""
        return len(self._out)

    def close(self) -> bool:
        """Frees every block nothing reads any more (waiting for their fences); True when none
        is left. Blocks still held by the consumer's arrays are freed at a later call."""
        self._collect()
        if self._released:
            self._fences_released()
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

    Invariant: per device, at most `block_limit(depth, block_bytes)` blocks exist, plus one for
    each batch the consumer holds beyond those; each is written only when nothing can read it.
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
        self.replica_bytes = per_replica * spec.row_bytes
        """Bytes one device's copy moves each batch: what its wait expects."""
        limit = block_limit(depth, self.block_bytes)
        self.pools = [
            BlockPool(memory, self._fields, self.block_bytes, limit, fence)
            for memory, fence in zip(self.memories, fences, strict=True)
        ]
        self.link = LinkRate()
        self._finalizer = weakref.finalize(self, _close_pools, self.pools)
        # At exit the framework may be half torn down, and the process's end frees the memory.
        self._finalizer.atexit = False

    @contextlib.contextmanager
    def copy(
        self, sources: Sequence[Sequence[tuple[int, int]]], stage_s: dict[str, float]
    ) -> Iterator[list[list[Export]]]:
        """Copies `sources[replica][field]` (the host address and bytes of a region, page-locked
        where it is a slot's) to each replica's device and yields `exports[replica][field]` once
        the copies are done, for the framework to import inside the block; the blocks are the
        framework's once the block ends. Adds the time of each of `STAGES` to `stage_s`."""
        clock = time.perf_counter
        blocks = []
        started = clock()
        try:
            for pool in self.pools:
                blocks.append(pool.acquire())
            issued = clock()
            for memory, block, fields in zip(self.memories, blocks, sources, strict=True):
                address = block.address
                pairs = [
                    (address + offset, host, size)
                    for (offset, _, _), (host, size) in zip(self._fields, fields, strict=True)
                    if size
                ]
                memory.copy(pairs)
            waiting = clock()
            expected_s = self.link.expected_s(self.replica_bytes)
            for memory in self.memories:
                memory.wait(expected_s)
            copied = clock()
            self.link.observed(self.replica_bytes, copied - issued)
            stage_s["fence"] += issued - started
            stage_s["copy issued"] += waiting - issued
            stage_s["copy waited"] += copied - waiting
            yield [block.exports for block in blocks]
            stage_s["import"] += clock() - copied
        finally:
            for pool, block in zip(self.pools, blocks, strict=False):
                pool.hand_over(block)

    @property
    def blocks(self) -> int:
        """Device blocks allocated now, over every device."""
        return sum(pool.allocated for pool in self.pools)

    @property
    def fences(self) -> float:
        """Fences enqueued per device."""
        return sum(pool.fences for pool in self.pools) / len(self.pools)

    @property
    def fence_wait_s(self) -> float:
        return sum(pool.fence_wait_s for pool in self.pools)

    def close(self) -> None:
        """Frees the blocks nothing reads; the rest once the consumer lets go of them (checked
        whenever an engine is made or closed). Idempotent."""
        self._finalizer()
        _reclaim()


class LinkRate:
    """The host-to-device rate the copies have shown, so a wait can poll for about as long as
    a copy takes before it sleeps."""

    FIRST_GB_S = 25.0
    """The rate assumed before any copy is timed: about half a PCIe Gen5 x16 link."""
    MARGIN = 1.25
    """A wait polls for this much more than the expected time, then sleeps."""
    FLOOR_S = 20e-6
    """And for at least this long: a copy's own fixed latency."""

    def __init__(self):
        self.bytes_per_s = self.FIRST_GB_S * 1e9

    def expected_s(self, nbytes: int) -> float:
        """How long a wait for `nbytes` should poll before it sleeps."""
        return self.MARGIN * nbytes / self.bytes_per_s + self.FLOOR_S

    def observed(self, nbytes: int, seconds: float) -> None:
        """Takes in one copy's bytes and its time from issue to done (an average that follows a
        change of link or load within a few batches)."""
        if nbytes and seconds > 0:
            self.bytes_per_s += 0.25 * (nbytes / seconds - self.bytes_per_s)


def _close_pools(pools: list[BlockPool]) -> None:
    for pool in pools:
        if pool.close():
            pool.memory.close()
        else:
            _closing.add(pool)
