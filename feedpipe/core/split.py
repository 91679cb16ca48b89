"""Split: which rows of a global batch go to which replica, and to which host.

Replica `r` takes the contiguous rows `[r * b, (r + 1) * b)` of each global batch of `b * R`
rows, so the global batch (its rows, padding and masks) does not depend on the replica count,
and each replica's rows can be written straight into a region of their own (`feedpipe.core.slots`).
Across hosts the same rule gives host `w`, with `L` replicas, the contiguous rows
`[w * L * b, (w + 1) * L * b)`: each host makes only those, and the rows gathered from every
host are the one-host global batch, whatever the number of hosts.
"""

from __future__ import annotations

import dataclasses

from feedpipe.core.checks import check_int


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSplit:
    """Cuts a global batch into equal contiguous per-replica sub-batches."""

    global_batch_size: int
    num_replicas: int

    def __post_init__(self):
        check_int("global_batch_size", self.global_batch_size, "pass the samples per step")
        check_int("num_replicas", self.num_replicas, "split among one device or more")
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


@dataclasses.dataclass(frozen=True, slots=True)
class HostShare:
    """One host's part of each global batch: the rows of its `local_replicas` replicas.

    Every host has the same number of replicas (MultiWorkerMirroredStrategy requires it), so
    host `host` feeds the global replicas `[host * L, (host + 1) * L)`.
    """

    global_batch_size: int
    num_hosts: int = 1
    host: int = 0
    local_replicas: int = 1

    def __post_init__(self):
        check_int("global_batch_size", self.global_batch_size, "pass the samples per step")
        check_int("num_hosts", self.num_hosts, "a cluster has one host or more")
        check_int("local_replicas", self.local_replicas, "each host feeds one device or more")
        if not 0 <= self.host < self.num_hosts:
            raise ValueError(f"`host`={self.host!r} must be in [0, {self.num_hosts}).")
        if self.num_hosts > 1 and self.global_batch_size % self.num_replicas:
            total = self.num_replicas
            example = total * max(1, self.global_batch_size // total)
            raise ValueError(
                f"`global_batch_size`={self.global_batch_size} is not divisible by the {total} "
                f"replicas of the cluster ({self.num_hosts} hosts x {self.local_replicas} "
                f"replicas each): every replica takes global_batch_size / {total} rows; use a "
                f"multiple of {total} (for example {example})."
            )
        ReplicaSplit(self.global_batch_size, self.num_replicas)

    @property
    def num_replicas(self) -> int:
        """Replicas across every host."""
        return self.num_hosts * self.local_replicas

    @property
    def first_replica(self) -> int:
        """The global id of this host's first replica (the strategy's replica id)."""
        return self.host * self.local_replicas

    @property
    def rows(self) -> range:
        """This host's rows of each global batch."""
        size = self.global_batch_size // self.num_hosts
        return range(self.host * size, (self.host + 1) * size)

    @property
    def local_split(self) -> ReplicaSplit:
        """How this host's rows divide among its replicas."""
        return ReplicaSplit(len(self.rows), self.local_replicas)
