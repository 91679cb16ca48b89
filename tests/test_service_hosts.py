"""tf.data service beyond one process: the hosts of a MultiWorkerMirroredStrategy cluster each
ask one service for their own rows alone, and a feeder killed mid-epoch resumes in a new
process against the same service; both give the stream a local run gives.

Every process (the service's dispatcher and workers, the cluster's hosts, the killed and the
resumed feeder) runs under a hard deadline and is killed by PID at the end.
"""

from __future__ import annotations

import json
import signal

import pytest

import feedpipe as fp
from tests import service_resume_worker as worker
from tests.cluster import logs, run_cluster
from tests.processes import log_tail, run_at_once
from tests.service_cluster import service_cluster
from tests.test_service import feeder, records, scaled, stream

pytestmark = pytest.mark.slow  # a tf.data service cluster with hosts in their own processes

DEADLINE_S = 120.0
"""Hard deadline of one process: a few seconds of TensorFlow import and a few of feeding."""


def as_json(steps: list[tuple]) -> list:
    """`steps` as a process writes them to JSON and the test reads them back."""
    return json.loads(json.dumps(steps))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A dispatcher and 2 worker processes on loopback, for the whole module."""
    with service_cluster(workers=2, logs=tmp_path_factory.mktemp("service")) as cluster:
        yield cluster


def test_each_host_asks_the_service_for_its_own_rows_and_gathers_the_one_host_stream(
    tmp_path, devices, service
):
    """Two hosts of one replica each, 21 samples in global batches of 4: the last step has one
    real row, on host 0, and host 1's rows there repeat it. Every step gathered from the hosts
    is the one-host stream (ids, values after `transform`, masks); each host's job of an epoch
    asked the service for its share of each step's rows, and the two shares hold every sample."""
    hosts = 2
    args = {"length": 21, "global_batch": 4, "epochs": 2, "seed": 3, "service": service.address}
    codes, results = run_cluster("service", hosts, tmp_path, args, deadline_s=DEADLINE_S)
    assert set(codes.values()) == {0}, logs(tmp_path, "service", hosts)
    with fp.Feeder(
        records(args["length"]),
        args["global_batch"],
        devices=devices[:1],
        transform=scaled,
        shuffle=True,
        seed=args["seed"],
    ) as local:
        expected = as_json(stream(local, args["epochs"]))
    share = args["global_batch"] // hosts
    for epoch in range(args["epochs"]):
        steps = [labels for e, _, labels, _, _ in expected if e == epoch]
        asked = {}
        for host, result in enumerate(results):
            assert result["steps"] == expected, host
            rows = [i for labels in steps for i in labels[host * share : (host + 1) * share]]
            jobs = [job["indices"] for job in result["asked"] if job["epoch"] == epoch]
            assert jobs and jobs[0] == rows, (host, epoch)
            # A job asked again (after a stall) asks only for rows of the same share.
            assert all(set(job) <= set(rows) for job in jobs[1:]), (host, epoch)
            asked[host] = jobs[0]
        assert sorted(set(asked[0]) | set(asked[1])) == list(range(args["length"]))


def test_a_feeder_killed_mid_epoch_resumes_in_a_new_process_against_the_same_service(
    tmp_path, devices, service
):
    """A process takes 2 steps, writes the state and is SIGKILLed with its job unread; a new
    process restores the state: its stream is the rest of the local stream, and its first job
    asks the service only for the rows of the steps not yet taken."""
    for mode, code in (("save", -signal.SIGKILL), ("resume", 0)):
        run = {mode: [mode, str(tmp_path), service.address]}
        codes = run_at_once(worker.__file__, run, tmp_path, DEADLINE_S)
        assert codes == {mode: code}, log_tail(tmp_path, mode)
    assert all(process.poll() is None for process in service.processes), "the service lives on"
    replicas = devices[: worker.REPLICAS]
    with feeder(None, worker.LENGTH, worker.GLOBAL_BATCH, replicas, scaled) as local:
        expected = as_json(stream(local, worker.EPOCHS))
    saved = json.loads((tmp_path / "saved.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert (saved["state"]["epoch"], saved["state"]["step"]) == (0, worker.SAVE_AFTER)
    assert saved["steps"] == expected[: worker.SAVE_AFTER]
    assert resumed["steps"] == expected[worker.SAVE_AFTER :]
    rest = [
        i
        for e, _, labels, _, masks in expected[worker.SAVE_AFTER :]
        if e == 0
        for i in labels[: sum(masks)]
    ]
    first = next(job for job in resumed["asked"] if job["epoch"] == 0)
    assert first["indices"] == rest
