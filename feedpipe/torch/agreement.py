"""Agreement over `torch.distributed`: the exchange the processes of a feeder check their
feeders with (the rule is the core's, `feedpipe.core.agreement`).

The payloads travel through the process group's key-value store (the `TCPStore` or file store
`init_process_group` rendezvoused through): each process sets its payload under this
agreement's key, then waits for every other process's, each wait bounded by a deadline. A
process that never builds its feeder is then named within the deadline, where a collective
(`all_gather_object`) would wait for the process group's own timeout (30 minutes by default);
the store also needs no device, and works the same on gloo and NCCL.
"""

from __future__ import annotations

import datetime
import itertools
import time

from feedpipe._internals import torch_default_store
from feedpipe.core.agreement import TIMEOUT_ENV, NoAnswer, timeout_s

_rounds = itertools.count()
"""Agreements this process has taken part in: every process builds its multi-process feeders
in the same order (as for any collective), so the n-th of each meets the others' n-th."""


def exchange(rank: int, world_size: int, payload: bytes) -> list[bytes]:
    """Every rank's `payload`, in rank order; `NoAnswer` naming the first rank that did not
    answer in time."""
    store = torch_default_store()
    key = f"feedpipe/agreement/{next(_rounds)}"
    store.set(f"{key}/{rank}", payload)
    wait_s = timeout_s()
    deadline = time.monotonic() + wait_s
    payloads = []
    for other in range(world_size):
        left = datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))
        try:
            store.wait([f"{key}/{other}"], left)
        except Exception as error:  # the store's timeout: DistStoreError, a RuntimeError
            raise NoAnswer(
                f"rank {other} built no feeder within {wait_s:g} s ({TIMEOUT_ENV}); "
                f"{str(error).splitlines()[0][:160]}"
            ) from error
        payloads.append(bytes(store.get(f"{key}/{other}")))
    return payloads
