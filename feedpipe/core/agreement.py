"""Agreement: the hosts of one feeder check that they built the same feeder.

Each host makes only its rows of every global batch, in an order that is a function of a few
fields (the source's length, the global batch, seed, shuffle, remainder). Hosts whose feeders
differ in one make their rows of different batches: together they repeat some samples and miss
others, and nothing fails, or they run different numbers of steps and the longer ones wait
forever in their step's collective. So each feeder, when it is built, exchanges every host's
fields and refuses to start where they differ.

The rule is written once, here; a framework layer provides only the exchange, through its own
collectives (`feedpipe.tf.agreement`: the strategy's all-gathers; `feedpipe.jax.agreement`: the
`jax.distributed` runtime), and says when a host did not answer by raising `NoAnswer`.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Protocol

from feedpipe.core._sync import seconds_from_env
from feedpipe.core.split import HostShare

SHOWN_VALUES = 4
"""Values a refusal lists (with the hosts that have each): enough for a few hosts, short
for 64 hosts that each have their own."""


TIMEOUT_ENV = "FEEDPIPE_AGREEMENT_TIMEOUT_S"
"""The environment variable that sets how long a host waits for the others' feeders."""
DEFAULT_TIMEOUT_S = 300.0
"""As long as `jax.distributed.initialize` waits for every process by default: processes that
start together but load their data at different speeds still meet."""


def timeout_s() -> float:
    """How long a host waits for every other host's feeder: `FEEDPIPE_AGREEMENT_TIMEOUT_S`
    seconds, else 300."""
    return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


class NoAnswer(Exception):
    """A host did not take part in the exchange within the layer's wait; the message says
    what the layer's collective reported."""


class KeyValueStore(Protocol):
    """The key-value store a framework's distributed runtime connects every process to, whose
    reads take a deadline (JAX's coordination service, `torch.distributed`'s store)."""

    def set(self, key: str, value: bytes) -> None:
        """Sets `key` for every process to read."""

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key` once some process has set it; `TimeoutError` past `timeout_s`."""


_rounds = itertools.count()
"""Agreements this process has taken part in: every process builds its multi-process feeders
in the same order (as for any collective), so the n-th of each meets the others' n-th."""


def exchange_through(
    store: KeyValueStore, host: int, hosts: list[int], payload: bytes, name: str
) -> list[bytes]:
    """Every host's `payload`, in the order of `hosts` (`host` among them), through `store`:
    this host sets its own under this agreement's key, then reads every other's, all the reads
    bounded by one deadline (`timeout_s()`), so that a host whose peer never builds its feeder
    is told so instead of waiting forever; `NoAnswer` names the first `name` ("rank",
    "process") that did not answer in time."""
    key = f"feedpipe/agreement/{next(_rounds)}"
    store.set(f"{key}/{host}", payload)
    wait_s = timeout_s()
    deadline = time.monotonic() + wait_s
    payloads = []
    for other in hosts:
        try:
            payloads.append(store.get(f"{key}/{other}", max(0.001, deadline - time.monotonic())))
        except TimeoutError as error:
            raise NoAnswer(
                f"{name} {other} built no feeder within {wait_s:g} s ({TIMEOUT_ENV}); "
                f"{str(error).splitlines()[0][:160]}"
            ) from error
    return payloads


def check_hosts_agree(
    exchange: Callable[[bytes], list[bytes]], share: HostShare, fields: dict
) -> None:
    """Raises a ValueError on every host if any host's `fields` differ from the others'.

    `exchange(payload)` gives every host's payload, in host order, and raises `NoAnswer` where
    a host did not answer; every host calls it when its feeder is built, before its first
    batch, so the hosts' collectives stay in the same order.
    """
    text = json.dumps(fields, default=int).encode()
    try:
        hosts = [json.loads(payload) for payload in exchange(text)]
    except NoAnswer as error:
        raise RuntimeError(
            f"Host {share.host} of {share.num_hosts} could not check that every host built the "
            "same feeder: another host died, failed to build its feeder (its own error says "
            f"why), or stopped answering ({error}). Build the feeder on every host, at the "
            "same point of the script."
        ) from error
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
