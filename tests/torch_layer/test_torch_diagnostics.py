"""Diagnosing a PyTorch feeder with a plain PyTorch step needs neither Keras, TensorFlow nor JAX,
a step that returns its loss (a tensor that requires its gradient) is waited for, and the CLI has
a PyTorch target. Each case runs in a fresh interpreter without `KERAS_BACKEND`, as a user who
installed `feedpipe[torch]` and set nothing runs it."""

from __future__ import annotations

import json

from tests.processes import run_as_a_user as run


def test_a_plain_torch_step_is_diagnosed_and_nothing_else_is_loaded():
    done = run(
        "import sys, json, numpy as np, torch, feedpipe as fp\n"
        "feeder = fp.Feeder((np.zeros((64, 4), np.float32), np.arange(64) % 3), 8,"
        " framework='torch')\n"
        "model = torch.nn.Linear(4, 3)\n"
        "def step(batch):\n"
        "    (x, y), mask = batch.distributed()\n"
        "    loss = torch.nn.functional.cross_entropy(model(x), y)\n"
        "    loss.backward()\n"
        "    return loss\n"
        "report = fp.diagnose(feeder, step, steps=4)\n"
        "feeder.close()\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'jax', 'keras'})\n"
        "print(json.dumps([report.verdict, report.step_kind, heavy]))"
    )
    verdict, step_kind, heavy = json.loads(done.stdout.splitlines()[-1])
    assert verdict and step_kind == "step()" and heavy == []


def test_the_cli_diagnoses_a_torch_target():
    target = "examples/diagnose_target_torch.py:slow_reads"
    done = run(["-m", "feedpipe"], "diagnose", target, "--json", "--steps", "6")
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["feeder"]["framework"] == "torch"
    assert report["verdict"], report
