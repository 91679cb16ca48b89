"""The PyTorch feeder: each replica's rows as a `torch.Tensor` on its own device, `depth` ahead.

`fp.Feeder(...)` is this class where `devices` are `torch.device`s, `framework="torch"`, or
PyTorch is the framework in use (see `feedpipe._frameworks`). Its state follows PyTorch's
checkpoint convention as every feeder's does: `state_dict()` / `load_state_dict()`
(`feedpipe.feeder`), a small plain dict that `torch.save` keeps beside the model's and optimizer's.
"""

from __future__ import annotations

from typing import Any

from feedpipe import feeder as core
from feedpipe.torch.keras import KerasLoader, keras_batches
from feedpipe.torch.layer import TorchLayer


class Feeder(core.Feeder):
    """A feeder whose batches are `torch.Tensor`s on PyTorch devices (see `feedpipe.Feeder`)."""

    def _layer(self, devices: Any, strategy: Any, global_batch_size: int) -> TorchLayer:
        return TorchLayer(devices, strategy, global_batch_size)

    def _keras_batches(self, reading: str | None, class_weight: dict | None) -> KerasLoader:
        """What Keras's torch trainer reads from this feeder (`feedpipe.torch.keras`)."""
        return keras_batches(self, reading=reading, class_weight=class_weight)
