"""Agreement: the hosts of one feeder check that they built the same feeder.

Each host makes only its rows of every global batch, in an order that is a function of a few
fields (the source's length, the global batch, seed, shuffle, remainder). Hosts whose feeders
differ in one make their rows of different batches: together they repeat some samples and miss
others, and nothing fails, or they run different numbers of steps and the longer ones wait
forever in their step's collective. So each feeder, when it is built, compares every host's
fields with host 0's and refuses to start where they differ.

The rule and its messages are written once, here (`check_hosts_agree`); a framework layer
provides only the comparison's transport, as a `Tally`: TensorFlow's all-gathers
(`feedpipe.tf.agreement`, every host's fields on every host, `tally_of`), or a key-value store
(`feedpipe.jax.agreement`, `feedpipe.torch.agreement`: `tally_through`, whose cost grows as the
host count, not its square). A layer says that a host did not answer by raising `NoAnswer`.

Through a store, each agreement meets under a key of its own (`RoundKeys`), which no earlier
run against the same store used: a host that starts again must not read the records of a
round its earlier life took part in.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable
from typing import Protocol

from feedpipe.core import env
from feedpipe.core.split import HostShare

SHOWN_VALUES = 4
"""Values a refusal lists (with the hosts that have each), and records of differing hosts a
store is read for: enough for a few hosts, short for 64 hosts that each have their own."""


DEFAULT_TIMEOUT_S = 300.0
"""As long as `jax.distributed.initialize` waits for every process by default: processes that
start together but load their data at different speeds still meet."""


def timeout_s() -> float:
    """How long a host waits for every other host's feeder: `FEEDPIPE_AGREEMENT_TIMEOUT_S`
    seconds, else 300."""
    return env.seconds(env.AGREEMENT_TIMEOUT_S, DEFAULT_TIMEOUT_S)


class NoAnswer(Exception):
    """A host did not take part in the comparison within the layer's wait; the message says
    what the layer saw."""


@dataclasses.dataclass(frozen=True, slots=True)
class Tally:
    """Every host's fields compared with host 0's, as each host learns it."""

    num_hosts: int
    """Hosts that share the feeder."""
    reference: dict
    """Host 0's fields."""
    differing: dict[int, dict]
    """Fields of hosts (by position) that differ from host 0's: all of them, or the first
    `SHOWN_VALUES` where they come from a store."""
    differed: int
    """How many hosts differ from host 0, read or not."""


def differing_fields(reference: dict, fields: dict) -> list[str]:
    """The names of the fields in which `fields` differ from `reference` (the rule: values
    compared by their repr, a field one side lacks differing), in `reference`'s order."""
    return [name for name in {**reference, **fields} if _differs(reference, fields, name)]


def _differs(reference: dict, fields: dict, name: str) -> bool:
    """Whether `fields` differ from `reference` in `name`: the rule, written once."""
    return repr(reference.get(name)) != repr(fields.get(name))


def tally_of(payloads: list[bytes]) -> Tally:
    """The tally of every host's payload, in host order (a collective's all-gather)."""
    hosts = [json.loads(payload) for payload in payloads]
    differing = {
        host: fields
        for host, fields in enumerate(hosts)
        if host and differing_fields(hosts[0], fields)
    }
    return Tally(len(hosts), hosts[0], differing, len(differing))


class KeyValueStore(Protocol):
    """The key-value store a framework's distributed runtime connects every process to, whose
    reads take a deadline and whose counters add atomically (JAX's coordination service,
    `torch.distributed`'s store)."""

    def set(self, key: str, value: bytes) -> None:
        """Sets `key` for every process to read."""

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key` once some process has set it; `TimeoutError` past `timeout_s`."""

    def add(self, key: str, amount: int) -> int:
        """Adds `amount` to the counter `key` (0 where no process added to it yet) and returns
        the sum, atomically."""


class RoundKeys:
    """The store keys under which one process's agreements meet the other processes'.

    Every process builds its multi-process feeders in the same order (as for any collective),
    so the n-th agreement of each meets the others' n-th: the key counts them. A count kept in
    the process alone starts again at 0 when the process does, and would meet the records its
    earlier life left in a store that outlived it (a `TCPStore` or file store kept across
    restarts): told "agreed" by them, whatever its fields. So the key also carries the
    process's life, numbered by the store: at its first agreement each process adds 1 to a
    counter of its host's lives (one more round trip, once), and every host that starts anew
    together takes the next number, as its first life took 1. A host that starts again alone
    meets no one and is told so within the deadline, rather than agreed by stale records; so
    are hosts started again together where one's earlier life ended before its first agreement
    (their counts of lives differ): a fresh store starts them all at 1 again.
    """

    def __init__(self):
        self._rounds = itertools.count()
        self._life: int | None = None

    def next(self, store: KeyValueStore, host: int) -> str:
        """The key of this process's next agreement, as host `host` of `store`."""
        if self._life is None:
            self._life = store.add(f"feedpipe/agreement/lives/{host}", 1)
        return f"feedpipe/agreement/{self._life}/{next(self._rounds)}"


ROUND_KEYS = RoundKeys()
"""This process's agreement keys."""


def tally_through(
    store: KeyValueStore, host: int, hosts: list[int], payload: bytes, name: str, key: str
) -> Tally:
    """The tally of every host's `payload` through `store`, under `key` (`RoundKeys.next`),
    at most 3 round trips from each host and 3 operations a host at the store where the hosts
    agree; `host` is this host's id among `hosts` (host 0 is `hosts[0]`).

    Host 0 sets its payload; every other host reads it once and compares it with its own; a
    host that differs records its payload under the next number of a count of them; every host
    then adds itself to one counter that carries both counts (`arrived + differed *
    (len(hosts) + 1)`: the coordination service's counters hold 32 bits, enough for 46,340
    hosts), and the host whose addition completes it announces how many differ, which every
    other host waits for. Only where some differ does each host read more: up to `SHOWN_VALUES`
    records. Every wait is bounded by one deadline (`timeout_s()`), so that a host whose peer
    never builds its feeder is told so instead of waiting forever: `NoAnswer` names host 0
    where it never set its payload, else how many hosts arrived (`name`: "rank", "process").
    """
    position, count = hosts.index(host), len(hosts)
    weight = count + 1
    wait_s = timeout_s()
    deadline = time.monotonic() + wait_s
    within = f"within {wait_s:g} s ({env.AGREEMENT_TIMEOUT_S})"
    reference = json.loads(payload)
    differs = False
    if position == 0:
        store.set(f"{key}/0", payload)
    else:
        try:
            reference = json.loads(_read(store, f"{key}/0", deadline))
        except TimeoutError as error:
            raise NoAnswer(f"{name} {hosts[0]} built no feeder {within}; {_said(error)}") from error
        differs = bool(differing_fields(reference, json.loads(payload)))
    total = store.add(f"{key}/arrived", 1 + weight * differs)
    if differs:
        number = total // weight - 1
        store.set(f"{key}/differs/{number}", json.dumps([position, json.loads(payload)]).encode())
    if total % weight == count:
        differed = total // weight
        store.set(f"{key}/done", str(differed).encode())
    else:
        try:
            differed = int(_read(store, f"{key}/done", deadline))
        except TimeoutError as error:
            raise NoAnswer(_who_arrived(store, key, weight, count, name, within)) from error
    differing = {}
    for number in range(min(differed, SHOWN_VALUES)):
        try:
            other, fields = json.loads(_read(store, f"{key}/differs/{number}", deadline))
        except TimeoutError as error:
            raise NoAnswer(
                f"a {name} that differs from {name} {hosts[0]} recorded no fields {within}; "
                f"{_said(error)}"
            ) from error
        differing[other] = fields
    return Tally(count, reference, differing, differed)


def _read(store: KeyValueStore, key: str, deadline: float) -> bytes:
    """`key`'s value, waited for until `deadline`; `TimeoutError` past it."""
    return store.get(key, max(0.001, deadline - time.monotonic()))


def _said(error: BaseException) -> str:
    """The first line of what `error` said, short."""
    return (str(error).splitlines() or [type(error).__name__])[0][:160]


def _who_arrived(
    store: KeyValueStore, key: str, weight: int, count: int, name: str, within: str
) -> str:
    """What a host that waited in vain for the others says: how many arrived (the counter,
    read by adding 0), or that the store could not tell."""
    plural = f"{name}es" if name.endswith("s") else f"{name}s"
    try:
        arrived = store.add(f"{key}/arrived", 0) % weight
    except Exception as error:  # the store itself is gone: say so rather than mask the timeout
        return (
            f"not every {name} built its feeder {within}, and the store could not say how "
            f"many did ({type(error).__name__}: {_said(error)})"
        )
    return f"{arrived} of {count} {plural} built their feeder {within}"


def check_hosts_agree(tally: Callable[[bytes], Tally], share: HostShare, fields: dict) -> None:
    """Raises a ValueError on every host if any host's `fields` differ from host 0's.

    `tally(payload)` compares every host's payload with host 0's and raises `NoAnswer` where a
    host did not answer; every host calls it when its feeder is built, before its first batch,
    so the hosts' collectives stay in the same order.
    """
    text = json.dumps(fields, default=int).encode()
    try:
        counted = tally(text)
    except NoAnswer as error:
        raise RuntimeError(
            f"Host {share.host} of {share.num_hosts} could not check that every host built the "
            "same feeder: another host died, failed to build its feeder (its own error says "
            f"why), or stopped answering ({error}). Build the feeder on every host, at the "
            "same point of the script."
        ) from error
    if not counted.differed:
        return
    others = [fields for _, fields in sorted(counted.differing.items())]
    names = dict.fromkeys(counted.reference)
    for fields in others:
        names.update(dict.fromkeys(fields))
    differ = [name for name in names if any(_differs(counted.reference, f, name) for f in others)]
    name = differ[0]
    also = f" (and in {', '.join(differ[1:])})" if differ[1:] else ""
    raise ValueError(
        f"The hosts' feeders differ in `{name}`: {_who_has(name, counted)}"
        f"{also}. Each host makes its rows of the same global batches, in an order that "
        f"depends on {name}: hosts that differ repeat some samples and miss others. Build "
        "every host's feeder with the same source, global_batch_size, seed, shuffle and "
        f"remainder (this is host {share.host} of {share.num_hosts})."
    )


def _who_has(name: str, tally: Tally) -> str:
    """ "seed=0 on host 0 and 5 others; seed=1 on hosts 1, 2": each value with the hosts that
    have it, those that agree with host 0 counted rather than listed."""
    hosts: dict[str, list[str]] = {repr(tally.reference.get(name)): ["0"]}
    for other, fields in sorted(tally.differing.items()):
        hosts.setdefault(repr(fields.get(name)), []).append(str(other))
    agreeing = tally.num_hosts - 1 - tally.differed
    said = []
    for value, which in hosts.items():
        listed = f"host{'s' if len(which) > 1 else ''} {', '.join(which)}"
        if not said and agreeing:
            listed += f" and {agreeing} other{'s' if agreeing > 1 else ''}"
        said.append(f"{name}={value} on {listed}")
    more = len(said) - SHOWN_VALUES
    unread = tally.differed - len(tally.differing)
    return (
        "; ".join(said[:SHOWN_VALUES])
        + (f"; {more} more value{'s' if more > 1 else ''}" if more > 0 else "")
        + (f"; {unread} more host{'s differ' if unread > 1 else ' differs'}" if unread else "")
    )
