"""The `feedpipe` command itself: its version, and TensorFlow's start-up lines it leaves out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import feedpipe
from feedpipe import cli


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"feedpipe {feedpipe.__version__}\n"


def test_start_up_chatter_is_left_out_and_every_other_line_kept(capfd):
    with cli._start_up_lines_left_out():
        os.write(2, b"W0000 cudart_stub.cc:31] Could not find cuda drivers on your machine\n")
        os.write(2, b"E0000 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n")
        os.write(2, b"a real error\n")
    err = capfd.readouterr().err
    assert err == "a real error\n"


def test_a_log_level_the_user_chose_is_kept_and_nothing_is_left_out(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    left_out = []
    monkeypatch.setattr(cli, "_start_up_lines_left_out", lambda: left_out.append(True))
    cli._start_tensorflow()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0" and not left_out


def never_loaded():
    raise AssertionError("the target was loaded, to be measured, before --report was checked")


def test_a_report_without_matplotlib_is_refused_before_measuring(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, as uninstalled
    started = []
    monkeypatch.setattr(cli, "_start_tensorflow", lambda: started.append(True))
    argv = ["diagnose", "tests.test_cli:never_loaded", "--report", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("feedpipe diagnose: error: --report needs matplotlib")
    assert 'pip install "feedpipe[report]"' in err and "leave --report out" in err
    assert not started and not (tmp_path / "out").exists()


def test_the_service_help_says_who_can_reach_the_servers_and_the_safe_setup(capsys):
    for argv in (["service", "--help"], ["service", "dispatcher", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
        assert "every interface with no authentication" in shown, argv
        assert "run TensorFlow ops on the workers" in shown, argv
        for safe in ("private network", "firewall", "loopback alone"):
            assert safe in shown, argv
    docs = (Path(__file__).resolve().parent.parent / "docs" / "multi-host.md").read_text()
    docs = " ".join(docs.split())
    assert "with no authentication" in docs and "reading and writing their files" in docs
    assert "private network" in docs and "firewall" in docs and "loopback alone" in docs


class FakeServer:
    target = "grpc://localhost:43210"

    def __init__(self, config):
        self.config = config

    def stop(self):
        pass


@pytest.mark.parametrize("server", ["dispatcher", "worker"])
def test_a_starting_server_says_in_one_line_who_can_reach_it(server, monkeypatch, capsys):
    """Without TensorFlow's servers: a fake `tensorflow` module starts at once, and serving
    returns at once."""
    from types import SimpleNamespace

    from feedpipe.service import servers

    fake = SimpleNamespace(
        DispatcherConfig=dict, DispatchServer=FakeServer, WorkerConfig=dict, WorkerServer=FakeServer
    )
    tensorflow = SimpleNamespace(data=SimpleNamespace(experimental=SimpleNamespace(service=fake)))
    monkeypatch.setitem(sys.modules, "tensorflow", tensorflow)
    monkeypatch.setattr(servers, "_serve", lambda server, stop: None)
    monkeypatch.setattr(servers, "_wait_for_dispatcher", lambda *args: True)
    if server == "dispatcher":
        servers.serve_dispatcher(0)
        port = 43210
    else:
        servers.serve_worker("localhost:5050", 43211, "localhost:%port%")
        port = 43211
    out, err = capsys.readouterr()
    assert "serving" in out and f":{port}" in out  # the line a launcher waits for, unchanged
    [line] = err.splitlines()
    assert line.startswith(f"feedpipe service {server}: warning: port {port} listens on every ")
    assert "no authentication" in line and "TensorFlow ops" in line and "files" in line
    assert "private network" in line and "firewall" in line and "docs/multi-host.md" in line


def tiny_target():
    """A module:function target: batches from memory and a step that does nothing."""
    import numpy as np

    return (np.zeros((4, 3), np.float32) for _ in range(1000)), lambda batch: None


@pytest.mark.slow
def test_the_command_prints_no_tensorflow_start_up_lines():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    command = [sys.executable, "-m", "feedpipe", "diagnose", "tests.test_cli:tiny_target"]
    result = subprocess.run(
        [*command, "--json", "--steps", "2", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["command"].startswith("feedpipe diagnose tests.test_cli")
    for piece in cli.START_UP_CHATTER:
        assert piece not in result.stderr
