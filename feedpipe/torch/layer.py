"""The PyTorch layer: what the core needs from PyTorch to stage batches.

Devices are `torch.device`s, this process's by default, and under `torch.distributed` each
process stages its rank's rows of every global batch (`feedpipe.torch.devices`). On CUDA each
replica's rows are copied on a stream of the feeder's own per device; on the CPU they are the
slot's memory itself (`feedpipe.torch.stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from feedpipe.core.agreement import Tally
from feedpipe.core.copy_engine import NO_COPY, CopyPath
from feedpipe.core.pinned import page_locker
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.core.split import HostShare
from feedpipe.core.stage import refuse_unstageable
from feedpipe.torch import agreement
from feedpipe.torch.devices import rank_and_world_size, resolve_devices
from feedpipe.torch.stage import Stager, from_numpy

OWN_STREAM = "torch stream"
"""`CopyPath.name` where torch copies on a CUDA stream of the feeder's own."""


class TorchLayer:
    """Stages on PyTorch devices: this process's, under `torch.distributed` one share of each
    global batch per process (rank order)."""

    name = "torch"

    def __init__(self, devices: Any, strategy: Any, global_batch_size: int):
        if strategy is not None:
            raise TypeError(
                f"`strategy`={strategy!r} is TensorFlow's; a PyTorch feeder takes its devices "
                "(devices=[torch.device('cuda:0')]) and, with several processes, its rank from "
                "torch.distributed."
            )
        self.devices = resolve_devices(devices)
        self.rank, self.world_size = rank_and_world_size()
        self.share = HostShare(global_batch_size, self.world_size, self.rank, len(self.devices))
        self.cuda = all(d.type == "cuda" for d in self.devices)
        """Whether every device is a CUDA GPU: copies then run on streams of the feeder's own."""
        self.accelerated = any(d.type != "cpu" for d in self.devices)
        self.page_lock = page_locker() if self.accelerated else None
        if self.cuda:
            self.copy_path = CopyPath(
                OWN_STREAM,
                "each replica's rows are copied from a page-locked slot on a CUDA stream of the "
                "feeder's own; the step's stream waits only for its own batch's copy",
            )
        elif self.accelerated:
            self.copy_path = CopyPath(
                "tensor.to", f"the devices are {self.devices[0].type}: torch copies in order"
            )
        else:
            self.copy_path = NO_COPY

    def check_stageable(self, spec: SampleSpec, values: Sequence[np.ndarray] | None) -> SampleSpec:
        """Refuses a field PyTorch cannot hold (float128, ml_dtypes' int4); PyTorch keeps every
        dtype it takes, ml_dtypes' bfloat16 and float8 included (`from_numpy`), so the fields
        arrive as they are (`values` is not read)."""
        device = self.devices[0]
        refuse_unstageable(spec, "PyTorch", device, lambda a: from_numpy(a).to(device))
        return spec

    def tally(self, payload: bytes) -> Tally:
        """Every rank's `payload` compared with rank 0's, through the process group's store
        (`feedpipe.torch.agreement`)."""
        return agreement.tally(self.rank, self.world_size, payload)

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        stats.copy_path = self.copy_path.name
        return Stager(self, layout, stats)

    def close(self) -> None:
        """Torch's allocator owns the device memory: nothing to let go of."""
