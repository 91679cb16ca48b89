"""The hosts' agreement, the core's one rule: fields that differ are refused by name with each
host's value, a host that does not answer is named as such, and agreeing hosts pass; any
framework's exchange (here a list standing for the hosts) gets the same answer."""

from __future__ import annotations

import json

import pytest

from feedpipe.core.agreement import NoAnswer, check_hosts_agree
from feedpipe.core.split import HostShare

FIELDS = {"remainder": "pad", "dataset_length": 24, "seed": 0, "steps_per_epoch": 3}


def hosts_with(*others: dict):
    """An exchange in which host 0 sends what it is given and the others send `others`."""

    def exchange(payload: bytes) -> list[bytes]:
        return [payload, *(json.dumps({**FIELDS, **other}).encode() for other in others)]

    return exchange


def test_a_field_that_differs_is_refused_naming_it_and_each_hosts_value():
    share = HostShare(12, num_hosts=3, host=0, local_replicas=2)
    with pytest.raises(
        ValueError,
        match=r"differ in `dataset_length`: dataset_length=24 on hosts 0, 2; dataset_length=25 "
        r"on host 1 \(and in steps_per_epoch\)\..*\(this is host 0 of 3\)",
    ):
        check_hosts_agree(
            hosts_with({"dataset_length": 25, "steps_per_epoch": 4}, {}), share, FIELDS
        )


def test_a_host_that_does_not_answer_is_named_as_such():
    def exchange(payload: bytes) -> list[bytes]:
        raise NoAnswer("process 1 built no feeder within 3 s")

    with pytest.raises(RuntimeError, match=r"Host 0 of 2 could not check.*process 1 built no"):
        check_hosts_agree(exchange, HostShare(8, num_hosts=2, host=0, local_replicas=2), FIELDS)


def test_hosts_that_agree_pass():
    check_hosts_agree(hosts_with({}), HostShare(8, num_hosts=2, host=0, local_replicas=2), FIELDS)
