"""Batch: one global batch as a JAX step takes it, each replica's rows on its device."""

from __future__ import annotations

from typing import Any

import jax
import optree
from jax.sharding import Sharding

from feedpipe.core import batch as core


class Batch(core.Batch):
    """One global batch, already on the devices: what the training step takes (the fields are
    `fp.Batch`'s, every array a `jax.Array`; under `jax.distributed`, this process's
    devices only).

    A batch staged on CPU devices is made as global arrays (`inputs`); its `replicas` are
    their shards, taken out the first time they are asked for.
    """

    __slots__ = ("_inputs", "_layer", "_mask")

    def __init__(
        self,
        replicas: tuple | None,
        masks: tuple,
        num_valid: int,
        epoch: int,
        step: int,
        mask: jax.Array,
        layer: Any,
        inputs: Any = None,
    ):
        super().__init__(replicas, masks, num_valid, epoch, step)
        self._mask = mask
        self._layer = layer
        self._inputs: Any = inputs

    @property
    def replicas(self) -> tuple:
        """One entry per device of this process, in mesh order: the sample's structure, each
        field that device's rows (see `fp.Batch`)."""
        replicas = core.Batch.replicas.__get__(self)
        if replicas is None:
            leaves, treespec = optree.tree_flatten(self._inputs)
            replicas = tuple(
                optree.tree_unflatten(treespec, [leaf.addressable_data(i) for leaf in leaves])
                for i in range(len(self._layer.devices))
            )
            core.Batch.replicas.__set__(self, replicas)
        return replicas

    @replicas.setter
    def replicas(self, replicas: tuple | None) -> None:
        core.Batch.replicas.__set__(self, replicas)

    def distributed(self, sharding: Sharding | None = None) -> tuple[Any, Any]:
        """`(inputs, mask)` as global `jax.Array`s, axis 0 sharded over the feeder's devices.

        The replicas' arrays become the shards as they are (no copy), across every process
        under `jax.distributed`: there each process holds its share of the rows, a contiguous
        block in process order, and the array is the one that
        `jax.make_array_from_process_local_data(feeder.sharding, rows)` makes from those rows,
        without copying them again. With `sharding` (one of the same devices) JAX moves the
        shards there; without it, the feeder's: a 1-D mesh over its devices, or its mesh.
        """
        if self._inputs is None:
            self._inputs = self._layer.global_arrays(self.replicas)
        if sharding is None:
            return self._inputs, self._mask
        return jax.device_put((self._inputs, self._mask), sharding)

    def _hosts(self) -> int:
        return len(self._layer.processes)

    def _rows(self, replica: Any, mask: Any) -> Any:
        return optree.tree_map(lambda field: field[mask], replica)
