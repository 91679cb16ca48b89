"""State: the consumer's position as a small JSON-serialisable dict, and the rules for restoring it.

A state is plain data (ints, bools, strings), so any checkpoint format holds it: a TensorFlow
checkpoint through `feedpipe.tf`'s adapter, an Orbax or JSON file as a dict. It names the fields
the stream's order depends on; a state restores only into a feeder that agrees on them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from feedpipe.core.checks import check_int

STATE_VERSION = 1


class Position(NamedTuple):
    """Where a stream of batches starts: an epoch and a step within it."""

    epoch: int
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Stream:
    """What a feeder's order depends on, and so what a state must agree with to restore."""

    dataset_length: int | None
    global_batch_size: int
    num_replicas: int
    num_shards: int
    """The generator shards whose rotation is the order (1 for other sources)."""
    seed: int
    shuffle: bool
    steps_per_epoch: int | None
    """None where the source's length is unknown."""
    replicas_order: bool = False
    """Each replica reads a shard of its own (DALI), so the order depends on the replicas."""

    def state(self, position: Position) -> dict:
        """The state at `position`; the step past an epoch's last is the next epoch's first."""
        epoch, step = position
        if self.steps_per_epoch is not None and step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "step": step,
            "dataset_length": self.dataset_length,
            "global_batch_size": self.global_batch_size,
            "num_replicas": self.num_replicas,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def order_fields(self) -> dict:
        """The fields the order of every global batch depends on, by name: the hosts of a
        multi-worker strategy each make their rows of that order, so theirs must agree (the
        derived steps_per_epoch last, so that a difference names its cause first)."""
        return {
            "dataset_length": self.dataset_length,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_shards": self.num_shards,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def after(self, position: Position, steps: int) -> Position:
        """`position` moved on by `steps` batches, across epochs' ends (their length known)."""
        epoch, step = position
        epoch, step = divmod(epoch * self.steps_per_epoch + step + steps, self.steps_per_epoch)
        return Position(epoch, step)

    def position(self, state: dict) -> Position:
        """Where `state` continues the stream; raises, naming the field, if it cannot here.

        The order is the same for any number of replicas and hosts (elastic resume), unless
        each replica reads a shard of its own.
        """
        mine = self.state(Position(0, 0))
        state = {"num_shards": 1, **state}  # states written before shards were recorded
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"The state lacks {', '.join(missing)}; pass a dict from get_state().")
        fields = ["version", "dataset_length", "global_batch_size", "num_shards", "seed", "shuffle"]
        if self.replicas_order:
            fields.append("num_replicas")
        for field in fields:
            if state[field] != mine[field]:
                fix = (
                    f"build the feeder with workers={state[field]} (a generator's order is the "
                    "rotation of its shards, one per worker)"
                    if field == "num_shards"
                    else f"build the feeder with the same {field}"
                )
                raise ValueError(
                    f"Cannot restore: the state has {field}={state[field]!r} but this feeder has "
                    f"{field}={mine[field]!r}; {fix}."
                )
        for field in ("epoch", "step"):
            check_int(f"state[{field!r}]", state[field], "pass a dict from get_state()", minimum=0)
        if self.steps_per_epoch is not None and state["step"] >= self.steps_per_epoch:
            raise ValueError(
                f"The state's step={state['step']} must be below {self.steps_per_epoch}, the "
                f"steps of an epoch here; get_state() at an epoch's end says step 0 of the next "
                f"epoch: pass {{'epoch': {state['epoch'] + 1}, 'step': 0, ...}}."
            )
        return Position(state["epoch"], state["step"])
