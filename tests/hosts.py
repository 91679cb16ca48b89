"""Hosts of a multi-host job emulated in threads of one process, each checking its feeder's
fields as a host does: what the agreement tests of the core and of each framework share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from feedpipe.core.agreement import check_hosts_agree
from feedpipe.core.split import HostShare

JOIN_S = 30.0
"""How long a test waits for its emulated hosts' threads: far past any deadline they have."""


def agree_in_threads(fields_of: list[dict | None], tally_for: Callable[[int], Any]) -> list:
    """Host h checks `fields_of[h]` (None: it never builds its feeder) through the tally
    `tally_for(h)` makes in host h's thread; what each raised, None where it was agreed."""
    count = len(fields_of)
    outcomes: list = [None] * count

    def host(h: int) -> None:
        share = HostShare(count, num_hosts=count, host=h, local_replicas=1)
        try:
            check_hosts_agree(tally_for(h), share, fields_of[h])
        except Exception as error:  # the test reads what each host raised
            outcomes[h] = error

    threads = [
        threading.Thread(target=host, args=(h,), daemon=True)
        for h in range(count)
        if fields_of[h] is not None
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a host still waits"
    return outcomes
