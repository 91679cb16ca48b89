"""The pieces of errors="skip" without a framework: a skipped row's mask and count, the ledger's
budget and state, and code sent to workers by value keeping its file for tracebacks."""

from __future__ import annotations

import pickle
import traceback

import cloudpickle
import numpy as np
import pytest

from feedpipe.core.sampler import Step
from feedpipe.core.skips import ErrorPolicy, SkipLedger, SkippedSample
from feedpipe.core.state import Position
from feedpipe.core.workers import dumps


def test_a_skipped_row_is_masked_and_not_counted_wherever_it_lies():
    step = Step(0, 0, np.arange(6), 6).skipping([1, 4])
    assert step.num_valid == 4
    assert step.real_rows(2, 4).tolist() == [True, False, True, True, False, True, False, False]


def test_skipping_a_row_twice_counts_it_once():
    step = Step(0, 0, np.arange(4), 4).skipping([2]).skipping([2])
    assert (step.num_valid, step.skipped) == (3, (2,))


def skip(index, epoch=0, step=0):
    return SkippedSample(epoch, index, step, "ValueError", f"bad {index}")


def test_the_ledger_raises_the_error_past_the_budget_naming_count_and_samples():
    ledger = SkipLedger(ErrorPolicy("skip", 2), 100)
    ledger.record(skip(7), ValueError())
    ledger.record(skip(7), ValueError())  # the same sample made again is not a new skip
    ledger.record(skip(9), ValueError())
    error = ValueError("bad 11")
    with pytest.raises(ValueError, match="bad 11") as raised:
        ledger.record(skip(11), error)
    assert "would skip 3 samples of epoch 0 (indices 7, 9, 11)" in raised.value.__notes__[0]
    ledger.record(skip(11, epoch=1), ValueError())  # each epoch has its own budget


def test_a_fraction_budget_allows_at_least_one_sample():
    assert ErrorPolicy("skip", 0.1).budget(30) == 3
    assert ErrorPolicy("skip", 0.01).budget(30) == 1
    assert ErrorPolicy("skip").budget(1000) == 10


def test_the_state_holds_the_epochs_skips_before_the_position_and_restores_them():
    ledger = SkipLedger(ErrorPolicy("skip", 5), 100)
    for record in (skip(3, 0, 0), skip(12, 1, 1), skip(40, 1, 5)):
        ledger.record(record, ValueError())
    state = ledger.state(Position(1, 3))
    assert state == [list(skip(12, 1, 1))]
    restored = SkipLedger(ErrorPolicy("skip", 5), 100)
    restored.restore(state)
    assert restored.before(Position(2, 0)) == [skip(12, 1, 1)]


SOURCE = """
def transform(sample):
    return 1 / sample
"""


def test_code_sent_by_value_keeps_its_file_and_line():
    namespace = {"__name__": "users_script"}  # not importable: cloudpickle sends it by value
    exec(compile(SOURCE, "/home/user/train.py", "exec"), namespace)
    for dump, filename in ((cloudpickle.dumps, "<dynamic-code>"), (dumps, "/home/user/train.py")):
        transform = pickle.loads(dump(namespace["transform"]))
        with pytest.raises(ZeroDivisionError) as raised:
            transform(0)
        frame = traceback.extract_tb(raised.value.__traceback__)[-1]
        assert (frame.filename, frame.lineno) == (filename, 3)
