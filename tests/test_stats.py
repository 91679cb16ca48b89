"""FeedStats: steps and samples are counted, the figures are sane, and the input-bound fraction
tells a starved step from a compute-bound one (with wide margins: this runs on two cores)."""

from __future__ import annotations

import dataclasses
import time

import pytest

import feedpipe as fp
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.stats import HIGH_FRACTION, MODERATE_FRACTION, STARTUP_STEPS, verdict
from tests.fakes import SlowSource, index_arrays


@pytest.mark.parametrize(
    ("fraction", "words"),
    [
        (0.0, "not input-bound"),
        (0.049, "not input-bound"),
        (0.05, "moderately input-bound"),
        (0.199, "moderately input-bound"),
        (0.20, "highly input-bound"),
        (1.0, "highly input-bound"),
    ],
)
def test_verdict_uses_the_profilers_thresholds(fraction, words):
    assert verdict(fraction) == words
    assert (MODERATE_FRACTION, HIGH_FRACTION) == (0.05, 0.20)


def snapshot(**overrides) -> fp.FeedStats:
    values = dict(
        steps=10,
        samples=80,
        wall_s=2.0,
        consumer_wait_s=0.5,
        producer_wait_s=0.1,
        producer_busy_s=0.4,
        produced_samples=80,
        startup_wait_s=0.2,
        mean_occupancy=1.5,
        depth=2,
        overflow_slots=0,
    )
    values.update(overrides)
    # Fields added later (waits, counters) default to 0 here.
    for field in dataclasses.fields(fp.FeedStats):
        values.setdefault(field.name, 0)
    return fp.FeedStats(**values)


def test_derived_figures_follow_from_the_snapshot():
    stats = snapshot()
    assert stats.input_bound_fraction == pytest.approx(0.25)
    assert stats.verdict == "highly input-bound"
    assert stats.samples_per_s == pytest.approx(40.0)
    assert stats.producer_samples_per_s == pytest.approx(200.0)
    assert stats.consumer_samples_per_s == pytest.approx(80 / 1.5)
    assert "highly input-bound" in str(stats) and "25.0%" in str(stats)


def test_a_snapshot_with_nothing_measured_says_so_and_claims_no_verdict():
    stats = snapshot(steps=0, samples=0, wall_s=0.0, consumer_wait_s=0.0, producer_busy_s=0.0)
    assert stats.input_bound_fraction == stats.samples_per_s == 0.0
    assert stats.producer_samples_per_s == stats.consumer_samples_per_s == 0.0
    assert stats.verdict == "no steps measured yet"
    assert str(stats).startswith("no steps measured yet") and "input-bound" not in str(stats)


def test_steps_whose_wait_was_not_timed_are_counted_and_judged_by_no_verdict():
    recorder = StatsRecorder(depth=2)
    recorder.gathered(steps=40, samples=37 * 8, wall_s=0.4, busy_s=0.01, produced=37 * 8)
    stats = recorder.snapshot()
    assert (stats.steps, stats.samples, stats.untimed_steps) == (40, 296, 40)
    assert stats.samples_per_s == pytest.approx(296 / 0.4)
    assert stats.verdict == "input wait not measured"
    assert "40 steps took 296 samples" in str(stats) and "input-bound" not in str(stats)


def test_untimed_steps_leave_the_input_bound_fraction_of_the_timed_ones_alone():
    stats = snapshot(wall_s=2.0 + 3.0, untimed_steps=30, untimed_s=3.0, steps=40)
    assert stats.input_bound_fraction == pytest.approx(0.25)
    assert stats.verdict == "highly input-bound"
    assert "over 10 steps (30 more gathered by TensorFlow, untimed)" in str(stats)


def test_stats_are_a_frozen_snapshot():
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot().steps = 3


def test_recorder_keeps_the_first_wait_of_a_stream_out_of_the_steady_state():
    recorder = StatsRecorder(depth=2)
    recorder.stream_started()
    recorder.taken(asked=0.0, got=1.0, occupancy=0, samples=4)
    recorder.taken(asked=1.5, got=1.6, occupancy=2, samples=4)
    recorder.loop_ended(2.0)
    stats = recorder.snapshot()
    assert (stats.steps, stats.samples) == (2, 8)
    assert stats.startup_wait_s == pytest.approx(1.0)
    assert stats.consumer_wait_s == pytest.approx(0.1)
    assert stats.wall_s == pytest.approx(0.1 + 0.5 + 0.4)
    assert stats.mean_occupancy == pytest.approx(2.0)


def epochs_of_a_jitted_step(recorder: StatsRecorder, epochs: int) -> list[fp.FeedStats]:
    """A loop per epoch of 8 batches of 8 samples: each batch arrives 0.01 s after it is asked
    for, the step takes 0.1 s, and the first two steps 1.0 s more each (they compile)."""
    snapshots, now = [], 0.0
    recorder.stream_started()
    for epoch in range(epochs):
        for step in range(8):
            recorder.taken(asked=now, got=now + 0.01, occupancy=1, samples=8)
            now += 0.01 + 0.1 + (1.0 if epoch == 0 and step < 2 else 0.0)
        recorder.loop_ended(now)
        snapshots.append(recorder.snapshot())
    return snapshots


def test_the_steady_rate_leaves_the_start_up_out_and_holds_across_epochs():
    first, *later = epochs_of_a_jitted_step(StatsRecorder(depth=2), epochs=3)
    assert first.steady_steps == 0 and first.steady_samples_per_s == 0.0
    assert first.samples_per_s < later[0].samples_per_s < later[1].samples_per_s, "diluted"
    for stats in later:
        assert stats.steps - stats.steady_steps == STARTUP_STEPS == 10
        assert stats.steady_samples_per_s == pytest.approx(8 / 0.11)
        assert stats.consumer_samples_per_s == pytest.approx(8 / 0.1)
    assert later[-1].startup_s == pytest.approx(9 * 0.01 + 10 * 0.1 + 2 * 1.0)


def test_the_text_says_which_rate_is_steady_and_what_start_up_took():
    first, _, last = epochs_of_a_jitted_step(StatsRecorder(depth=2), epochs=3)
    assert "22 samples/s delivered, all in start-up (the first 10 steps" in str(first)
    text = str(last)
    assert "73 samples/s delivered after start-up (the last 14 steps), 41/s over every" in text
    assert "(start-up: the first 10 took 3.09 s)" in text and "step alone 80/s" in text


def test_a_loop_whose_first_step_is_slow_shows_a_steady_rate_apart(devices):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:1]) as feeder:
        for epoch in range(3):
            for step, _ in enumerate(feeder):
                time.sleep(0.5 if epoch == step == 0 else 0.01)  # the first step compiles
        stats = feeder.stats()
    assert (stats.steps, stats.steady_steps, stats.steady_samples) == (30, 20, 80)
    assert stats.startup_s >= 0.5
    assert stats.steady_samples_per_s > 1.5 * stats.samples_per_s, stats
    assert "after start-up (the last 20 steps)" in str(stats)


def assert_sane(stats: fp.FeedStats, depth: int) -> None:
    for field in dataclasses.fields(stats):
        value = getattr(stats, field.name)
        if isinstance(value, int | float):  # page_locked and its reason are facts, not counts
            assert value >= 0, field.name
    assert 0.0 <= stats.input_bound_fraction <= 1.0
    assert 0.0 <= stats.mean_occupancy <= depth
    assert stats.consumer_wait_s <= stats.wall_s
    assert stats.depth == depth


def test_steps_and_real_samples_are_counted(devices):
    with fp.Feeder(index_arrays(13), 4, devices=devices[:2]) as feeder:
        assert feeder.stats().steps == 0
        for _ in range(3):
            for _ in feeder:
                pass
        stats = feeder.stats()
    assert stats.steps == 12
    assert stats.samples == 39, "padding rows are not samples"
    assert stats.overflow_slots == 0
    assert_sane(stats, depth=2)


def test_a_slow_source_makes_the_step_highly_input_bound(devices):
    with fp.Feeder(SlowSource(44, delay_s=0.004), 4, devices=devices[:1]) as feeder:
        for _ in feeder:
            pass  # the step itself is instant
        stats = feeder.stats()
    assert_sane(stats, depth=2)
    assert stats.steps == 11
    assert stats.input_bound_fraction > 0.5, stats
    assert stats.verdict == "highly input-bound"
    assert stats.mean_occupancy < 1.0
    assert stats.consumer_wait_s > stats.producer_wait_s


def test_a_slow_step_is_not_input_bound(devices):
    with fp.Feeder(index_arrays(40), 4, devices=devices[:2], depth=2) as feeder:
        for _ in feeder:
            time.sleep(0.05)  # a GIL-free step, much longer than making a batch
        stats = feeder.stats()
    assert_sane(stats, depth=2)
    assert stats.steps == 10
    assert stats.input_bound_fraction < HIGH_FRACTION, stats
    assert stats.verdict != "highly input-bound"
    assert stats.mean_occupancy > 1.0
    assert stats.producer_wait_s > stats.consumer_wait_s
    assert stats.wall_s >= 9 * 0.05
