"""What every backend's monitor must read of an input slower than the step (no framework is
imported here: the JAX tests run without TensorFlow)."""

from __future__ import annotations

import time

import numpy as np
import pytest


class SlowBatches:
    """A map-style source of `length` `(x, y)` rows that sleeps `batch_s` on the first sample
    of each batch of `batch`: one GIL-free wait per batch, as storage or a network read makes."""

    def __init__(self, batch_s: float, length: int, batch: int):
        self.batch_s, self.length, self.batch = batch_s, length, batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if index % self.batch == 0:
            time.sleep(self.batch_s)
        return np.full(3, index % 5, np.float32), np.float32(index % 2)


def assert_reads_the_slower_input(epoch, step_s: float, producer_s: float, steps: int, rel: float):
    """`epoch`, a `StarvationMonitor` epoch of `steps` steps of `step_s` fed by an input making
    a batch every `producer_s`, reads highly input-bound, its wait bracketed around the truth
    and its step alone within `rel` of `step_s`: less the delay other processes caused each of
    the epoch's steps, which the monitor adds to the step alone (on a machine the rest of the
    suite loads, a fifth of a step and more), so that the check holds under load too."""
    truth = 1 - step_s / producer_s  # the input overlaps the step: it waits P - S of every P
    assert epoch.verdict == "highly input-bound"
    low, high = epoch.input_wait_range
    assert low - 0.1 <= truth <= high + 0.1
    assert epoch.steps == steps
    assert epoch.step_alone_s - epoch.other_load_s == pytest.approx(step_s, rel=rel)
