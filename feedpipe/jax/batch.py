"""Batch: one global batch as a JAX step takes it, each replica's rows on its device."""

from __future__ import annotations

from typing import Any

import jax
import optree
from jax.sharding import Sharding


class Batch:
    """One global batch, already on the devices: what the training step takes.

    Attributes:
      replicas: one entry per device of this process, in mesh order: the sample's structure
        with every field a `jax.Array` on that device whose leading dimension is the
        per-replica batch.
      masks: one boolean `jax.Array` `[per_replica_batch]` per device; True marks a real
        sample, False a padding row (only the last batch of an epoch has any).
      num_valid: real samples in the global batch (of every process: the same number on each,
        so each normalises its loss by it).
      epoch, step: where the batch sits in the stream.
    """

    __slots__ = ("_global", "_layer", "epoch", "masks", "num_valid", "replicas", "step")

    def __init__(self, replicas, masks, num_valid: int, epoch: int, step: int, layer: Any):
        self.replicas = replicas
        self.masks = masks
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step
        self._layer = layer
        self._global: tuple[Any, Any] | None = None

    def distributed(self, sharding: Sharding | None = None) -> tuple[Any, Any]:
        """`(inputs, mask)` as global `jax.Array`s, axis 0 sharded over the feeder's devices.

        The replicas' arrays become the shards as they are (no copy), across every process
        under `jax.distributed`. With `sharding` (one of the same devices) JAX moves the
        shards there; without it, the feeder's: a 1-D mesh over its devices, or its mesh.
        """
        if self._global is None:
            self._global = (self._assemble(self.replicas), self._assemble(self.masks))
        if sharding is None:
            return self._global
        return jax.device_put(self._global, sharding)

    def _assemble(self, per_device: Any) -> Any:
        """The global arrays whose shards are `per_device`'s leaves, field by field."""
        layer = self._layer
        size = layer.share.global_batch_size
        leaves = [optree.tree_leaves(replica) for replica in per_device]
        treespec = optree.tree_structure(per_device[0])
        fields = []
        for shards in zip(*leaves, strict=True):
            shape = (size, *shards[0].shape[1:])
            fields.append(
                jax.make_array_from_single_device_arrays(shape, layer.sharding, list(shards))
            )
        return optree.tree_unflatten(treespec, fields)

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )
