"""Batch: one global batch as a PyTorch step takes it, each replica's rows on its device."""

from __future__ import annotations

from typing import Any

import optree
import torch

from feedpipe.core import batch as core


class Batch(core.Batch):
    """One global batch, already on the devices: what the training step takes (the fields are
    `fp.Batch`'s, every array a `torch.Tensor`; under `torch.distributed`, this process's
    devices only).

    On a CUDA device the tensors were copied on a stream of the feeder's own; when the batch is
    handed to the consumer, the consumer's current stream is made to wait for that copy (and
    nothing else), and torch's allocator is told that stream reads the memory.

    Its `masks` are its own: torch tensors can be written in place (`mask &= y >= 0`), so a
    mask shared with later batches of the same pattern of real rows would change theirs.
    """

    __slots__ = ("_copies",)

    def __init__(
        self,
        replicas: tuple,
        masks: tuple,
        num_valid: int,
        epoch: int,
        step: int,
        copies: list[tuple[Any, Any]] | None = None,
    ):
        super().__init__(replicas, masks, num_valid, epoch, step)
        self._copies = copies
        """Per CUDA device: its device and the event recorded after the copies to it."""

    def handed_over(self) -> None:
        """The consumer's stream on each device waits for this batch's copies (see the class)."""
        if not self._copies:
            return
        for (device, event), replica, mask in zip(
            self._copies, self.replicas, self.masks, strict=True
        ):
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            for tensor in (*optree.tree_leaves(replica), mask):
                tensor.record_stream(stream)

    def distributed(self) -> tuple[Any, Any]:
        """`(inputs, mask)` of this process's one device, as a `DistributedDataParallel` step
        (one process per device) or a single-device step takes them."""
        if len(self.replicas) != 1:
            raise ValueError(
                f"batch.distributed() gives one device's tensors, but this feeder stages on "
                f"{len(self.replicas)} devices; read batch.replicas[i] and batch.masks[i] for "
                "device i, or run one process per device (torch.distributed) with one device "
                "each."
            )
        return self.replicas[0], self.masks[0]

    def _hosts(self) -> int:
        dist = torch.distributed  # a feeder is shared by every rank of an initialized group
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _rows(self, replica: Any, mask: Any) -> Any:
        return optree.tree_map(lambda field: field[mask], replica)
