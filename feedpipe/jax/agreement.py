"""Agreement over JAX: how the processes of a `jax.distributed` feeder compare their feeders
(the rule is the core's, `feedpipe.core.agreement`).

The payloads travel through the distributed runtime's key-value store, the coordination
service `jax.distributed.initialize` connects every process to: each process sets, reads and
adds to it 3 times where the feeders agree (`feedpipe.core.agreement.tally_through`), and once
more at its first agreement (`RoundKeys`: keys no earlier run against the service used), so the
service's work grows as the process count, and every read is bounded by a deadline. A process
that never builds its feeder (it failed before, or runs other code) is then named within
`timeout_s()` instead of leaving the others waiting forever, which a compiled collective
(`multihost_utils.process_allgather`) would do; the store also needs no device memory and no
compiled program.
"""

from __future__ import annotations

from typing import Any

import jax

from feedpipe._internals.jax import jax_distributed_client
from feedpipe.core.agreement import ROUND_KEYS, Tally, tally_through


class _CoordinationStore:
    """The coordination service's key-value store, as `tally_through` reads it."""

    def __init__(self, client: Any):
        self.client = client

    def set(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            return self.client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except jax.errors.JaxRuntimeError as error:  # DEADLINE_EXCEEDED, or the service gone
            raise TimeoutError(str(error)) from error

    def add(self, key: str, amount: int) -> int:
        return self.client.key_value_increment(key, amount)


def tally(processes: list[int], payload: bytes) -> Tally:
    """Every process's `payload` compared with the first's of `processes` (the mesh's, which
    this process is among); `NoAnswer` where a process did not answer in time."""
    store = _CoordinationStore(jax_distributed_client())
    host = jax.process_index()
    return tally_through(store, host, processes, payload, "process", ROUND_KEYS.next(store, host))
