"""Batch: one global batch as the consumer takes it, on the devices or on the host."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf


class Batch:
    """One global batch, already on the devices: what the training step takes.

    Attributes:
      replicas: one entry per device, in device order: the sample's structure with every field
        a `tf.Tensor` on that device whose leading dimension is the per-replica batch.
      masks: one boolean `tf.Tensor` `[per_replica_batch]` per device; True marks a real
        sample, False a padding row (only the last batch of an epoch has any).
      num_valid: real samples in the global batch.
      epoch, step: where the batch sits in the stream.
    """

    __slots__ = ("_strategy", "epoch", "masks", "num_valid", "replicas", "step")

    def __init__(self, replicas, masks, num_valid: int, epoch: int, step: int, strategy=None):
        self.replicas = replicas
        self.masks = masks
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step
        self._strategy = strategy

    def distributed(self, strategy: tf.distribute.Strategy | None = None) -> tuple[Any, Any]:
        """`(inputs, mask)` as per-replica values for `strategy.run`.

        Uses `strategy`, else the feeder's, else the strategy whose scope is active.
        """
        strategy = strategy or self._strategy
        if strategy is None:
            if not tf.distribute.has_strategy():
                raise ValueError(
                    "Batch.distributed() needs a tf.distribute strategy: pass strategy= to "
                    "fp.Feeder or to distributed(), or call it inside strategy.scope()."
                )
            strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync != len(self.replicas):
            raise ValueError(
                f"The strategy has {strategy.num_replicas_in_sync} replicas but the batch was "
                f"staged for {len(self.replicas)} devices; build the feeder with strategy=."
            )
        pairs = strategy.experimental_distribute_values_from_function(
            lambda context: (
                self.replicas[context.replica_id_in_sync_group],
                self.masks[context.replica_id_in_sync_group],
            )
        )
        return pairs

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )


class HostBatch:
    """A global batch on the host: one array per field, padding rows last unless `real` says
    which rows are real (sources that fill each replica from its own shard)."""

    __slots__ = ("arrays", "epoch", "num_valid", "real", "step")

    def __init__(
        self,
        arrays: list[np.ndarray],
        num_valid: int,
        epoch: int,
        step: int,
        real: np.ndarray | None = None,
    ):
        self.arrays = arrays
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step
        self.real = real
