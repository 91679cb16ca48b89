"""The pieces of errors="skip" without a framework: a skipped row's mask and count, the ledger's
budget and state, and code sent to workers by value keeping its file for tracebacks."""

from __future__ import annotations

import json
import pickle
import random
import traceback

import cloudpickle
import numpy as np
import pytest

from feedpipe.core import skips
from feedpipe.core.pickling import dumps
from feedpipe.core.sampler import Step
from feedpipe.core.skips import (
    MESSAGE_CHARS,
    RECORDS_KEPT,
    ErrorPolicy,
    SkipLedger,
    SkippedSample,
    describe,
)
from feedpipe.core.state import Position


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
    assert state["skipped"] == [list(skip(12, 1, 1))]
    assert state["skipped_count"] == 1
    restored = SkipLedger(ErrorPolicy("skip", 5), 100)
    restored.restore({"epoch": 1, **state})
    assert restored.before(Position(2, 0)) == ([skip(12, 1, 1)], 0)


@pytest.fixture
def kept(monkeypatch):
    """A few records kept an epoch, so that a test goes past them in a few skips."""
    monkeypatch.setattr(skips, "RECORDS_KEPT", 4)
    return 4


def booked(ledger: SkipLedger, records, fold_each_step: bool = False) -> SkipLedger:
    for record in records:
        ledger.record(record, ValueError())
        if fold_each_step:  # as a consumer settles past the batches it took
            ledger.fold_before(Position(record.epoch, record.step))
    return ledger


def many(epoch: int = 0, steps: range = range(20), per_step: int = 3) -> list[SkippedSample]:
    return [skip(10 * step + i, epoch, step) for step in steps for i in range(per_step)]


def test_a_state_past_the_records_kept_stays_under_a_megabyte_whatever_the_budget():
    # Messages as heavy as a record allows: every character escaped as a surrogate pair.
    kind, message = describe(ValueError("\U0001f4a5" * 10_000 + "\nsecond line"))
    assert len(message) == MESSAGE_CHARS and message.endswith("\u2026")
    ledger = SkipLedger(ErrorPolicy("skip", 1.0), 1_000_000)
    for index in range(50_000):
        ledger.record(SkippedSample(0, index, index // 64, kind, message), ValueError())
    state = ledger.state(Position(0, 50_000 // 64 + 1))
    assert len(json.dumps(state)) < 1_000_000
    assert len(state["skipped"]) == RECORDS_KEPT
    assert state["skipped_count"] == 50_000


def test_the_budget_counts_the_skips_past_the_records_kept(kept):
    ledger = booked(SkipLedger(ErrorPolicy("skip", 10), 100), many(per_step=2)[:10])
    with pytest.raises(ValueError, match="bad 999") as raised:
        ledger.record(skip(999, 0, 7), ValueError("bad 999"))
    assert (
        "would skip 11 samples of epoch 0 (indices 0, 1, 10, 11, 999 and 6 more)"
        in (raised.value.__notes__[0])
    )
    assert ledger.before(Position(1, 0)) == (many(per_step=2)[:kept], 6)


def test_the_state_does_not_depend_on_the_order_skips_are_booked_in(kept):
    records = many() + many(epoch=1)
    in_order = booked(SkipLedger(ErrorPolicy("skip", 100), 1000), records)
    shuffled = list(records)
    random.Random(0).shuffle(shuffled)
    out_of_order = booked(SkipLedger(ErrorPolicy("skip", 100), 1000), shuffled)
    for position in (Position(0, 1), Position(0, 12), Position(1, 0), Position(1, 20)):
        assert out_of_order.state(position) == in_order.state(position)
    state = in_order.state(Position(0, 12))
    assert state["skipped"] == [list(r) for r in records[:kept]]
    assert state["skipped_count"] == 36
    folded = booked(SkipLedger(ErrorPolicy("skip", 100), 1000), records, fold_each_step=True)
    assert folded.state(Position(1, 20)) == in_order.state(Position(1, 20))


def test_a_restored_ledger_gives_the_uninterrupted_ones_state_and_budget(kept):
    records = many()
    whole = booked(SkipLedger(ErrorPolicy("skip", 61), 1000), records[:24], fold_each_step=True)
    state = json.loads(json.dumps(whole.state(Position(0, 8))))
    restored = SkipLedger(ErrorPolicy("skip", 61), 1000)
    restored.restore({"epoch": 0, **state})
    assert restored.before(Position(0, 8)) == whole.before(Position(0, 8))
    booked(whole, records[24:], fold_each_step=True)  # the uninterrupted feeder goes on
    booked(restored, records[24:])
    for position in (Position(0, 19), Position(1, 0)):
        assert restored.state(position) == whole.state(position)
        assert restored.before(position) == whole.before(position)
    restored.record(skip(1000, 0, 19), ValueError())  # the 61st: within the budget
    with pytest.raises(ValueError) as raised:
        restored.record(skip(1001, 0, 19), ValueError())
    assert "would skip 62 samples of epoch 0" in raised.value.__notes__[0]


def test_skips_counted_past_the_records_are_forgotten_with_their_batches(kept):
    records = many()
    ledger = booked(SkipLedger(ErrorPolicy("skip", 100), 1000), records)
    ledger.fold_before(Position(0, 5))
    ledger.forget_from(Position(0, 9))  # a pipeline restarts at step 9: its batches are remade
    assert ledger.before(Position(1, 0)) == (records[:kept], 27 - kept)
    booked(ledger, [r for r in records if r.step >= 9])  # made again, skipped again
    fresh = booked(SkipLedger(ErrorPolicy("skip", 100), 1000), records)
    assert ledger.state(Position(1, 0)) == fresh.state(Position(1, 0))
    fresh.forget_from(Position(0, 0))  # the kept records go too, and what was counted past them
    assert fresh.before(Position(1, 0)) == ([], 0)


def test_a_ledger_holds_the_records_kept_and_no_count_per_step_before_its_floor(kept):
    ledger = booked(SkipLedger(ErrorPolicy("skip", 1.0), 100_000), many(steps=range(500)), True)
    epoch = ledger._epochs[0]
    assert (len(epoch.first), len(epoch.steps), epoch.count) == (kept, 1, 1500 - 3 - kept)


def test_a_state_of_records_alone_from_an_older_release_restores():
    old = {"epoch": 1, "step": 3, "skipped": [list(skip(12, 1, 1)), list(skip(5, 1, 2))]}
    ledger = SkipLedger(ErrorPolicy("skip", 5), 100)
    ledger.restore(old)
    fresh = booked(SkipLedger(ErrorPolicy("skip", 5), 100), [skip(12, 1, 1), skip(5, 1, 2)])
    assert ledger.state(Position(1, 3)) == fresh.state(Position(1, 3))
    assert ledger.before(Position(1, 3)) == ([skip(12, 1, 1), skip(5, 1, 2)], 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"skipped_digest": "0" * 16}, "is not that of its 1 skipped records"),
        ({"skipped_digest": 7}, "must be 16 hex digits"),
        ({"skipped_count": 0}, r"state\['skipped_count'\]"),
    ],
)
def test_a_state_whose_skips_do_not_add_up_is_refused(change, message):
    ledger = booked(SkipLedger(ErrorPolicy("skip", 5), 100), [skip(12, 1, 1)])
    state = {"epoch": 1, **ledger.state(Position(1, 3)), **change}
    with pytest.raises(ValueError, match=message):
        SkipLedger(ErrorPolicy("skip", 5), 100).restore(state)


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
