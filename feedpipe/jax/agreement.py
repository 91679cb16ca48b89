"""Agreement over JAX: the exchange the processes of a `jax.distributed` feeder check their
feeders with (the rule is the core's, `feedpipe.core.agreement`).

The payloads travel through the distributed runtime's key-value store, the coordination
service `jax.distributed.initialize` connects every process to, each read bounded by a
deadline (`feedpipe.core.agreement.exchange_through`). A process that never builds its feeder
(it failed before, or runs other code) is then named within `timeout_s()` instead of leaving the
others waiting forever, which a compiled collective (`multihost_utils.process_allgather`) would
do; the store also needs no device memory and no compiled program.
"""

from __future__ import annotations

from typing import Any

import jax

from feedpipe._internals import jax_distributed_client
from feedpipe.core.agreement import exchange_through


class _CoordinationStore:
    """The coordination service's key-value store, as `exchange_through` reads it."""

    def __init__(self, client: Any):
        self.client = client

    def set(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            return self.client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except jax.errors.JaxRuntimeError as error:  # DEADLINE_EXCEEDED, or the service gone
            raise TimeoutError(str(error)) from error


def exchange(processes: list[int], payload: bytes) -> list[bytes]:
    """Every process's `payload`, in the order of `processes` (the mesh's, which this process
    is among); `NoAnswer` naming the first process that did not answer in time."""
    store = _CoordinationStore(jax_distributed_client())
    return exchange_through(store, jax.process_index(), processes, payload, "process")
