"""Batch: the public type of one global batch on the devices, whichever framework holds it.

`isinstance(batch, fp.Batch)` holds for a TensorFlow feeder's batch and a JAX feeder's alike,
and asks nothing of either framework: this module imports none. Each framework's batch
(`feedpipe.tf.batch`, `feedpipe.jax.batch`) subclasses it and adds `distributed()`, the batch
as that framework's distributed step takes it.
"""

from __future__ import annotations


class Batch:
    """One global batch whose rows already sit on the devices: what a framework's step takes.

    Attributes:
      replicas: one entry per device of this host, in replica order: the sample's structure
        with every field an array of the framework on that device, whose leading dimension is
        the per-replica batch.
      masks: one boolean array `[per_replica_batch]` per device; True marks a real sample,
        False a padding row (only the last batch of an epoch has any).
      num_valid: real samples in the global batch (of every host: the same number on each, so
        each normalises its loss by it).
      epoch, step: where the batch sits in the stream.

    Every framework's batch also has `distributed()`: `(inputs, mask)` as its distributed step
    takes them (TensorFlow: per-replica values for `strategy.run`; JAX: global `jax.Array`s
    sharded over the feeder's devices).
    """

    __slots__ = ("epoch", "masks", "num_valid", "replicas", "step")

    def __init__(self, replicas: tuple, masks: tuple, num_valid: int, epoch: int, step: int):
        self.replicas = replicas
        self.masks = masks
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step

    def handed_over(self) -> None:
        """Called in the consumer's thread as the batch is handed to it: a framework whose
        copies run on streams of their own makes the consumer's stream wait for them."""

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )
