"""Feeding `DistributedDataParallel` (`torch.distributed`): each rank stages only its share of
each global batch, in the order a one-process feeder gives the same global batches, and a
state moves between process counts.

Each job is 2 ranks on gloo over loopback (`distributed_worker.py`), one CPU device each, under
a hard deadline and killed by PID past it (`tests/processes.py`), as `torchrun` would start
them (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`). What the ranks saw is compared with
a feeder in this process whose two CPU replicas stand for the two ranks: replica r's rows of
every step are rank r's, and a linear model trained there on the whole global batch is what
the ranks' DDP model became.
"""

from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path

import pytest
import torch

import feedpipe as fp
from tests.cluster import free_ports
from tests.processes import REPO_ROOT, log_tail, run_at_once
from tests.torch_layer.distributed_worker import LEARNING_RATE, make_model, masked_loss
from tests.worker_fakes import index_pairs

WORKER = str(REPO_ROOT / "tests" / "torch_layer" / "distributed_worker.py")
RANKS = 2
GLOBAL_BATCH = 4 * RANKS
LENGTH = 3 * GLOBAL_BATCH + 3
"""The last batch of each epoch holds 3 real samples: rank 0's share is partly padding, rank
1's padding only."""
SEED = 3
STOP_AFTER = 2
"""Steps of the second epoch taken before the ranks save the state."""
FROM_ONE_AFTER = 1
"""Steps of the first epoch a one-process feeder takes before its state goes to the ranks."""
DEADLINE_S = 90


def run_ranks(out: Path, args: dict, env: dict | None = None) -> list[dict]:
    """What each rank of one `torch.distributed` job saw, by rank."""
    port = free_ports(1)[0]
    runs, envs = {}, {}
    for rank in range(RANKS):
        name = f"rank-{rank}"
        runs[name] = [str(out), json.dumps({**args, "timeout_s": DEADLINE_S // 2})]
        envs[name] = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(RANKS),
            **(env or {}),
        }
    codes = run_at_once(WORKER, runs, out, DEADLINE_S, envs)
    logs = "\n".join(f"--- {name}:\n{log_tail(out, name)}" for name in runs)
    assert set(codes.values()) == {0}, logs
    return [json.loads((out / f"{name}.json").read_text()) for name in runs]


def one_process_feeder(replicas: int) -> fp.Feeder:
    """The ranks' feeder in this process, on `replicas` CPU replicas."""
    return fp.Feeder(
        index_pairs(LENGTH), GLOBAL_BATCH, devices=["cpu"] * replicas, framework="torch",
        shuffle=True, seed=SEED,
    )  # fmt: skip


def one_process_run() -> tuple[list[tuple], list[float], list[list]]:
    """Two epochs of a feeder in this process whose two CPU replicas stand for the ranks: every
    step's (epoch, step, ids by replica, masks by replica, num_valid); and the losses and final
    parameters of the worker's model trained on the whole global batch of each step the ranks
    trained on."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    stream, losses = [], []
    with one_process_feeder(RANKS) as feeder:
        for _ in range(2):
            for batch in feeder:
                ids = [y.tolist() for _, y in batch.replicas]
                masks = [mask.tolist() for mask in batch.masks]
                stream.append((batch.epoch, batch.step, ids, masks, batch.num_valid))
                if (batch.epoch, batch.step) >= (1, STOP_AFTER):
                    continue
                x = torch.cat([x for x, _ in batch.replicas])
                y = torch.cat([y for _, y in batch.replicas])
                mask = torch.cat(batch.masks)
                loss = masked_loss(model, x, y, mask, batch.num_valid, 1, LENGTH)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    return stream, losses, [p.detach().tolist() for p in model.parameters()]


def one_process_state() -> tuple[dict, list[int]]:
    """A state a one-device feeder saved `FROM_ONE_AFTER` steps into its first epoch, and the
    real ids it delivered before."""
    taken = []
    with one_process_feeder(1) as feeder:
        for batch in feeder:
            (_, y), mask = batch.distributed()
            taken += y[mask].tolist()
            if batch.step + 1 == FROM_ONE_AFTER:
                break
        return feeder.state_dict(), taken


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The ranks' results, and the one-process run and state they are compared with."""
    from_one, taken_by_one = one_process_state()
    args = {
        "length": LENGTH,
        "global_batch": GLOBAL_BATCH,
        "seed": SEED,
        "workers": 2,
        "stop_after": STOP_AFTER,
        "from_one": from_one,
    }
    results = run_ranks(tmp_path_factory.mktemp("torch-distributed"), args)
    stream, losses, parameters = one_process_run()
    return {
        "results": results,
        "expected": stream,
        "losses": losses,
        "parameters": parameters,
        "taken_by_one": taken_by_one,
    }


def mine(stream, rank: int) -> list[tuple]:
    """Rank `rank`'s (epoch, step, ids, masks, num_valid) of each step: replica `rank`'s."""
    return [(e, s, ids[rank], masks[rank], valid) for e, s, ids, masks, valid in stream]


def flat(parameters) -> list[float]:
    """Every value of a model's parameters (as nested lists), in order."""
    return torch.cat([torch.tensor(p).flatten() for p in parameters]).tolist()


def real_ids(steps: list[dict], epoch: int) -> list[int]:
    """The ids of the real rows a rank saw in `epoch`."""
    return [
        i
        for s in steps
        if s["epoch"] == epoch
        for i, real in zip(s["ids"], s["masks"], strict=True)
        if real
    ]


def got(steps: list[dict]) -> list[tuple]:
    return [(s["epoch"], s["step"], s["ids"], s["masks"], s["num_valid"]) for s in steps]


@pytest.mark.slow  # reads a job of 2 processes
def test_each_rank_stages_its_share_of_the_one_process_order(job):
    steps_per_epoch = len(job["expected"]) // 2
    trained = job["expected"][: steps_per_epoch + STOP_AFTER]
    for rank, result in enumerate(job["results"]):
        assert (result["rank"], result["world_size"]) == (rank, RANKS)
        assert result["layer"] == "torch" and result["devices"] == ["cpu"]
        assert result["len"] == steps_per_epoch
        share = GLOBAL_BATCH // RANKS
        assert result["rows"] == [rank * share, (rank + 1) * share]
        assert got(result["steps"]) == mine(trained, rank), rank
        for step in result["steps"]:
            assert step["tensors"] and step["devices"] == ["cpu"]
            assert step["rows_agree"], "a row's fields mixed up"


@pytest.mark.slow  # reads a job of 2 processes
def test_every_sample_is_seen_once_per_epoch_across_ranks_the_last_batch_masked(job):
    seen = collections.Counter(i for r in job["results"] for i in real_ids(r["steps"], epoch=0))
    assert seen == collections.Counter(range(LENGTH))
    last = [r["steps"][len(job["expected"]) // 2 - 1] for r in job["results"]]
    assert [s["num_valid"] for s in last] == [3] * RANKS, "num_valid is the global batch's"
    assert [s["masks"] for s in last] == [[True] * 3 + [False], [False] * 4]


@pytest.mark.slow  # reads a job of 2 processes
def test_ddp_trains_on_the_staged_tensors_as_one_process_on_the_global_batch(job):
    """Each rank's loss is its part of the global batch's masked mean, so the ranks' losses
    add up to the one-process loss; DDP's all-reduced gradients leave every rank with the same
    parameters, those the one-process model reached (the ranks' rows differ, so ranks whose
    gradients were not all-reduced would differ)."""
    results = job["results"]
    by_step = list(zip(*(r["losses"] for r in results), strict=True))
    assert len(by_step) == len(job["losses"])
    assert all(math.isfinite(loss) for step in by_step for loss in step)
    summed = [sum(step) / RANKS for step in by_step]
    assert summed == pytest.approx(job["losses"], rel=1e-5, abs=1e-7)
    assert all(r["parameters"] == results[0]["parameters"] for r in results)
    assert flat(results[0]["parameters"]) == pytest.approx(
        flat(job["parameters"]), rel=1e-5, abs=1e-6
    )
    initial = flat(p.detach().tolist() for p in make_model().parameters())
    assert flat(results[0]["parameters"]) != pytest.approx(initial, abs=1e-3), (
        "training moved the parameters"
    )


@pytest.mark.slow  # reads a job of 2 processes
def test_a_state_saved_by_two_ranks_resumes_exactly_in_one_process_and_in_two(job):
    results = job["results"]
    steps_per_epoch = len(job["expected"]) // 2
    rest = job["expected"][steps_per_epoch + STOP_AFTER :]
    assert rest, "the restored feeders have steps left to run"
    state = results[0]["state"]
    assert all(r["state"] == state for r in results), "one state on every rank"
    assert (state["epoch"], state["step"]) == (1, STOP_AFTER)
    for rank, result in enumerate(results):
        assert got(result["resumed"]) == mine(rest, rank), rank
    with one_process_feeder(1) as alone:
        alone.load_state_dict(state)
        resumed = [
            (batch.epoch, batch.step, y.tolist(), mask.tolist(), batch.num_valid)
            for batch in alone
            for (_, y), mask in [batch.distributed()]
        ]
    assert resumed == [
        (e, s, [i for part in ids for i in part], [m for part in masks for m in part], valid)
        for e, s, ids, masks, valid in rest
    ]
    before = [i for r in results for i in real_ids(r["steps"], epoch=1)]
    after = [i for _, _, ids, masks, _ in resumed for i, m in zip(ids, masks, strict=True) if m]
    assert sorted(before + after) == list(range(LENGTH)), "the rest is what was not yet seen"


@pytest.mark.slow  # reads a job of 2 processes
def test_a_one_process_state_resumes_exactly_in_two_ranks(job):
    rest = job["expected"][FROM_ONE_AFTER : len(job["expected"]) // 2]
    delivered = []
    for rank, result in enumerate(job["results"]):
        assert got(result["from_one"]) == mine(rest, rank), rank
        delivered += real_ids(result["from_one"], epoch=0)
    assert sorted(delivered + job["taken_by_one"]) == list(range(LENGTH))


def test_a_process_torchrun_started_whose_process_group_is_not_initialized_is_refused(
    monkeypatch,
):
    """Built before `init_process_group`, a feeder would be one process's: every rank would
    feed every sample."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError,
        match=r"one of WORLD_SIZE=2 .* would feed every sample to every process\. Call "
        r"torch\.distributed\.init_process_group\(\) before building the feeder\.",
    ):
        one_process_feeder(1)


AGREEMENT_TIMEOUT_S = 3
"""How long a rank waits for the others' feeders in the test of a rank that builds none."""


@pytest.mark.slow  # reads a job of 2 processes
def test_ranks_whose_feeders_differ_are_refused_naming_the_field_and_none_waits(tmp_path):
    """Ranks whose feeders differ in their seed or their dataset's length would make their
    rows of different batches: every rank's fp.Feeder() raises a ValueError naming the field
    and each rank's value, at once, leaving nothing running; feeders that agree then feed every
    sample once; and a rank whose peer builds no feeder names it within the agreement's
    timeout instead of waiting for the process group's."""
    cases = {
        "seed": (
            [{"seed": 0, "shuffle": True}, {"seed": 1, "shuffle": True}],
            r"`seed`: seed=0 on host 0; seed=1 on host 1\.",
        ),
        "length": (
            [{"length": 24}, {"length": 25}],
            r"`dataset_length`: dataset_length=24 on host 0; dataset_length=25 on host 1 "
            r"\(and in steps_per_epoch\)\.",
        ),
    }
    listed = [{"name": name, "ranks": ranks} for name, (ranks, _) in cases.items()]
    listed.append({"name": "same", "ranks": [{"seed": 3}, {"seed": 3}]})
    args = {"mode": "differ", "length": 24, "global_batch": 8, "cases": listed}
    env = {"FEEDPIPE_AGREEMENT_TIMEOUT_S": str(AGREEMENT_TIMEOUT_S)}
    results = run_ranks(tmp_path, args, env)
    for rank, result in enumerate(results):
        for name, (_, pattern) in cases.items():
            error = result["refused"][name]
            expected = (
                r"ValueError: The hosts' feeders differ in " + pattern + r".* repeat some "
                r"samples and miss others\. .*\(this is host " + f"{rank} of {RANKS}\\)"
            )
            assert error is not None and re.match(expected, error, re.S), (name, rank, error)
            assert result["took_s"][name] < AGREEMENT_TIMEOUT_S, "a refusal waits for no one"
        assert result["refused"]["same"] is None
        assert result["left"] == [] and result["left_at_end"] == []
    assert sorted(results[0]["epoch"] + results[1]["epoch"]) == list(range(24))
    alone = results[1]["alone"]
    assert alone is not None and re.match(
        r"RuntimeError: Host 1 of 2 could not check that every host built the same feeder.*"
        rf"rank 0 built no feeder within {AGREEMENT_TIMEOUT_S} s "
        r"\(FEEDPIPE_AGREEMENT_TIMEOUT_S\)",
        alone,
        re.S,
    ), alone
    assert AGREEMENT_TIMEOUT_S <= results[1]["alone_s"] < AGREEMENT_TIMEOUT_S + 5
