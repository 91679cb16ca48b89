"""`feedpipe demo --framework torch`: the same story as on TensorFlow and JAX, with neither of them
nor Keras loaded, both runs training the same weights from the same batches."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from feedpipe import demo
from feedpipe.torch import demo as torch_demo
from tests.processes import REPO_ROOT, assert_demo_trained_alike


def test_the_feeder_trains_the_same_weights_as_synchronous_feeding():
    training = torch_demo.Training(None)
    global_batch_size = demo.PER_REPLICA_BATCH
    # 70 samples: two full batches and a padded one of 6, so 5 steps cross into epoch 2.
    records = demo.SyntheticRecords(size=70)
    start = training.snapshot()
    initial = {k: v.clone() for k, v in training.net.state_dict().items()}
    sync = demo.train_synchronously(training, records, global_batch_size, steps=5)
    after_sync = {k: v.clone() for k, v in training.net.state_dict().items()}
    start()
    with training.feeder(records, global_batch_size) as feeder:
        fed, _ = demo.train_with_feeder(training, feeder, steps=5)
    after_fed = training.net.state_dict()
    assert fed.final_loss == pytest.approx(sync.final_loss, rel=1e-5)
    for name in initial:
        torch.testing.assert_close(after_fed[name], after_sync[name], rtol=1e-5, atol=1e-6)
    # Training moved the weights: the comparison is of something learnt.
    assert not torch.allclose(after_sync["4.weight"], initial["4.weight"])


def test_the_step_runs_on_the_pinned_threads_and_the_process_gets_its_own_back(monkeypatch):
    own = torch.get_num_threads()
    seen = []
    step = torch_demo.Training.step

    def counting_step(self, *args):
        seen.append(torch.get_num_threads())
        return step(self, *args)

    monkeypatch.setattr(torch_demo.Training, "step", counting_step)
    process_threads = torch_demo.STEP_THREADS + 2
    torch.set_num_threads(process_threads)
    try:
        demo.run(steps=3, framework="torch")
        assert torch.get_num_threads() == process_threads
    finally:
        torch.set_num_threads(own)
    # The calibration's steps and both runs'.
    assert len(seen) == demo.WARMUP_STEPS + demo.TIMED_STEPS + 2 * 3
    assert set(seen) == {torch_demo.STEP_THREADS}


def test_the_threads_are_put_back_when_the_demo_fails():
    own = torch.get_num_threads()
    training = torch_demo.Training(None)
    with pytest.raises(RuntimeError, match="the step failed"), training.pinned():
        assert torch.get_num_threads() == torch_demo.STEP_THREADS
        raise RuntimeError("the step failed")
    assert torch.get_num_threads() == own


def test_more_than_one_device_is_refused_naming_torchrun():
    with pytest.raises(ValueError, match=r"`--devices`=4: PyTorch trains one device per process"):
        torch_demo.Training(4)


@pytest.mark.slow
def test_the_command_runs_the_demo_on_torch_alone():
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    code = (
        "import sys\n"
        "from feedpipe import cli\n"
        "status = cli.main(['demo', '--framework', 'torch', '--quick', '--steps', '5'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'jax'))\n"
        "assert not heavy, heavy[:5]\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"MLP in PyTorch on 1 replica \((GPU|the CPU: no GPU found)\)", result.stdout)
    assert_demo_trained_alike(result.stdout)
    assert re.search(r"speedup with the feeder: \d+\.\d\dx on 1 replica", result.stdout)
