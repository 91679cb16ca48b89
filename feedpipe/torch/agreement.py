"""Agreement over `torch.distributed`: how the processes of a feeder compare their feeders
(the rule is the core's, `feedpipe.core.agreement`).

The payloads travel through the process group's key-value store (the `TCPStore` or file store
`init_process_group` rendezvoused through): each rank sets, reads and adds to it 3 times where
the feeders agree (`feedpipe.core.agreement.tally_through`), and once more at its process's
first agreement (`RoundKeys`: keys no earlier run against the same store used), so the store's
work grows as the rank count, and every wait is bounded by a deadline. A process that never
builds its feeder is then named within the deadline, where a collective (`all_gather_object`)
would wait for the process group's own timeout (30 minutes by default); the store also needs
no device, and works the same on gloo and NCCL.
"""

from __future__ import annotations

import datetime
from typing import Any

from feedpipe._internals.torch import torch_default_store
from feedpipe.core.agreement import ROUND_KEYS, RoundKeys, Tally, tally_through


class _ProcessGroupStore:
    """The process group's store, as `tally_through` reads it."""

    def __init__(self, store: Any):
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:  # torch.distributed.DistStoreError: the wait timed out
            raise TimeoutError(str(error)) from error
        # The key is there now: compare_set with an empty expected value returns it
        # unchanged, in one request, where get() would first wait for it again (two).
        return bytes(self.store.compare_set(key, b"", b""))

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))


def tally(rank: int, world_size: int, payload: bytes) -> Tally:
    """Every rank's `payload` compared with rank 0's; `NoAnswer` where a rank did not answer
    in time."""
    return tally_in(torch_default_store(), rank, world_size, payload, ROUND_KEYS)


def tally_in(store: Any, rank: int, world_size: int, payload: bytes, keys: RoundKeys) -> Tally:
    """`tally` through the `torch.distributed` store `store`, under the next of `keys`."""
    store = _ProcessGroupStore(store)
    ranks = list(range(world_size))
    return tally_through(store, rank, ranks, payload, "rank", keys.next(store, rank))
