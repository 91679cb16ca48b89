"""The hosts' agreement over a real `torch.distributed` store: each host a thread with its own
`TCPStore` client and its own count of agreements (the process it stands for), so that a host
can start again, its count back at 0, against the store its earlier life used."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from feedpipe.core.agreement import RoundKeys
from feedpipe.torch.agreement import tally_in
from tests.hosts import agree_in_threads

FIELDS = {"remainder": "pad", "dataset_length": 24, "seed": 0, "steps_per_epoch": 3}


@pytest.fixture
def server():
    """A TCPStore server on a free port, as `init_process_group` starts on rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def agree(server, fields_of: list[dict | None], keys: list[RoundKeys]) -> list:
    """Host h checks `fields_of[h]` (None: it builds no feeder) through its own client of
    `server`, under the next of `keys[h]`; what each raised, None where it was agreed."""
    count = len(fields_of)

    def tally_for(rank: int):
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        return lambda payload: tally_in(client, rank, count, payload, keys[rank])

    return agree_in_threads(fields_of, tally_for)


def test_a_rank_that_starts_again_against_the_same_store_is_not_agreed_by_stale_records(
    server, monkeypatch
):
    monkeypatch.setenv("FEEDPIPE_AGREEMENT_TIMEOUT_S", "1")
    assert agree(server, [dict(FIELDS)] * 3, [RoundKeys() for _ in range(3)]) == [None] * 3
    # Rank 2 starts again with seed=7, its count of agreements back at 0; ranks 0 and 1 go on
    # without building a feeder.
    alone = agree(server, [None, None, {**FIELDS, "seed": 7}], [RoundKeys() for _ in range(3)])
    assert isinstance(alone[2], RuntimeError), alone[2]
    assert "rank 0 built no feeder" in str(alone[2])


def test_ranks_that_start_again_together_against_the_same_store_compare_their_new_fields(server):
    assert agree(server, [dict(FIELDS)] * 3, [RoundKeys() for _ in range(3)]) == [None] * 3
    together = [dict(FIELDS), dict(FIELDS), {**FIELDS, "seed": 7}]
    for rank, error in enumerate(agree(server, together, [RoundKeys() for _ in range(3)])):
        assert isinstance(error, ValueError), (rank, error)
        assert "seed=0 on host 0 and 1 other; seed=7 on host 2" in str(error)


def test_ranks_meet_under_one_key_in_each_round(server):
    keys = [RoundKeys() for _ in range(3)]
    for _ in range(2):
        assert agree(server, [dict(FIELDS)] * 3, keys) == [None] * 3
    said = [k.next(server, rank) for rank, k in enumerate(keys)]
    assert len(set(said)) == 1, said
