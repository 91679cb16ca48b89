"""errors="skip": a sample whose `transform` raises becomes a padding row of its batch (masked,
weight zero), so every other sample arrives once per epoch in its place; the skips are counted
and named in stats() and the state, stay skipped on every resume, and are bounded by
max_skipped. errors="raise" stays the default. A worker's traceback names the user's file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import feedpipe as fp
from feedpipe.core import skips
from tests.processes import REPO_ROOT
from tests.worker_fakes import (
    BadSample,
    FailsOn,
    FailsOnce,
    FailsUnprintably,
    UnpicklableUnprintableError,
    index_pairs,
)

LENGTH = 30
BATCH = 8  # 2 rows per device on 4 devices; 4 steps, the last holding 6 real samples
BAD = (3, 12, 29)


def rows(batch) -> list[tuple[int, bool]]:
    """Each row's label and mask, in global row order."""
    out = []
    for (_, labels), mask in zip(batch.replicas, batch.masks, strict=True):
        out += zip(np.asarray(labels).tolist(), np.asarray(mask).tolist(), strict=True)
    return out


def feeder(devices, workers=0, transform=None, **options):
    return fp.Feeder(
        index_pairs(LENGTH),
        BATCH,
        devices=devices,
        workers=workers,
        transform=transform or FailsOn(BAD),
        errors="skip",
        **{"max_skipped": len(BAD), **options},
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_delivers_every_other_sample_once_per_epoch_and_masks_exactly_the_skipped_rows(
    devices, workers
):
    with feeder(devices, workers) as f:
        for _ in range(2):  # a skipped sample is tried again, and skipped, every epoch
            batches = [rows(b) for b in f]
            real = [label for batch in batches for label, mask in batch if mask]
            assert real == [i for i in range(LENGTH) if i not in BAD]
            for step, batch in enumerate(batches):
                first = step * BATCH
                count = min(BATCH, LENGTH - first)
                masked = [r for r, (_, mask) in enumerate(batch[:count]) if not mask]
                assert masked == [i - first for i in BAD if first <= i < first + count]
                # A skipped row holds a copy of a real row of its batch, never stale bytes.
                assert {label for label, _ in batch} <= {label for label, m in batch if m}
        skipped = f.stats().skipped
    assert [(s.epoch, s.index, s.step) for s in skipped] == [
        (e, i, i // BATCH) for e in range(2) for i in BAD
    ]
    assert {(s.error.rsplit(".", 1)[-1], s.message) for s in skipped} == {
        ("BadSample", f"sample {i} is corrupt") for i in BAD
    }
    assert f.stats().skipped_samples == 6


@pytest.mark.parametrize("workers", [0, 2])
def test_sample_0_is_skipped_too_the_structure_coming_from_the_next_that_reads(devices, workers):
    # Sample 0 is read at construction to learn the structure: it fails, so sample 1 tells it.
    with feeder(devices, workers, transform=FailsOn({0, 3})) as f:
        real = [label for b in f for label, mask in rows(b) if mask]
        skipped = [(s.epoch, s.index, s.step) for s in f.stats().skipped]
    assert real == [i for i in range(LENGTH) if i not in (0, 3)]
    assert skipped == [(0, 0, 0), (0, 3, 0)]


@pytest.mark.parametrize("workers", [0, 2])
def test_num_valid_counts_the_real_samples_left(devices, workers):
    with feeder(devices, workers) as f:
        assert [b.num_valid for b in f] == [7, 7, 8, 5]


@pytest.mark.parametrize("workers", [0, 2])
def test_more_skips_than_max_skipped_raise_the_error_naming_count_samples_and_fix(devices, workers):
    with feeder(devices, workers, max_skipped=2) as f, pytest.raises(BadSample) as raised:
        list(f)
    note = "\n".join(raised.value.__notes__)
    assert "would skip 3 samples of epoch 0 (indices 3, 12, 29)" in note
    assert "max_skipped=2" in note and "raise max_skipped" in note


def test_a_fraction_budget_counts_samples_of_the_epoch(devices):
    # 0.1 of 30 samples: 3 may be skipped, the bad ones exactly.
    with feeder(devices, max_skipped=0.1) as f:
        assert sum(b.num_valid for b in f) == LENGTH - len(BAD)
    with feeder(devices, max_skipped=0.09) as f, pytest.raises(BadSample, match="corrupt"):
        list(f)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_after_skips_gives_the_same_stream(devices, workers):
    with feeder(devices, workers, shuffle=True, seed=3) as whole:
        expected = [rows(b) for b in whole]
    with feeder(devices, workers, shuffle=True, seed=3) as first:
        loop = iter(first)
        head = [rows(next(loop)), rows(next(loop))]
        loop.close()
        state = json.loads(json.dumps(first.get_state()))
        taken = first.stats().skipped
    with feeder(devices, workers, shuffle=True, seed=3) as resumed:
        resumed.set_state(state)
        tail = [rows(b) for b in resumed]
        named = resumed.stats().skipped
    assert head + tail == expected
    assert [s[1] for s in state["skipped"]] == [s.index for s in taken]
    assert [s.index for s in named] == [
        s.index
        for s in sorted(
            taken + tuple(s for s in named if s.step >= 2), key=lambda s: (s.epoch, s.step, s.index)
        )
    ]
    assert sorted(s.index for s in named) == sorted(BAD)


def test_a_loop_after_a_break_remakes_the_batches_made_ahead_with_the_same_skips(devices):
    transform = FailsOn(BAD)
    with feeder(devices, transform=transform) as f:
        loop = iter(f)
        next(loop)  # step 0; step 1 (samples 8-15) is made ahead: sample 12 is skipped there
        wait_for_a_batch_made_ahead(f)
        loop.close()  # the batches made ahead are made again by the next loop
        rest = [label for b in f for label, mask in rows(b) if mask]
    assert transform.calls[12] >= 1
    assert rest == [i for i in range(BATCH, LENGTH) if i not in BAD]


def wait_for_a_batch_made_ahead(f) -> None:
    deadline = time.monotonic() + 10
    while f._assembly.pipeline.handoff.staged < 1 and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_skip_in_a_batch_made_ahead_and_not_taken_is_not_kept(devices, workers):
    # Sample 12 fails once only (a read that timed out), in step 1, made ahead while step 0 is
    # taken; the loop is left there. The next loop here reads it again, as a feeder restored
    # from the state does: one state, one stream. (Worker threads share the transform.)
    transform = FailsOnce({12})
    mode = {"workers": workers, "worker_mode": "thread"} if workers else {}
    with feeder(devices, transform=transform, **mode) as f:
        loop = iter(f)
        next(loop)
        wait_for_a_batch_made_ahead(f)
        loop.close()
        state = json.loads(json.dumps(f.get_state()))
        here = [rows(b) for b in f]
        assert f.stats().skipped == ()
    with feeder(devices, transform=transform, **mode) as restored:
        restored.set_state(state)
        there = [rows(b) for b in restored]
    assert state["skipped"] == []
    assert here == there
    assert [label for label, mask in here[0] if mask] == list(range(BATCH, 2 * BATCH))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_whose_str_raises_is_skipped_and_named_by_its_type(devices, workers):
    with feeder(devices, workers, transform=FailsUnprintably(BAD)) as f:
        assert sum(b.num_valid for b in f) == LENGTH - len(BAD)
        skipped = f.stats().skipped
    assert [(s.index, s.error, s.message) for s in skipped] == [
        (i, "tests.worker_fakes.UnprintableError", "UnprintableError") for i in BAD
    ]


def test_an_unpicklable_error_whose_str_raises_reaches_the_loop_named_by_its_type(devices):
    transform = FailsUnprintably(BAD, UnpicklableUnprintableError)
    name = "tests.worker_fakes.UnpicklableUnprintableError: UnpicklableUnprintableError"
    with (
        fp.Feeder(index_pairs(LENGTH), BATCH, devices=devices, workers=2, transform=transform) as f,
        pytest.raises(RuntimeError, match=rf"^{name} \(raised in a worker; it cannot be") as raised,
    ):
        list(f)
    assert any("index 3 of epoch 0" in note for note in raised.value.__notes__)


def test_raise_stays_the_default_and_names_the_sample(devices):
    with (
        fp.Feeder(index_pairs(LENGTH), BATCH, devices=devices, transform=FailsOn(BAD)) as f,
        pytest.raises(BadSample, match="sample 3 is corrupt") as raised,
    ):
        list(f)
    assert f.options.errors == "raise"
    assert any("index 3 of epoch 0" in note for note in raised.value.__notes__)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"errors": "ignore"}, ValueError, r'`errors`=\'ignore\' must be "raise" or "skip"'),
        ({"max_skipped": 3}, ValueError, r'`max_skipped`=3 is the budget of errors="skip"'),
        ({"errors": "skip", "max_skipped": -1}, ValueError, r"`max_skipped`=-1 must be >= 0"),
        ({"errors": "skip", "max_skipped": 1.5}, ValueError, r"must lie in \(0, 1\]"),
        ({"errors": "skip", "max_skipped": True}, TypeError, r"must be a count"),
    ],
)
def test_an_unknown_policy_or_budget_is_refused_naming_the_fix(devices, options, error, match):
    with pytest.raises(error, match=match):
        fp.Feeder(index_pairs(LENGTH), BATCH, devices=devices, **options)


def test_skip_is_refused_for_a_generator_naming_why_and_the_fix(devices):
    def samples(shard, num_shards):
        yield from zip(*index_pairs(LENGTH), strict=True)

    with pytest.raises(ValueError, match=r'`errors`="skip" needs an indexed source.*pass'):
        fp.Feeder(fp.from_generator(samples), BATCH, devices=devices, errors="skip")


def test_a_workers_traceback_names_the_users_file_and_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import feedpipe as fp

            def transform(sample):
                if int(sample[1]) == 5:
                    raise ValueError("bad sample")  # line 7
                return sample

            x = np.zeros((16, 2), np.float32); y = np.arange(16, dtype=np.int32)
            feeder = fp.Feeder((x, y), 4, framework="jax", workers=2, transform=transform)
            try:
                list(feeder)
            except ValueError as error:
                print("\\n".join(error.__notes__))
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": ""}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f'File "{script}", line 7, in transform' in done.stdout
    assert 'raise ValueError("bad sample")' in done.stdout
    assert "<dynamic-code>" not in done.stdout


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_past_the_records_kept_resumes_with_the_same_count_and_digest(
    devices, workers, monkeypatch
):
    # 1 sample in 3 fails over 25 steps; 4 records kept an epoch, the rest counted.
    monkeypatch.setattr(skips, "RECORDS_KEPT", 4)
    bad = tuple(range(0, 200, 3))
    options = {"devices": devices, "workers": workers, "errors": "skip", "max_skipped": 0.5}
    with fp.Feeder(index_pairs(200), BATCH, transform=FailsOn(bad), **options) as whole:
        loop = iter(whole)
        states = {}
        for step in range(1, 26):
            next(loop)
            if step in (10, 20):
                states[step] = json.loads(json.dumps(whole.get_state()))
        loop.close()
        assert whole.stats().skipped_samples == len(bad)
    with fp.Feeder(index_pairs(200), BATCH, transform=FailsOn(bad), **options) as resumed:
        resumed.set_state(states[10])
        assert resumed.stats().skipped_samples == states[10]["skipped_count"] == 27
        assert len(resumed.stats().skipped) == 4
        loop = iter(resumed)
        for _ in range(10):
            next(loop)
        assert resumed.get_state() == states[20]
        loop.close()
    assert len(json.dumps(states[20]["skipped"])) < 1000


@pytest.mark.parametrize("workers", [0, 2])
def test_skips_past_the_records_kept_count_once_across_breaks_asides_and_a_step_that_raised(
    devices, workers, monkeypatch
):
    # A consumer that goes back (a break, a block read aside, a `with batch:` step that raised
    # and was read again) folds only the skips of batches it cannot go back to: its state at
    # each point equals that of a feeder read straight to the same batch.
    monkeypatch.setattr(skips, "RECORDS_KEPT", 2)
    bad = tuple(range(0, 200, 3))
    options = {"devices": devices, "workers": workers, "errors": "skip", "max_skipped": 0.5}

    def build():
        return fp.Feeder(index_pairs(200), BATCH, transform=FailsOn(bad), **options)

    def take(feeder, count):
        loop = iter(feeder)
        for _ in range(count):
            next(loop)
        loop.close()

    seen = []
    with build() as feeder:
        take(feeder, 5)  # a break
        seen.append(json.loads(json.dumps(feeder.get_state())))
        with feeder.set_aside():  # reads that train nothing: the position comes back
            take(feeder, 3)
        seen.append(json.loads(json.dumps(feeder.get_state())))
        with pytest.raises(ValueError, match="the step failed"):
            for batch in feeder:
                with batch:
                    if batch.step == 9:
                        raise ValueError("the step failed")
        seen.append(json.loads(json.dumps(feeder.get_state())))  # at step 9, given back
        take(feeder, 12)  # from the batch given back, step 9, to step 21
        seen.append(json.loads(json.dumps(feeder.get_state())))
    assert [(s["epoch"], s["step"]) for s in seen] == [(0, 5), (0, 5), (0, 9), (0, 21)]
    for state in seen:
        with build() as straight:
            take(straight, state["step"])
            assert straight.get_state() == state
    assert seen[-1]["skipped_count"] == sum(1 for i in bad if i < 21 * BATCH)
