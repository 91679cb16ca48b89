"""Batch: the public type of one global batch on the devices, whichever framework holds it.

`isinstance(batch, fp.Batch)` holds for a TensorFlow feeder's batch and a JAX feeder's alike,
and asks nothing of either framework: this module imports none. Each framework's batch
(`feedpipe.tf.batch`, `feedpipe.jax.batch`) subclasses it and adds `distributed()`, the batch
as that framework's distributed step takes it, and how it takes a batch's real rows alone.
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
    sharded over the feeder's devices), and `real_rows()`: the sample's real rows alone, for a
    step on one device.

    A batch is also a context manager for the step that uses it. The feeder counts a batch as
    taken once the loop takes it, and cannot tell a loop left by an exception from one left by
    `break`; a `with batch:` block left by an exception (Ctrl-C in the step, an error) gives
    back the batch and every batch the loop took after it (one read ahead): `get_state()` and
    the next loop go on from it, unless the loop takes its next batch first. A later `with
    batch:` block on it that ends well (a retry) takes it again.
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
        consumer's `block_ended` and the loop that handed the batch out (None: no one, as for
        the batches a framework's `fit` reads)."""

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._lender is None:
            return
        block_ended, loop = self._lender
        block_ended = block_ended()
        if block_ended is not None:  # the feeder is still there
            block_ended(loop, self.epoch, self.step, failed=error is not None)

    def real_rows(self) -> Any:
        """The sample's real rows alone, on the feeder's one device: the batch as a loop on
        one device takes it, with the same structure and fields as `replicas[0]`.

        Padding rows are repeats of real ones, weighted zero by the masks; a step that reads
        every row lets them into what no mask reaches: Dropout draws for them, BatchNorm counts
        them in its statistics, a sum without the mask adds them. With the real rows alone, a
        padded last batch is the short batch a `DataLoader` (or `fit(x, y)`) gives. Full batches
        come as they are, without a copy.

        On several devices (of this process, or of several processes) the devices' real rows
        differ in number, and a step's collectives need equal shapes: there, read every row and
        weigh them by the masks (`distributed()`, `replicas` and `masks`).
        """
        if len(self.masks) != 1 or self._hosts() != 1:
            raise ValueError(
                f"batch.real_rows() gives the real rows of a feeder on one device, but this "
                f"batch spans {self._devices_named()}, whose real rows differ in number; take "
                "every row and weigh padding zero by the masks: batch.distributed() for the "
                "distributed step, or batch.replicas[i] with batch.masks[i] for device i."
            )
        (replica,), (mask,) = self.replicas, self.masks
        if self.num_valid == mask.shape[0]:
            return replica
        return self._rows(replica, mask)

    def _devices_named(self) -> str:
        """The devices the batch spans, as a refusal names them."""
        devices = f"{len(self.masks)} device{'s' if len(self.masks) > 1 else ''}"
        hosts = self._hosts()
        return devices if hosts == 1 else f"{devices} on each of {hosts} processes"

    def _hosts(self) -> int:
        """The processes that share the global batch, each with its rows."""
        return 1

    def _rows(self, replica: Any, mask: Any) -> Any:
        """The rows of every field of `replica` where `mask` is True (the framework's way to
        select rows by a boolean mask)."""
        raise NotImplementedError

    def __iter__(self) -> Any:
        raise TypeError(
            f"A Batch is one global batch, not a sequence of its fields, so it cannot be "
            f"unpacked (as in `for x, y in feeder`). Iterate the feeder as `for batch in "
            f"feeder` and take its fields: batch.real_rows() for the real rows alone on one "
            "device (e.g. x, y = batch.real_rows()), batch.distributed() for (inputs, mask) as "
            "a distributed step takes them, or batch.replicas[i] and batch.masks[i] for "
            f"device i's rows ({self!r})."
        )

    def handed_over(self) -> None:
        """Called in the consumer's thread as the batch is handed to it: a framework whose
        copies run on streams of their own makes the consumer's stream wait for them."""

    def __repr__(self) -> str:
        return (
            f"Batch(epoch={self.epoch}, step={self.step}, replicas={len(self.replicas)}, "
            f"num_valid={self.num_valid})"
        )
