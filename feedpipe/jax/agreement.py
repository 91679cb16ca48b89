"""Agreement over JAX: the exchange the processes of a `jax.distributed` feeder check their
feeders with (the rule is the core's, `feedpipe.core.agreement`).

The payloads travel through the distributed runtime's key-value store, the coordination
service `jax.distributed.initialize` connects every process to: each process sets its payload
under this agreement's key, then reads every other process's, each read bounded by a deadline.
A process that never builds its feeder (it failed before, or runs other code) is then named
within `timeout_s()` instead of leaving the others waiting forever, which a compiled collective
(`multihost_utils.process_allgather`) would do; the store also needs no device memory and no
compiled program.
"""

from __future__ import annotations

import itertools
import time

import jax

from feedpipe._internals import jax_distributed_client
from feedpipe.core.agreement import TIMEOUT_ENV, NoAnswer, timeout_s

_rounds = itertools.count()
"""Agreements this process has taken part in: every process builds its multi-process feeders
in the same order (as for any collective), so the n-th of each meets the others' n-th."""


def exchange(processes: list[int], payload: bytes) -> list[bytes]:
    """Every process's `payload`, in the order of `processes` (the mesh's, which this process
    is among); `NoAnswer` naming the first process that did not answer in time."""
    client = jax_distributed_client()
    key = f"feedpipe/agreement/{next(_rounds)}"
    client.key_value_set_bytes(f"{key}/{jax.process_index()}", payload)
    wait_s = timeout_s()
    deadline = time.monotonic() + wait_s
    payloads = []
    for process in processes:
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            payloads.append(client.blocking_key_value_get_bytes(f"{key}/{process}", left_ms))
        except jax.errors.JaxRuntimeError as error:
            raise NoAnswer(
                f"process {process} built no feeder within {wait_s:g} s ({TIMEOUT_ENV}); "
                f"{str(error).splitlines()[0][:160]}"
            ) from error
    return payloads
