"""Feeding JAX across processes (`jax.distributed`): each process stages only its share of each
global batch, and the global arrays built from every process's shards are the one-process batch.

Each cluster is N processes on loopback (`distributed_worker.py`), each with 2 host devices, under
a hard deadline and killed by PID past it (`tests/processes.py`). Computations that span processes
run on JAX's CPU collectives, gloo: the worker names it (`jax_cpu_collectives_implementation`)
before `jax.distributed.initialize`, so the choice does not rest on the installed JAX's default
(gloo on the JAX these tests run on). What the processes saw is compared with a feeder on one
device in this process, as tests/test_multi_worker.py does for TensorFlow's multi-worker strategy:
same order, same padding, same masks, each process's rows contiguous and in process order.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402

import feedpipe as fp  # noqa: E402
from tests.cluster import free_ports  # noqa: E402
from tests.processes import REPO_ROOT, log_tail, run_at_once  # noqa: E402
from tests.worker_fakes import index_pairs  # noqa: E402

pytestmark = pytest.mark.slow  # every test reads a jax.distributed cluster of 2 or 3 processes

WORKER = str(REPO_ROOT / "tests" / "jax_layer" / "distributed_worker.py")
DEVICES_PER_PROCESS = 2
DEADLINE_S = 120
EPOCHS = 2
STOP_AFTER = 2
"""Steps of the second epoch taken before the state is saved and restored into a new feeder."""
SEED = 3


def run_processes(out: Path, processes: int, args: dict, env: dict | None = None) -> list[dict]:
    """What each of `processes` processes of one `jax.distributed` cluster saw, by process."""
    coordinator = f"127.0.0.1:{free_ports(1)[0]}"
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **(env or {}),
    }
    runs, envs = {}, {}
    for process in range(processes):
        name = f"process-{process}"
        mine = {
            **args,
            "coordinator": coordinator,
            "num_processes": processes,
            "process_id": process,
            "timeout_s": DEADLINE_S // 2,
        }
        runs[name] = [str(out), json.dumps(mine)]
        envs[name] = env
    codes = run_at_once(WORKER, runs, out, DEADLINE_S, envs)
    logs = "\n".join(f"--- {name}:\n{log_tail(out, name)}" for name in runs)
    assert set(codes.values()) == {0}, logs
    return [json.loads((out / f"{name}.json").read_text()) for name in runs]


def one_process_stream(devices, args: dict) -> list[tuple]:
    """(epoch, step, ids, masks, num_valid) of every step of a feeder on one device."""
    stream, source = [], index_pairs(args["length"])
    with fp.Feeder(
        source, args["global_batch"], devices=devices[:1], shuffle=True, seed=SEED
    ) as feeder:
        for _ in range(EPOCHS):
            for batch in feeder:
                (_, y), mask = batch.distributed()
                ids, masks = np.asarray(y).tolist(), np.asarray(mask).tolist()
                stream.append((batch.epoch, batch.step, ids, masks, batch.num_valid))
    return stream


@pytest.fixture(
    scope="module",
    params=[(2, 0), (3, 2)],
    ids=["2-processes", "3-processes-with-worker-processes"],
)
def cluster(request, tmp_path_factory, devices):
    """A cluster's results and the one-process stream they must match. The last batch of each
    epoch holds 3 real samples, so the first process's share is partly padding and the other
    processes' shares are padding only."""
    processes, workers = request.param
    global_batch = 4 * processes
    args = {
        "length": 3 * global_batch + 3,
        "global_batch": global_batch,
        "seed": SEED,
        "workers": workers,
        "stop_after": STOP_AFTER,
    }
    results = run_processes(tmp_path_factory.mktemp("jax-distributed"), processes, args)
    return {
        "processes": processes,
        "args": args,
        "results": results,
        "expected": one_process_stream(devices, args),
    }


def share(cluster, process: int) -> slice:
    size = cluster["args"]["global_batch"] // cluster["processes"]
    return slice(process * size, (process + 1) * size)


def test_each_process_stages_its_share_of_the_one_process_order(cluster):
    expected = cluster["expected"]
    for process, result in enumerate(cluster["results"]):
        assert result["process_index"] == process
        assert result["process_count"] == cluster["processes"]
        mine = share(cluster, process)
        assert result["rows"] == [mine.start, mine.stop]
        assert result["mesh_processes"] == sorted(result["mesh_processes"]), "process-major"
        got = [
            (s["epoch"], s["step"], s["local_ids"], s["local_masks"], s["num_valid"])
            for s in result["steps"]
        ]
        want = [(e, s, ids[mine], masks[mine], valid) for e, s, ids, masks, valid in expected]
        assert got == want, process
        assert all(s["local_rows_agree"] for s in result["steps"]), "a row's fields mixed up"


def test_the_global_batch_is_sharded_over_every_device_of_every_process(cluster):
    size = cluster["args"]["global_batch"]
    every_device = sorted(d for d, _ in cluster["results"][0]["devices"])
    assert len(every_device) == DEVICES_PER_PROCESS * cluster["processes"]
    for process, result in enumerate(cluster["results"]):
        local = [d for d, owner in result["devices"] if owner == process]
        assert result["local_devices"] == local
        per_device = size // len(every_device)
        for step, (_, _, ids, masks, _) in zip(result["steps"], cluster["expected"], strict=True):
            assert step["shapes"] == [[size, 2], [size], [size]]
            assert step["sharding_is_the_feeders"]
            assert step["sharding_devices"] == every_device
            for shards, values in ((step["shards"], ids), (step["mask_shards"], masks)):
                assert [s["device"] for s in shards] == local
                for shard in shards:
                    start = result["mesh_devices"].index(shard["device"]) * per_device
                    assert shard["rows"] == [start, start + per_device]
                    assert shard["values"] == values[start : start + per_device]
            # jax.make_array_from_process_local_data, given this process's rows, makes the same.
            assert step["reference_shards"] == step["shards"]


def test_a_jitted_reduction_over_the_global_batch_agrees_in_every_process(cluster):
    for result in cluster["results"]:
        for step, (_, _, ids, masks, valid) in zip(
            result["steps"], cluster["expected"], strict=True
        ):
            assert step["gathered_ids"] == ids
            assert step["masked_sum"] == sum(i for i, real in zip(ids, masks, strict=True) if real)
            assert step["real_rows"] == valid


def test_every_sample_is_seen_once_per_epoch_across_processes(cluster):
    length = cluster["args"]["length"]
    for epoch in range(EPOCHS):
        seen = collections.Counter(
            i
            for result in cluster["results"]
            for step in result["steps"]
            if step["epoch"] == epoch
            for i, real in zip(step["local_ids"], step["local_masks"], strict=True)
            if real
        )
        assert seen == collections.Counter(range(length)), epoch


def test_a_state_saved_mid_epoch_resumes_exactly_in_every_process(cluster):
    steps_per_epoch = len(cluster["expected"]) // EPOCHS
    resumed = cluster["expected"][steps_per_epoch + STOP_AFTER :]
    assert resumed, "the restored feeder has steps left to run"
    for process, result in enumerate(cluster["results"]):
        assert result["len"] == steps_per_epoch
        assert result["state"] == cluster["results"][0]["state"], "one state on every process"
        assert (result["state"]["epoch"], result["state"]["step"]) == (1, STOP_AFTER)
        assert result["state"]["num_replicas"] == DEVICES_PER_PROCESS * cluster["processes"]
        mine = share(cluster, process)
        after = result["steps"][steps_per_epoch + STOP_AFTER :]
        assert [(s["epoch"], s["step"], s["local_ids"]) for s in after] == [
            (e, s, ids[mine]) for e, s, ids, _, _ in resumed
        ]


def test_the_processes_never_load_tensorflow_or_keras(cluster):
    assert [r["frameworks_loaded"] for r in cluster["results"]] == [[]] * cluster["processes"]


AGREEMENT_TIMEOUT_S = 3
"""How long a process waits for the others' feeders in the test of a process that builds none."""


def test_processes_whose_feeders_differ_are_refused_naming_the_field_and_none_waits(tmp_path):
    """Two processes whose feeders differ in what the order depends on (seed=process_index,
    shuffle in one process only, 24 and 25 samples, remainder, global batch) would make their
    rows of different batches (or, with 3 and 4 steps, one would wait forever in its step's
    collective): every process's fp.Feeder() raises a ValueError naming the field and each
    process's value, at once, leaving nothing running; feeders that agree then feed every sample
    once; and a process whose peer builds no feeder is told so within the agreement's timeout."""
    cases = {
        "seed": (
            [{"seed": 0, "shuffle": True}, {"seed": 1, "shuffle": True}],
            r"`seed`: seed=0 on host 0; seed=1 on host 1\.",
        ),
        "shuffle": (
            [{"shuffle": False}, {"shuffle": True}],
            r"`shuffle`: shuffle=False on host 0; shuffle=True on host 1\.",
        ),
        "length": (
            [{"length": 24}, {"length": 25}],
            r"`dataset_length`: dataset_length=24 on host 0; dataset_length=25 on host 1 "
            r"\(and in steps_per_epoch\)\.",
        ),
        "remainder": (
            [{"length": 26}, {"length": 26, "remainder": "drop"}],
            r"`remainder`: remainder='pad' on host 0; remainder='drop' on host 1 "
            r"\(and in steps_per_epoch\)\.",
        ),
        "global_batch": (
            [{}, {"global_batch": 12}],
            r"`global_batch_size`: global_batch_size=8 on host 0; global_batch_size=12 on host 1 "
            r"\(and in steps_per_epoch\)\.",
        ),
    }
    listed = [{"name": name, "processes": hosts} for name, (hosts, _) in cases.items()]
    listed.append({"name": "same", "processes": [{"seed": 3}, {"seed": 3}]})
    args = {"mode": "differ", "length": 24, "global_batch": 8, "cases": listed}
    env = {"FEEDPIPE_AGREEMENT_TIMEOUT_S": str(AGREEMENT_TIMEOUT_S)}
    results = run_processes(tmp_path, 2, args, env)
    for process, result in enumerate(results):
        for name, (_, pattern) in cases.items():
            error = result["refused"][name]
            expected = (
                r"ValueError: The hosts' feeders differ in " + pattern + r".* repeat some "
                r"samples and miss others\. Build every host's feeder with the same source, "
                rf"global_batch_size, seed, shuffle and remainder \(this is host {process} of 2\)"
            )
            assert error is not None and re.match(expected, error, re.S), (name, process, error)
            assert result["took_s"][name] < AGREEMENT_TIMEOUT_S, "a refusal waits for no one"
        assert result["refused"]["same"] is None
        assert result["left"] == [], "a refused feeder leaves no thread or worker process"
        assert result["frameworks_loaded"] == []
    assert sorted(results[0]["epoch"] + results[1]["epoch"]) == list(range(24))
    alone = results[0]["alone"]
    assert alone is not None and re.match(
        r"RuntimeError: Host 0 of 2 could not check that every host built the same feeder.*"
        rf"1 of 2 processes built their feeder within {AGREEMENT_TIMEOUT_S} s "
        r"\(FEEDPIPE_AGREEMENT_TIMEOUT_S\)",
        alone,
        re.S,
    ), alone
    assert AGREEMENT_TIMEOUT_S <= results[0]["alone_s"] < AGREEMENT_TIMEOUT_S + 5
