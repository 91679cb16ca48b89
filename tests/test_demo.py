"""`feedpipe demo`, the README's first command: it runs end to end in a fresh process (it makes
its own logical devices and strategy) and trains the same model twice to the same loss; it
prints one calibrated step alone, warns where the machine's noise is larger than its speedup,
and writes its figures with `--json`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types

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
    assert len(set(re.findall(r"calibrated: (\d+\.\d ms)", result.stdout))) == 1, result.stdout


def test_the_sources_waits_add_up_to_the_latency_asked_for():
    records = demo.SyntheticRecords(size=64, read_latency_s=200e-6)
    assert demo.measure_read_s(records, samples=200) == pytest.approx(200e-6, rel=0.5)


def test_demo_refuses_fewer_than_one_step_or_device():
    with pytest.raises(ValueError, match="--steps"):
        demo.run(steps=0)
    with pytest.raises(ValueError, match="--devices"):
        tf_demo.configure_devices(0)


def _runs(sync_step_alone_s: float, fed_step_alone_s: float) -> list[demo.RunResult]:
    """Two runs of 100 steps at a speedup of 1.5x whose steps alone took the times given."""
    return [
        demo.RunResult("synchronous feeding", 100, 6.0, 0.33, 0.5, 100 * sync_step_alone_s),
        demo.RunResult("fp.Feeder", 100, 4.0, 0.001, 0.5, 100 * fed_step_alone_s),
    ]


def test_the_noise_warning_fires_exactly_when_the_step_alone_moved_more_than_the_speedup():
    warns = demo.noise_exceeds_effect
    assert not warns((0.040, 0.044), speedup=1.5)  # 10 % apart, 50 % faster
    assert not warns((0.040, 0.059), speedup=1.5)  # 47.5 %
    assert warns((0.040, 0.061), speedup=1.5)  # 52.5 %
    assert warns((0.061, 0.040), speedup=1.5)  # whichever run was slower
    assert warns((0.040, 0.044), speedup=1.05)  # 10 % of noise hides a 5 % speedup
    assert warns((0.040, 0.052), speedup=1 / 1.2)  # 30 % of noise, a 1.2x slowdown
    assert not warns((0.040, 0.044), speedup=1 / 1.2)
    assert not warns((0.040, 0.040), speedup=1.0)


@pytest.mark.parametrize(("fed_step_alone_s", "warned"), [(0.044, False), (0.061, True)])
def test_the_report_prints_the_warning_in_one_line_exactly_when_noise_wins(
    capsys, fed_step_alone_s, warned
):
    calibration = demo.Calibration(step_s=0.040, read_latency_s=1e-4, batch_read_s=0.020)
    demo.print_report(["/cpu:0"], _runs(0.040, fed_step_alone_s), "stats", calibration)
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert "40.0 ms in one run and 61.0 ms in the other" in lines[0]
        assert "do not trust this speedup" in lines[0]


def test_the_header_and_the_report_print_the_one_calibrated_step(capsys):
    calibration = demo.Calibration(step_s=0.0607, read_latency_s=2e-4, batch_read_s=0.030)
    training = types.SimpleNamespace(devices=["/cpu:0"], model="MLP", on="the CPU")
    demo.print_header(training, 100, demo.SyntheticRecords(size=10), calibration)
    header = capsys.readouterr().out
    demo.print_report(["/cpu:0"], _runs(0.030, 0.031), "stats", calibration)
    report = capsys.readouterr().out
    assert re.findall(r"calibrated: (\S+ ms)", header) == ["60.7 ms"]
    assert re.findall(r"calibrated: (\S+ ms)", report) == ["60.7 ms"]
    # Each run's own step is printed beside it, and named for what it is.
    assert re.search(r"synchronous feeding .* 30\.0 ms", report)
    assert re.search(r"fp\.Feeder .* 31\.0 ms", report)


SCHEMA = {
    "speedup": float,
    "input_bound_sync_pct": float,
    "input_bound_feeder_pct": float,
    "step_alone_ms": float,
    "loss_equal": bool,
    "noise_warning": bool,
}
"""The keys of `--json` that `kernels_bench/demo.py` and the docs read, and their types."""


CALIBRATED_DEMO = """
import sys
from feedpipe import cli, demo
demo.measure_step_s = lambda *args: 0.0607
sys.exit(cli.main(sys.argv[1:]))
"""
"""The demo through the command, its step alone calibrated at 60.7 ms whatever this machine
takes."""


@pytest.fixture(scope="module")
def tensorflow_demo(tmp_path_factory):
    """A short TensorFlow demo, its step calibrated at 60.7 ms: `(stdout, --json's figures)`.

    In a fresh interpreter: the demo runs a MirroredStrategy over every logical device, whose
    collectives would share instance keys with later tests' strategies in this process.
    """
    path = tmp_path_factory.mktemp("demo") / "demo.json"
    command = ["demo", "--framework", "tensorflow", "--steps", "3", "--json", str(path)]
    result = subprocess.run(
        [sys.executable, "-c", CALIBRATED_DEMO, *command],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(path.read_text())


def test_the_step_that_sizes_the_reads_is_the_one_the_header_and_report_print(tensorflow_demo):
    stdout, figures = tensorflow_demo
    assert re.findall(r"calibrated: (\S+ ms)", stdout) == ["60.7 ms", "60.7 ms"], stdout
    assert figures["step_alone_ms"] == pytest.approx(60.7)
    # The reads were sized from that same step: a batch's waits are half of it, less the
    # time building its samples takes.
    waits_ms = figures["read_latency_us"] * figures["global_batch_size"] / 1e3
    assert waits_ms == pytest.approx(demo.READ_SHARE * 60.7, rel=0.2)


def test_json_writes_the_figures_the_results_record_reads(tensorflow_demo):
    _, figures = tensorflow_demo
    for key, kind in SCHEMA.items():
        assert isinstance(figures[key], kind), (key, figures.get(key))
    assert figures["framework"] == "tensorflow"
    assert figures["steps"] == 3
    assert figures["loss_equal"] is True
    assert 0 <= figures["input_bound_feeder_pct"] <= 100
    assert 0 <= figures["input_bound_sync_pct"] <= 100
