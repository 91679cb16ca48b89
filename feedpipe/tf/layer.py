"""The TensorFlow layer: what the core needs from TensorFlow to stage batches.

Devices are TensorFlow device strings (or a `tf.distribute` strategy's replicas); each
replica's rows are wrapped through DLPack and placed on its device (`feedpipe.tf.stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from feedpipe.core.agreement import Tally, tally_of
from feedpipe.core.copy_engine import NO_COPY, CopyPath
from feedpipe.core.description import is_cpu
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.slots import SlotLayout
from feedpipe.core.sources import SampleSpec
from feedpipe.tf import agreement
from feedpipe.tf.devices import host_share, resolve_devices
from feedpipe.tf.stage import Stager, check_stageable


class TensorFlowLayer:
    """Stages on TensorFlow devices, for a strategy's replicas or a list of device strings."""

    name = "tensorflow"

    def __init__(self, devices: Sequence[str] | None, strategy: Any, global_batch_size: int):
        self.devices = resolve_devices(devices, strategy)
        self.strategy = strategy
        self.share = host_share(global_batch_size, strategy, len(self.devices))
        self.page_lock = None
        """Slots stay pageable: TensorFlow's GPU runtime is not asked to page-lock them."""
        self.copy_path = (
            NO_COPY
            if all(is_cpu(device) for device in self.devices)
            else CopyPath(
                "tensorflow",
                "TensorFlow copies to its GPUs itself, and its copy waits for the compute queued "
                "before it; feedpipe's own copy streams are not used with TensorFlow",
            )
        )

    def check_stageable(self, spec: SampleSpec, values: Sequence[np.ndarray] | None) -> SampleSpec:
        """TensorFlow keeps every dtype it takes: the fields arrive as they are (`values` is
        not read)."""
        check_stageable(spec, self.devices[0])
        return spec

    def tally(self, payload: bytes) -> Tally:
        """Every host's `payload` compared with host 0's, through the strategy's all-gathers
        (`feedpipe.tf.agreement`)."""
        return tally_of(agreement.exchange(self.strategy, self.share, payload))

    def stager(self, layout: SlotLayout, stats: StatsRecorder) -> Stager:
        """TensorFlow's copies run inside its own runtime, untimed: `stats` is not used."""
        return Stager(self.devices, layout, self.strategy, self.share)

    def close(self) -> None:
        """TensorFlow owns its device memory: nothing to let go of."""
