"""`feedpipe demo`, the README's first command: it runs end to end in a fresh process (it makes
its own logical devices and strategy) and trains the same model twice to the same loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from feedpipe import cli, demo
from feedpipe.tf import demo as tf_demo
from tests.processes import assert_demo_trained_alike


@pytest.mark.slow
def test_the_demo_trains_the_same_model_both_ways_and_reports_both():
    # As a user runs it: no TF_CPP_MIN_LOG_LEVEL of their own.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(
        [sys.executable, "-m", "feedpipe", "demo", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for piece in cli.START_UP_CHATTER:  # TensorFlow's CUDA probe, on a machine without GPU
        assert piece not in result.stderr
    # Without a GPU the demo says so itself.
    assert re.search(r"on 4 replicas \((GPUs|logical CPU devices: no GPU found)\)", result.stdout)
    assert_demo_trained_alike(result.stdout)
    assert re.search(r"so that reading a batch takes about half a step here", result.stdout)


def test_the_sources_waits_add_up_to_the_latency_asked_for():
    records = demo.SyntheticRecords(size=64, read_latency_s=200e-6)
    assert demo.measure_read_s(records, samples=200) == pytest.approx(200e-6, rel=0.5)


def test_demo_refuses_fewer_than_one_step_or_device():
    with pytest.raises(ValueError, match="--steps"):
        demo.run(steps=0)
    with pytest.raises(ValueError, match="--devices"):
        tf_demo.configure_devices(0)
