"""`feedpipe demo --framework jax`: the same story as on TensorFlow, with neither TensorFlow nor
Keras loaded, both runs training the same weights from the same batches."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from feedpipe import cli, demo
from feedpipe.jax import demo as jax_demo
from tests.processes import assert_demo_trained_alike


def test_the_feeder_trains_the_same_weights_as_synchronous_feeding(devices):
    training = jax_demo.Training(len(devices))
    global_batch_size = demo.PER_REPLICA_BATCH * len(devices)
    # 300 samples: two full batches and a padded one of 44, so 5 steps cross into epoch 2.
    records = demo.SyntheticRecords(size=300)
    start = training.snapshot()
    initial = training.params
    sync = demo.train_synchronously(training, records, global_batch_size, steps=5)
    after_sync = training.params
    start()
    with training.feeder(records, global_batch_size) as feeder:
        fed, _ = demo.train_with_feeder(training, feeder, steps=5)
    after_fed = training.params
    assert fed.final_loss == pytest.approx(sync.final_loss, rel=1e-6)
    for name in initial:
        mine, theirs = np.asarray(after_sync[name]), np.asarray(after_fed[name])
        np.testing.assert_allclose(theirs, mine, rtol=1e-6, atol=1e-7)
    # Training moved the weights: the comparison is of something learnt.
    assert not np.allclose(np.asarray(after_sync["w2"]), np.asarray(initial["w2"]))


@pytest.mark.slow
def test_the_command_runs_the_demo_on_jax_without_tensorflow_or_keras():
    # A fresh process, as a user starts it: the demo makes its own 4 host devices.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")}
    code = (
        "import sys\n"
        "from feedpipe import cli\n"
        "status = cli.main(['demo', '--framework', 'jax', '--quick', '--steps', '5'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "assert not heavy, heavy[:5]\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(
        r"MLP in JAX on 4 replicas \((GPUs|TPUs|logical CPU devices: no GPU or TPU found)\)",
        result.stdout,
    )
    assert_demo_trained_alike(result.stdout)
    assert re.search(r"speedup with the feeder: \d+\.\d\dx on 4 replicas", result.stdout)


FIND_SPEC = importlib.util.find_spec


def _installed(monkeypatch, *frameworks: str) -> None:
    """Of the demo's frameworks, exactly `frameworks` look installed."""

    def find_spec(name, *args):
        if name not in demo.FRAMEWORKS:
            return FIND_SPEC(name, *args)
        return importlib.machinery.ModuleSpec(name, None) if name in frameworks else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_default_is_tensorflow_where_installed_else_jax(monkeypatch):
    _installed(monkeypatch, "tensorflow", "jax")
    assert demo.choose_framework() == "tensorflow"
    _installed(monkeypatch, "jax")
    assert demo.choose_framework() == "jax"


def test_without_either_framework_the_command_says_what_to_install(monkeypatch, capsys):
    _installed(monkeypatch)
    assert cli.main(["demo", "--quick"]) == 2
    assert re.search(
        r'pip install "feedpipe\[tensorflow\]", "feedpipe\[jax\]" or "feedpipe\[torch\]"',
        capsys.readouterr().err,
    )
    with pytest.raises(ImportError, match=r'pip install "feedpipe\[tensorflow\]"'):
        demo.choose_framework("tensorflow")


def test_the_jax_demo_refuses_an_unknown_framework_or_fewer_than_one_device():
    with pytest.raises(ValueError, match=r"`--framework`='mxnet' must be one of"):
        demo.run(framework="mxnet")
    with pytest.raises(ValueError, match="--devices"):
        jax_demo.configure_devices(0)
