"""Diagnosing a JAX feeder needs no TensorFlow, and with a plain JAX step no Keras either; where
Keras is needed and TensorFlow is not installed, Keras runs on JAX without `KERAS_BACKEND`; the
CLI has a JAX target. Each case runs in a fresh interpreter without `KERAS_BACKEND`, as a user
who installed `feedpipe[jax]` and set nothing runs it."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.processes import run_as_a_user as run

HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


def test_diagnosing_a_jax_feeder_with_a_plain_jax_step_loads_neither_tensorflow_nor_keras():
    done = run(
        "import sys, json, jax, numpy as np, feedpipe as fp\n"
        "feeder = fp.Feeder((np.zeros((64, 4), np.float32), np.arange(64, dtype=np.int32)), 8,"
        " devices=jax.devices()[:1])\n"
        "step = jax.jit(lambda x, y: (x.sum() + y.sum()))\n"
        "report = fp.diagnose(feeder, lambda b: step(*b.replicas[0]).block_until_ready(),"
        " steps=4)\n"
        "feeder.close()\n"
        "print(json.dumps([report.verdict, 'tensorflow' in sys.modules, 'keras' in sys.modules]))"
    )
    verdict, tensorflow, keras = json.loads(done.stdout.splitlines()[-1])
    assert verdict and not tensorflow and not keras


@pytest.mark.skipif(HAS_TENSORFLOW, reason="with TensorFlow installed Keras's default runs")
def test_the_starvation_monitor_runs_keras_on_jax_where_tensorflow_is_not_installed():
    done = run(
        "import sys, feedpipe as fp\n"
        "monitor = fp.StarvationMonitor()\n"
        "import keras\n"
        "print(keras.backend.backend(), 'tensorflow' in sys.modules)"
    )
    assert done.stdout.split()[-2:] == ["jax", "False"]


def test_the_cli_diagnoses_a_jax_target_without_tensorflow():
    target = "examples/diagnose_target_jax.py:arrays"
    done = run(["-m", "feedpipe"], "diagnose", target, "--json", "--steps", "6")
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["feeder"]["framework"] == "jax"
    assert report["verdict"]
