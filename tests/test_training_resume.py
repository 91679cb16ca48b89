"""A run killed mid-epoch and resumed from its checkpoint in a new process is the same run.

`tests/resume_worker.py` trains a small model with `fp.Trainer` under a 4-replica
MirroredStrategy on a shuffled feeder whose epochs end on a padded batch. One process trains
uninterrupted; another writes `tf.train.Checkpoint(model=, optimizer=, feeder=)` after step 2
of epoch 1 and dies with `os._exit`; a third restores it and trains the rest. The resumed run
must take the rest of the same stream and end on the uninterrupted run's weights. A fourth
restores only the model and optimizer, as a checkpoint without the feeder would, and must not:
that shows the comparison can fail.

Each interpreter has a hard deadline, so a hang fails the test instead of freezing the suite.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import resume_worker as worker
from tests.processes import log_tail, run_at_once

pytestmark = pytest.mark.slow  # four interpreters that each train

DEADLINE_S = 120.0
"""Hard deadline of one worker process: ~3 s of TensorFlow import and a few of training."""
RTOL = 1e-6


def run_modes(modes: list[str], out: Path) -> dict[str, int]:
    """Runs the worker in each of `modes` at once, each in a fresh interpreter; exit codes."""
    runs = {mode: [mode, str(out)] for mode in modes}
    return run_at_once(worker.__file__, runs, out, DEADLINE_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each mode's exit code and, where it finished, its saved weights, iterations and start."""
    out = tmp_path_factory.mktemp("resume")
    codes = run_modes(["full", "crash"], out)
    if codes["crash"] == worker.CRASH_EXIT_CODE:
        codes |= run_modes(["resume", "resume-without-feeder"], out)
    results = {}
    for mode, code in codes.items():
        results[mode] = {"exit_code": code, "log": log_tail(out, mode)}
        saved = out / f"{mode}.npz"
        if saved.exists():
            with np.load(saved) as arrays:
                count = sum(name.startswith("weight_") for name in arrays.files)
                results[mode]["weights"] = [arrays[f"weight_{i}"] for i in range(count)]
                results[mode]["iterations"] = int(arrays["iterations"])
                results[mode]["started_at"] = tuple(arrays["started_at"].tolist())
    return results


def finished(runs: dict[str, dict], mode: str) -> dict:
    result = runs.get(mode)
    if result is None:
        pytest.fail(f"The {mode} run never started: the crash run did not crash as planned.")
    if result["exit_code"] != 0 or "weights" not in result:
        pytest.fail(f"The {mode} run failed (exit code {result['exit_code']}):\n{result['log']}")
    return result


def assert_same_weights(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=RTOL)


def test_the_crashed_run_dies_hard_mid_epoch_after_writing_its_checkpoint(runs):
    crash = runs["crash"]
    assert crash["exit_code"] == worker.CRASH_EXIT_CODE, crash["log"]
    assert "weights" not in crash  # it never reached the end of training
    epoch, step = worker.CRASH_AFTER
    # The callback runs after the step: the feeder counts that batch as taken.
    assert finished(runs, "resume")["started_at"] == (epoch, step + 1)


def test_a_resumed_run_ends_with_the_weights_of_a_run_never_interrupted(runs):
    full, resumed = finished(runs, "full"), finished(runs, "resume")
    steps_per_epoch = -(-worker.LENGTH // worker.GLOBAL_BATCH)  # the last batch padded
    # Restored iterations plus the steps trained after the restore: every step exactly once.
    assert full["iterations"] == resumed["iterations"] == worker.EPOCHS * steps_per_epoch
    assert_same_weights(resumed["weights"], full["weights"])


def test_a_resume_without_the_feeders_state_ends_elsewhere(runs):
    """The comparison above can fail: the stream restarting from its beginning changes it."""
    full, blind = finished(runs, "full"), finished(runs, "resume-without-feeder")
    assert blind["started_at"] == (0, 0)
    with pytest.raises(AssertionError):
        assert_same_weights(blind["weights"], full["weights"])
