"""Host memory posing as a device's, for the copy engine's tests on a machine without a GPU.

`HostMemory` is a `feedpipe.core.copy_engine.DeviceMemory` whose "device memory" is host memory
exported with DLPack as host memory, so numpy or JAX's CPU devices take it as a GPU framework
takes a CUDA buffer. It checks the engine's invariant as it goes: a copy into memory that an
export handed out and not yet released still points into raises, and freed memory is filled with
a poison value (and kept mapped), so a reader the engine freed too early reads garbage, not a
crash. `ManualFence` is a fence the test completes by hand.
"""

from __future__ import annotations

import ctypes

import numpy as np

from feedpipe.core import dlpack
from feedpipe.core.slots import aligned_buffer

POISON = 0xEE


class HostMemory:
    """One fake device: its memory, its "stream" (copies run when `wait` is called) and counts."""

    dlpack_type = dlpack.DEVICE_CPU

    def __init__(self, ordinal: int = 0, fail_allocation: Exception | None = None):
        self.ordinal = ordinal
        self.fail_allocation = fail_allocation
        self.blocks: dict[int, np.ndarray] = {}
        """Live allocations by address."""
        self.freed: list[np.ndarray] = []
        """Freed allocations, poisoned and kept mapped."""
        self.copies = 0
        self.closed = False
        self._pending: list[tuple[int, int, int]] = []

    def allocate(self, nbytes: int) -> int:
        if self.fail_allocation is not None:
            raise self.fail_allocation
        block = aligned_buffer(nbytes, 256)
        self.blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, address: int) -> None:
        block = self.blocks.pop(address)
        block.fill(POISON)
        self.freed.append(block)

    def copy(self, pairs: list[tuple[int, int, int]]) -> None:
        for device_address, _, nbytes in pairs:
            for _released, (managed, _shape) in list(dlpack._live.values()):
                read = managed.dl_tensor.data
                if device_address <= read < device_address + nbytes:
                    raise AssertionError(
                        f"a copy into {device_address:#x} overwrites an export still read"
                    )
        self._pending.extend(pairs)

    def wait(self, expected_s: float) -> None:
        for device_address, host_address, nbytes in self._pending:
            ctypes.memmove(device_address, host_address, nbytes)
            self.copies += 1
        self._pending.clear()

    def close(self) -> None:
        self.closed = True


class ManualFence:
    """A fence that is ready once the test says so (or once something waits for it, which
    stands for the device finishing its queued steps)."""

    def __init__(self, log: list[ManualFence]):
        self.ready = False
        self.waited = False
        log.append(self)

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self) -> ManualFence:
        self.waited = self.ready = True
        return self
