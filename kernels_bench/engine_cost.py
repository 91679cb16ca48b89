"""How much Python does the staging thread spend on each batch on the copy engine's path,
besides the copy itself, and how many fences does a batch cost?

On a GPU every microsecond of Python around a copy is a microsecond the link idles: at 2 MiB
the copy takes 0.05 ms, and the fixed costs around it (a fence dispatched per copy, JAX's
public DLPack import, the capsule, a sleeping wait) took 0.49 ms more on an H100. Here, with
no GPU, the engine runs its whole path with host memory posing as device memory
(`HostDeviceMemory`: its "copy" is a `memmove` when the wait is called, timed apart), and JAX's
CPU devices import the exports through DLPack as its GPU devices import CUDA memory.

A `fp.Feeder` over a 2-field in-memory source (`--rows`, 784 float32 features and an int32
label, global batch `--batch`, 1 and 2 CPU devices) feeds a consumer that keeps each batch for one
step and drops it, as a training loop does. The staging thread's time by stage comes from
`feeder.stats().stage_ms`; the Python besides the copy is fence + copy issued + copy waited
(less the `memmove`) + import, per batch. Beside it, the same feeder with JAX's public import
(`jax.dlpack.from_dlpack`), the path before this case, as a ratio.

Targets: Python besides the copy <= 60 µs a batch (2 fields) on one device (and 60 µs more a
device: each has its own block, copies and imports), and at most 0.1 fences a batch per device
in the steady state.

Run: `python -m kernels_bench.engine_cost [--quick]`; writes
`kernels_bench/results/engine_cost.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
# Set before JAX starts: its CPU devices are the fake GPUs.

import numpy as np

from kernels_bench import harness

DEVICE_COUNTS = (1, 2)
PYTHON_TARGET_US = 60.0
FENCES_TARGET = 0.1


class HostDeviceMemory:
    """Host memory posing as one device's (`feedpipe.core.copy_engine.DeviceMemory`): copies run
    as one `memmove` each when waited for, and their time is kept apart (`memmove_s`)."""

    def __init__(self, ordinal: int):
        from feedpipe.core import dlpack
        from feedpipe.core.slots import aligned_buffer

        self.dlpack_type = dlpack.DEVICE_CPU
        self.ordinal = ordinal
        self._aligned_buffer = aligned_buffer
        self._blocks: dict[int, np.ndarray] = {}
        self._pending: list[tuple[int, int, int]] = []
        self.memmove_s = 0.0

    def allocate(self, nbytes: int) -> int:
        block = self._aligned_buffer(nbytes, 256)
        self._blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, address: int) -> None:
        del self._blocks[address]

    def copy(self, pairs: list[tuple[int, int, int]]) -> None:
        self._pending.extend(pairs)

    def wait(self, expected_s: float) -> None:
        started = time.perf_counter()
        for device_address, host_address, nbytes in self._pending:
            ctypes.memmove(device_address, host_address, nbytes)
        self._pending.clear()
        self.memmove_s += time.perf_counter() - started

    def close(self) -> None:
        self._blocks.clear()


@contextlib.contextmanager
def host_devices():
    """Every JAX feeder made in the block copies on the engine into `HostDeviceMemory`."""
    from feedpipe.core.copy_engine import OWN_STREAMS, CopyPath
    from feedpipe.jax import layer

    made: list[HostDeviceMemory] = []

    def memories(devices):
        fresh = [HostDeviceMemory(device.local_hardware_id) for device in devices]
        made.extend(fresh)
        return fresh, CopyPath(OWN_STREAMS, "host memory posing as device memory")

    original = layer._device_memories
    layer._device_memories = memories
    try:
        yield made
    finally:
        layer._device_memories = original


@contextlib.contextmanager
def public_import():
    """JAX's public DLPack import, for every feeder made in the block."""
    from feedpipe.jax import stage

    original = stage._direct_import
    stage._direct_import = lambda: None
    try:
        yield
    finally:
        stage._direct_import = original


def run_feeder(rows: int, batch: int, devices: int, steps: int, warm: int) -> dict:
    """The staging thread's stages per batch over `steps` batches after `warm` ones."""
    import jax

    import feedpipe as fp

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 784), dtype=np.float32)
    y = rng.integers(0, 10, rows).astype(np.int32)
    with host_devices() as memories, fp.Feeder((x, y), batch, devices=jax.devices()[:devices]) as f:
        loop = iter(f)
        kept = None
        taken = 0
        before = None
        while taken < warm + steps:
            try:
                kept = next(loop)  # the previous batch is dropped as this one is taken
            except StopIteration:
                loop = iter(f)
                continue
            taken += 1
            if taken == warm:
                time.sleep(0.05)  # the staging thread fills the pipeline again
                before = (f.stats(), sum(m.memmove_s for m in memories))
        del kept
        loop.close()
        after = f.stats()
        memmove_s = sum(m.memmove_s for m in memories) - before[1]
    first = before[0]
    batches = after.staged_batches - first.staged_batches
    stage_us = {
        stage: (after.stage_s[stage] - first.stage_s.get(stage, 0.0)) / batches * 1e6
        for stage in after.stage_s
    }
    memmove_us = memmove_s / batches * 1e6
    python_us = (
        stage_us["fence"]
        + stage_us["copy issued"]
        + max(stage_us["copy waited"] - memmove_us, 0.0)
        + stage_us["import"]
    )
    return {
        "batches": batches,
        "stage_us": stage_us,
        "memmove_us": memmove_us,
        "python_us": python_us,
        "fences_per_batch": (after.fences - first.fences) / batches,
        "device_blocks": after.device_blocks,
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=8192, help="rows of the in-memory source")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=2000, help="timed batches per repetition")


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, add_args, argv)
    args = settings.args
    steps = settings.pick(300, args.steps)
    report = harness.Report(
        "engine_cost",
        "the staging thread's Python per batch on the copy engine's path, besides the copy, "
        "and fences per batch, with host memory posing as device memory",
        settings,
        "kernels_bench.engine_cost",
    )
    run_feeder(args.rows, args.batch, 1, 50, 10)  # first imports and compiles, untimed
    for devices in DEVICE_COUNTS:
        case = f"2-field batch, {devices} CPU device{'s' if devices > 1 else ''}"
        params = {
            "global_batch": args.batch,
            "fields": "784 float32 features, an int32 label",
            "batch_bytes": args.batch * (784 * 4 + 4),
            "devices": devices,
            "steps": steps,
            "memory": "host memory posing as device memory (HostDeviceMemory)",
        }
        reps = []
        for _ in range(settings.reps):
            direct = run_feeder(args.rows, args.batch, devices, steps, 40)
            with public_import():
                public = run_feeder(args.rows, args.batch, devices, steps, 40)
            rep = {
                "python_us": direct["python_us"],
                "public_import_python_us": public["python_us"],
                "public_over_direct": public["python_us"] / direct["python_us"],
                "fences_per_batch": direct["fences_per_batch"],
                "memmove_us": direct["memmove_us"],
                "device_blocks": direct["device_blocks"],
            }
            rep.update({f"{k.replace(' ', '_')}_us": v for k, v in direct["stage_us"].items()})
            reps.append(rep)
        units = {key: "us" for key in reps[0] if key.endswith("_us")}
        report.add_case(case, params, reps, units)
        report.target(
            case,
            "python_us",
            "<=",
            PYTHON_TARGET_US * devices,
            f"Python per 2-field batch besides the copy, µs ({PYTHON_TARGET_US:g} a device)",
        )
        report.target(case, "fences_per_batch", "<=", FENCES_TARGET, "fences per batch per device")
    report.finish()


if __name__ == "__main__":
    main()
