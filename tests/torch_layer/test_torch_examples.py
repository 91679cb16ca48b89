"""The PyTorch examples run end to end: `examples/torch_loop.py` (a loop where a `DataLoader`
was, stopped and resumed mid-epoch from a `torch.save` checkpoint) and `examples/torch_ddp.py`
under `torchrun` with 2 processes on gloo, then resumed from rank 0's checkpoint in one.

Each runs in a fresh interpreter under a hard deadline; past it, the run and every process
under it are killed by PID.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from tests.cluster import free_ports
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.slow  # each starts interpreters that load torch

DEADLINE_S = 120
EPOCH = re.compile(r"^epoch (\d+).*: loss ([\d.]+), accuracy ([\d.]+) over (\d+) samples", re.M)


def run_example(args: list[str], out: Path, name: str, env: dict | None = None) -> str:
    """The output of `python <args>` from the repository's root; fails the test if it exits
    other than 0 or runs past the deadline (then it and its children are killed by PID)."""
    log = out / f"{name}.log"
    environment = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, whatever the machine has
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    with open(log, "w") as file:
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO_ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=file,
            stderr=subprocess.STDOUT,
        )
    try:
        code = process.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish within {DEADLINE_S} s:\n{log.read_text()[-4000:]}")
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()
    output = log.read_text()
    assert code == 0, output[-4000:]
    return output


def load_example(name: str):
    """The module of `examples/<name>.py` (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_loop_example_resumes_mid_epoch_as_if_never_stopped(tmp_path, monkeypatch, capsys):
    """Stopped partway through epoch 1 and resumed, the loop feeds every sample once per epoch
    and ends where a run that never stopped ends: the same loss, to the printed digit."""
    output = run_example(["examples/torch_loop.py", "--epochs", "3"], tmp_path, "torch_loop")
    epochs = [
        (int(e), float(loss), float(acc), int(n)) for e, loss, acc, n in EPOCH.findall(output)
    ]
    assert [(e, n) for e, _, _, n in epochs] == [(0, 1000), (1, 640), (1, 360), (2, 1000)], output
    assert re.search(r"^resumed from .* at epoch 1 step 10$", output, re.M), output
    assert epochs[-1][1] < epochs[0][1] and epochs[-1][2] > 0.9, "the model learnt"
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples"))  # where it finds `blobs`
    load_example("torch_loop").train(str(tmp_path / "never_stopped.pt"), 3)
    never_stopped = EPOCH.findall(capsys.readouterr().out)
    assert [(int(e), float(loss)) for e, loss, _, _ in never_stopped][-1] == epochs[-1][:2]


def test_the_ddp_example_trains_two_processes_and_resumes_in_one(tmp_path):
    """Under torchrun, 2 processes feed every sample of an epoch once between them and rank 0
    saves the feeder's state beside the model's; a job of 1 process goes on from it."""
    checkpoint = tmp_path / "checkpoint.pt"

    def script(epochs: int) -> list[str]:
        return ["examples/torch_ddp.py", "--epochs", str(epochs), "--checkpoint", str(checkpoint)]

    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    torchrun.append(f"--master-port={free_ports(1)[0]}")
    output = run_example([*torchrun, *script(1)], tmp_path, "two")
    assert "world size 2 on cpu; rank 0 stages rows 0 to 63 of each global batch of 128" in output
    assert [(e, n) for e, _, _, n in EPOCH.findall(output)] == [("0", "1000")], output
    saved = torch.load(checkpoint)
    assert (saved["feeder"]["epoch"], saved["feeder"]["step"]) == (1, 0)
    assert {"model", "optimizer"} <= set(saved)
    # The same script without torchrun, as the one process of a new job.
    one = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    one |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    output = run_example(script(2), tmp_path, "one", env=one)
    assert f"resumed from {checkpoint} at epoch 1 of 2" in output
    assert [(e, n) for e, _, _, n in EPOCH.findall(output)] == [("1", "1000")], output
    assert torch.load(checkpoint)["feeder"]["epoch"] == 2
