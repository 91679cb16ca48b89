"""Batch: the public type of one global batch on the devices, whichever framework holds it.

`isinstance(batch, fp.Batch)` holds for a TensorFlow feeder's batch and a JAX feeder's alike,
and asks nothing of either framework: this module imports none. Each framework's batch
(`feedpipe.tf.batch`, `feedpipe.jax.batch`) subclasses it and adds `distributed()`, the batch
as that framework's distributed step takes it.
"""

from __future__ import annotations

from typing import Any


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

    A batch is also a context manager for the step that uses it. The feeder counts a batch as
    taken once the loop takes it, and cannot tell a loop left by an exception from one left by
    `break`; a `with batch:` block left by an exception (Ctrl-C in the step, an error) gives
    the batch back: `get_state()` and the next loop go on from it, unless the loop takes the
    next batch first.
    """

    __slots__ = ("_lender", "epoch", "masks", "num_valid", "replicas", "step")

    def __init__(self, replicas: tuple, masks: tuple, num_valid: int, epoch: int, step: int):
        self.replicas = replicas
        self.masks = masks
        self.num_valid = num_valid
        self.epoch = epoch
        self.step = step
        self._lender: Any = None
        """Who takes the batch back if its `with` block raises: a weak reference to the
        consumer's `give_back` and the loop that handed the batch out (None: no one, as for
        the batches a framework's `fit` reads)."""

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is None or self._lender is None:
            return
        give_back, loop = self._lender
        give_back = give_back()
        if give_back is not None:  # the feeder is still there
            give_back(loop, self.epoch, self.step)

    def handed_over(self) -> None:
        """Called in the consumer's thread as the batch is handed to it: a framework whose
        copies run on streams of their own makes the consumer's stream wait for them."""

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )
