"""Batch: one global batch as a TensorFlow step takes it, each replica's rows on its device."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from feedpipe.core import batch as core
from feedpipe.core.split import HostShare


class Batch(core.Batch):
    """One global batch, already on the devices: what the training step takes (the fields are
    `fp.Batch`'s, every array a `tf.Tensor`).

    Under a MultiWorkerMirroredStrategy, `replicas` and `masks` are this host's replicas only.
    """

    __slots__ = ("_share", "_strategy")

    def __init__(
        self,
        replicas,
        masks,
        num_valid: int,
        epoch: int,
        step: int,
        strategy=None,
        share: HostShare | None = None,
    ):
        super().__init__(replicas, masks, num_valid, epoch, step)
        self._strategy = strategy
        self._share = share

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
        share = self._share
        total = len(self.replicas) if share is None else share.num_replicas
        if strategy.num_replicas_in_sync != total:
            raise ValueError(
                f"The strategy has {strategy.num_replicas_in_sync} replicas but the batch was "
                f"staged for {total} replicas; build the feeder with strategy=."
            )
        # The strategy numbers replicas across hosts; this host holds from its first on.
        first = 0 if share is None else share.first_replica

        def local(context):
            replica = context.replica_id_in_sync_group - first
            return self.replicas[replica], self.masks[replica]

        return strategy.experimental_distribute_values_from_function(local)

    def _hosts(self) -> int:
        return 1 if self._share is None else self._share.num_hosts

    def _rows(self, replica: Any, mask: Any) -> Any:
        return tf.nest.map_structure(lambda field: tf.boolean_mask(field, mask), replica)
