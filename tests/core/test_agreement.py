"""The hosts' agreement, the core's one rule: fields that differ are refused by name with each
host's value, a host that does not answer is named as such, and agreeing hosts pass, whether
every host's fields come from a collective (a list standing for the hosts) or through a
key-value store (an in-memory one, each host a thread with its own counting client), which
costs at most 3 round trips a host and 4 operations a host at the store, and one add more at a
process's first agreement, which numbers its life: a host that starts again against the same
store never meets the records of its earlier life's rounds."""

from __future__ import annotations

import collections
import json
import re
import threading
import time

import pytest

from feedpipe.core.agreement import (
    NoAnswer,
    RoundKeys,
    Tally,
    check_hosts_agree,
    tally_of,
    tally_through,
)
from feedpipe.core.split import HostShare
from tests import hosts
from tests.hosts import JOIN_S

FIELDS = {"remainder": "pad", "dataset_length": 24, "seed": 0, "steps_per_epoch": 3}


def hosts_with(*others: dict):
    """A collective's tally in which host 0 sends what it is given and the others send
    `others`."""

    def tally(payload: bytes) -> Tally:
        return tally_of([payload, *(json.dumps({**FIELDS, **other}).encode() for other in others)])

    return tally


def test_a_field_that_differs_is_refused_naming_it_and_each_hosts_value():
    share = HostShare(12, num_hosts=3, host=0, local_replicas=2)
    with pytest.raises(
        ValueError,
        match=r"differ in `dataset_length`: dataset_length=24 on host 0 and 1 other; "
        r"dataset_length=25 on host 1 \(and in steps_per_epoch\)\..*\(this is host 0 of 3\)",
    ):
        check_hosts_agree(
            hosts_with({"dataset_length": 25, "steps_per_epoch": 4}, {}), share, FIELDS
        )


def test_a_host_that_does_not_answer_is_named_as_such():
    def tally(payload: bytes) -> Tally:
        raise NoAnswer("process 1 built no feeder within 3 s")

    with pytest.raises(RuntimeError, match=r"Host 0 of 2 could not check.*process 1 built no"):
        check_hosts_agree(tally, HostShare(8, num_hosts=2, host=0, local_replicas=2), FIELDS)


def test_hosts_that_agree_pass():
    check_hosts_agree(hosts_with({}), HostShare(8, num_hosts=2, host=0, local_replicas=2), FIELDS)


# ---- through a key-value store ---------------------------------------------------------------


class MemoryStore:
    """A key-value store in memory that every host's client shares, as a coordinator would."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.counters: dict[str, int] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_s):
                raise TimeoutError(f"key {key} was not set within {timeout_s:.3f} s")
            return self.values[key]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            self.counters[key] = self.counters.get(key, 0) + amount
            return self.counters[key]


class CountingClient:
    """One host's client of a `MemoryStore`: each call is one round trip to the store."""

    def __init__(self, store: MemoryStore):
        self.store = store
        self.calls: collections.Counter[str] = collections.Counter()
        self.keys: list[str] = []
        """The keys this host's agreements met under."""

    def set(self, key: str, value: bytes) -> None:
        self.calls["set"] += 1
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        self.calls["get"] += 1
        return self.store.get(key, timeout_s)

    def add(self, key: str, amount: int) -> int:
        self.calls["add"] += 1
        return self.store.add(key, amount)

    @property
    def round_trips(self) -> int:
        return sum(self.calls.values())


def agree_in_threads(
    fields_of: list[dict | None], store: MemoryStore | None = None, keys: list | None = None
) -> tuple[list, list[CountingClient]]:
    """Each host (a thread, its own client of one store) checks its fields, `fields_of[h]`, or
    never builds its feeder where that is None, under the key "k", or with `keys` the next of
    its own `keys[h]` (a `RoundKeys`: the process it stands for); what each raised (None where
    it passed), and the clients."""
    store = MemoryStore() if store is None else store
    count = len(fields_of)
    clients = [CountingClient(store) for _ in range(count)]

    def tally_for(position: int):
        def tally(payload: bytes) -> Tally:
            client = clients[position]
            key = "k" if keys is None else keys[position].next(client, position)
            client.keys.append(key)
            return tally_through(client, position, list(range(count)), payload, "process", key)

        return tally

    return hosts.agree_in_threads(fields_of, tally_for), clients


def test_64_agreeing_hosts_cost_at_most_3_round_trips_each_and_4_operations_a_host():
    outcomes, clients = agree_in_threads([dict(FIELDS) for _ in range(64)])
    assert outcomes == [None] * 64
    assert max(client.round_trips for client in clients) <= 3
    assert sum(client.round_trips for client in clients) <= 4 * 64
    assert all(client.calls["add"] == 1 for client in clients), "one barrier, one add a host"


def test_one_host_that_differs_is_named_in_every_host_with_both_values():
    fields_of = [dict(FIELDS) for _ in range(8)]
    fields_of[5]["seed"] = 1
    outcomes, _ = agree_in_threads(fields_of)
    for host, error in enumerate(outcomes):
        assert isinstance(error, ValueError), (host, error)
        assert re.match(
            r"The hosts' feeders differ in `seed`: seed=0 on host 0 and 6 others; seed=1 on "
            rf"host 5\. .*\(this is host {host} of 8\)\.$",
            str(error),
            re.S,
        ), str(error)


def test_several_hosts_that_differ_are_named_in_every_host_with_each_value():
    fields_of = [dict(FIELDS) for _ in range(8)]
    fields_of[2]["seed"] = fields_of[3]["seed"] = 1
    fields_of[6] = {**FIELDS, "seed": 2, "dataset_length": 25}
    outcomes, _ = agree_in_threads(fields_of)
    said = {re.sub(r"this is host \d+", "", str(error)) for error in outcomes}
    assert len(said) == 1, "every host says the same"
    assert all(isinstance(error, ValueError) for error in outcomes)
    assert re.match(
        r"The hosts' feeders differ in `dataset_length`: dataset_length=24 on hosts 0, 2, 3 and "
        r"4 others; dataset_length=25 on host 6 \(and in seed\)\.",
        said.pop(),
    )


def test_more_hosts_that_differ_than_a_refusal_shows_are_counted():
    fields_of = [{**FIELDS, "seed": host if host in range(1, 7) else 0} for host in range(16)]
    outcomes, _ = agree_in_threads(fields_of)
    for error in outcomes:
        assert isinstance(error, ValueError)
        assert re.match(
            r"The hosts' feeders differ in `seed`: seed=0 on host 0 and 9 others; "
            r"(seed=[1-6] on host [1-6]; ){3}1 more value; 2 more hosts differ\.",
            str(error),
        ), str(error)


def test_a_host_that_never_arrives_is_reported_by_every_other_within_the_deadline(monkeypatch):
    # 2 s: on a loaded machine, a host thread started late still arrives within the deadline.
    monkeypatch.setenv("FEEDPIPE_AGREEMENT_TIMEOUT_S", "2")
    started = time.monotonic()
    outcomes, _ = agree_in_threads([dict(FIELDS)] * 3 + [None])
    took_s = time.monotonic() - started
    for host, error in enumerate(outcomes[:3]):
        assert isinstance(error, RuntimeError), (host, error)
        assert re.match(
            rf"Host {host} of 4 could not check.*3 of 4 processes built their feeder within "
            r"2 s \(FEEDPIPE_AGREEMENT_TIMEOUT_S\)",
            str(error),
            re.S,
        ), str(error)
    assert took_s < JOIN_S


def test_host_0_that_never_arrives_is_named_by_every_other(monkeypatch):
    monkeypatch.setenv("FEEDPIPE_AGREEMENT_TIMEOUT_S", "0.5")
    outcomes, _ = agree_in_threads([None] + [dict(FIELDS)] * 3)
    for host, error in enumerate(outcomes[1:], start=1):
        assert isinstance(error, RuntimeError), (host, error)
        assert re.match(
            rf"Host {host} of 4 could not check.*process 0 built no feeder within 0\.5 s "
            r"\(FEEDPIPE_AGREEMENT_TIMEOUT_S\); key k/0 was not set",
            str(error),
            re.S,
        ), str(error)


# ---- rounds, and hosts that start again ------------------------------------------------------


def test_every_host_meets_under_the_same_key_each_round_and_only_the_first_costs_an_add_more():
    store, count = MemoryStore(), 8
    keys = [RoundKeys() for _ in range(count)]
    first, clients = agree_in_threads([dict(FIELDS)] * count, store, keys)
    second, again = agree_in_threads([dict(FIELDS)] * count, store, keys)
    assert first == second == [None] * count
    assert len({client.keys[0] for client in clients}) == 1
    assert len({client.keys[0] for client in again}) == 1
    assert clients[0].keys != again[0].keys
    assert max(client.round_trips for client in clients) <= 4, "one add numbers the life"
    assert max(client.round_trips for client in again) <= 3
    assert sum(client.round_trips for client in again) <= 4 * count


def test_a_host_that_starts_again_alone_is_not_agreed_by_its_earlier_lifes_records(monkeypatch):
    monkeypatch.setenv("FEEDPIPE_AGREEMENT_TIMEOUT_S", "1")
    store = MemoryStore()
    outcomes, _ = agree_in_threads([dict(FIELDS)] * 3, store, [RoundKeys() for _ in range(3)])
    assert outcomes == [None] * 3
    # Host 2 starts again, its count of agreements back at 0, with another seed; hosts 0 and
    # 1 build no feeder meanwhile.
    restarted = [None, None, {**FIELDS, "seed": 7}]
    outcomes, _ = agree_in_threads(restarted, store, [RoundKeys() for _ in range(3)])
    assert isinstance(outcomes[2], RuntimeError), outcomes[2]
    assert re.match(r"Host 2 of 3 could not check.*process 0 built no feeder", str(outcomes[2]))


def test_hosts_that_start_again_together_compare_their_new_fields():
    store = MemoryStore()
    outcomes, _ = agree_in_threads([dict(FIELDS)] * 3, store, [RoundKeys() for _ in range(3)])
    assert outcomes == [None] * 3
    again = [dict(FIELDS), dict(FIELDS), {**FIELDS, "seed": 7}]
    outcomes, _ = agree_in_threads(again, store, [RoundKeys() for _ in range(3)])
    for host, error in enumerate(outcomes):
        assert isinstance(error, ValueError), (host, error)
        assert "seed=0 on host 0 and 1 other; seed=7 on host 2" in str(error)
