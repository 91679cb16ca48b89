"""Split: each replica (and each host) takes its own contiguous rows; sizes that cannot be split
are refused."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest

from feedpipe.core.sampler import Sampler
from feedpipe.core.split import HostShare, ReplicaSplit
from tests.processes import REPO_ROOT


def test_each_replica_takes_its_own_contiguous_rows():
    split = ReplicaSplit(12, 4)
    assert split.per_replica == 3
    assert [list(split.rows(r)) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_global_batch_not_divisible_by_the_replicas_names_both_numbers():
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size`=30 is not divisible by the 4 "
        r"replicas; use a multiple of 4 \(for example 28\)",
    ):
        ReplicaSplit(30, 4)


@pytest.mark.parametrize(
    ("name", "args"),
    [("global_batch_size", (0, 1)), ("num_replicas", (4, 0)), ("global_batch_size", (True, 1))],
)
def test_non_positive_sizes_are_refused(name, args):
    with pytest.raises(ValueError, match=rf"`{name}`=.* must be an integer >= 1"):
        ReplicaSplit(*args)


def test_host_share_takes_its_replicas_contiguous_rows():
    share = HostShare(12, num_hosts=3, host=1, local_replicas=2)
    assert (share.num_replicas, share.first_replica, share.rows) == (6, 2, range(4, 8))
    assert share.local_split == ReplicaSplit(4, 2)


def test_a_global_batch_the_cluster_cannot_split_names_both_sides():
    with pytest.raises(
        ValueError,
        match=r"`global_batch_size`=10 is not divisible by the 4 replicas of the cluster "
        r"\(2 hosts x 2 replicas each\).*use a multiple of 4 \(for example 8\)",
    ):
        HostShare(10, num_hosts=2, host=0, local_replicas=2)


def hosts_steps(length, global_batch, hosts, local, epoch, **options):
    """Each host's steps of `epoch`, planned by that host alone (no communication)."""
    plans = []
    for host in range(hosts):
        share = HostShare(global_batch, hosts, host, local)
        sampler = Sampler(length, global_batch, share=share.rows, **options)
        plans.append(list(sampler.steps(epoch)))
    return plans


@pytest.mark.parametrize("hosts", [1, 2, 3, 64, 1024])
@pytest.mark.parametrize("local", [1, 2, 8])
def test_the_hosts_rows_of_each_step_are_the_one_host_batch(hosts, local):
    """Planned per host in numpy alone, for up to 1,024 hosts of 8 replicas: per step, the
    hosts' rows side by side are the one-host global batch (padding included), the masks mark
    its real rows, and every host has the same steps."""
    replicas = hosts * local
    global_batch = replicas * 2
    lengths = [3 * global_batch, 3 * global_batch + 1, 3 * global_batch - 1, global_batch - 1]
    for length, shuffle in itertools.product(lengths, (False, True)):
        one_host = Sampler(length, global_batch, shuffle=shuffle, seed=9)
        expected = list(one_host.steps(1))
        plans = hosts_steps(length, global_batch, hosts, local, 1, shuffle=shuffle, seed=9)
        for steps in plans:
            assert len(steps) == len(expected) == len(one_host)
        for index, want in enumerate(expected):
            padded = want.rows[np.arange(global_batch) % want.num_valid]
            rows = np.concatenate([steps[index].rows for steps in plans])
            # One host reads the real rows once and copies them into the padding rows.
            rows = rows[np.arange(global_batch) % len(rows)]
            np.testing.assert_array_equal(rows, padded)
            masks = np.concatenate(
                [steps[index].real_rows(local, global_batch // replicas) for steps in plans]
            )
            np.testing.assert_array_equal(masks, np.arange(global_batch) < want.num_valid)
            assert {steps[index].num_valid for steps in plans} == {want.num_valid}


def test_the_planner_runs_without_tensorflow():
    """Worker processes and the planner never load TensorFlow."""
    code = (
        "import sys; import feedpipe.core.sampler, feedpipe.core.split; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)
