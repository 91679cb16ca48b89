"""Split: which rows of a global batch go to which replica.

Replica `r` takes the contiguous rows `[r * b, (r + 1) * b)` of each global batch of `b * R`
rows, so the global batch (its rows, padding and masks) does not depend on the replica count,
and each replica's rows can be written straight into a region of their own (`feedpipe.slots`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSplit:
    """Cuts a global batch into equal contiguous per-replica sub-batches."""

    global_batch_size: int
    num_replicas: int

    def __post_init__(self):
        for name, value in (
            ("global_batch_size", self.global_batch_size),
            ("num_replicas", self.num_replicas),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive integer.")
        if self.global_batch_size % self.num_replicas:
            example = self.num_replicas * max(1, self.global_batch_size // self.num_replicas)
            raise ValueError(
                f"`global_batch_size`={self.global_batch_size} is not divisible by the "
                f"{self.num_replicas} replicas; use a multiple of {self.num_replicas} "
                f"(for example {example})."
            )

    @property
    def per_replica(self) -> int:
        return self.global_batch_size // self.num_replicas

    def rows(self, replica: int) -> range:
        """The rows of the global batch that `replica` receives."""
        return range(replica * self.per_replica, (replica + 1) * self.per_replica)
