"""Agreement: the hosts of a multi-worker strategy check that they built the same feeder.

Each host makes only its rows of every global batch, in an order that is a function of a few
fields (the source's length, the global batch, seed, shuffle, remainder). Hosts whose feeders
differ in one make their rows of different batches: together they repeat some samples and miss
others, and nothing fails. So each feeder, when it is built, gathers every host's fields through
the strategy's own collectives and refuses to start where they differ.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf

from feedpipe.core.split import HostShare

SHOWN_VALUES = 4
"""Values a refusal lists (with the hosts that have each): enough for a few hosts, short
for 64 hosts that each have their own."""


def check_hosts_agree(strategy: Any, share: HostShare, fields: dict) -> None:
    """Raises a ValueError on every host if any host's `fields` differ from the others'.

    Two all-gathers over the strategy's replicas (the texts' lengths, then the JSON texts padded
    to the longest), so they wait as long as its CommunicationOptions(timeout_seconds=) lets a
    step wait. Every host makes them when its feeder is built, before its first batch, so the
    hosts' collectives stay in the same order.
    """
    text = np.frombuffer(json.dumps(fields, default=int).encode(), np.uint8)
    try:
        sizes = _gather(strategy, share, np.array([text.size]))[:, 0]
        texts = _gather(strategy, share, np.pad(text, (0, sizes.max() - text.size)))
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as error:
        raise RuntimeError(
            f"Host {share.host} of {share.num_hosts} could not check that every host built the "
            "same feeder: another host died, failed to build its feeder (its own error says "
            f"why), or stopped answering ({type(error).__name__}). Build the feeder on every "
            "host, at the same point of the script."
        ) from error
    hosts = [
        json.loads(row[:size].astype(np.uint8).tobytes())
        for row, size in zip(texts, sizes, strict=True)
    ]
    differ = [name for name in fields if len({repr(h.get(name)) for h in hosts}) > 1]
    if not differ:
        return
    name = differ[0]
    also = f" (and in {', '.join(differ[1:])})" if differ[1:] else ""
    raise ValueError(
        f"The hosts' feeders differ in `{name}`: {_who_has(name, [h.get(name) for h in hosts])}"
        f"{also}. Each host makes its rows of the same global batches, in an order that "
        f"depends on {name}: hosts that differ repeat some samples and miss others. Build "
        "every host's feeder with the same source, global_batch_size, seed, shuffle and "
        f"remainder (this is host {share.host} of {share.num_hosts})."
    )


def _gather(strategy: Any, share: HostShare, array: np.ndarray) -> np.ndarray:
    """`array` of every host, one row each. Sent as float32, which every collective
    implementation gathers on every device (exact for bytes and lengths)."""
    value = tf.constant(array[None], tf.float32)
    replicas = strategy.experimental_distribute_values_from_function(lambda _: value)
    rows = strategy.gather(replicas, axis=0).numpy()
    return np.rint(rows[:: share.local_replicas]).astype(np.int64)


def _who_has(name: str, values: list) -> str:
    """ "seed=0 on host 0; seed=1 on hosts 1, 2": each value with the hosts that have it."""
    hosts: dict[str, list[str]] = {}
    for host, value in enumerate(values):
        hosts.setdefault(repr(value), []).append(str(host))
    said = [
        f"{name}={value} on host{'s' if len(which) > 1 else ''} {', '.join(which)}"
        for value, which in hosts.items()
    ]
    more = len(said) - SHOWN_VALUES
    return "; ".join(said[:SHOWN_VALUES]) + (f"; {more} more values" if more > 0 else "")
