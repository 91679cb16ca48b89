"""How large is a single host's state, and its ledger of skips, when `errors="skip"` spends the
whole default budget (1 % of the epoch) at N = 1e6, 1e8 and 1e9 samples?

Each skip used to be a record in the state (~130 bytes), so 1e7 skips at 1e9 samples made a
state of about 1.3 GB. An epoch now keeps its first `RECORDS_KEPT` skips in full and counts the
rest with a digest (`feedpipe.core.skips`). `skip_state_bytes` fills a `SkipLedger` without a
feeder: one skip every N / budget samples, global batch B = 4096, folded at each step, as often
as a consumer can settle (a feeder folds when its consumer settles, at a loop's or an epoch's
end, so within an epoch its ledger also holds a count per step with skips past the records
kept). It books up to `BOOKED_MAX` skips one by one, under `tracemalloc`, past
which the ledger holds no more than it does at `BOOKED_MAX`; the count and digest of the rest
of the budget are computed at once (numpy) and restored into a fresh ledger, whose state at the
epoch's end is measured: the real state of the whole count. `old_state_bytes` is the former
format's size, a record per skip, from the measured size of a record.

Target: the state at most 1 MB (1e6 bytes) at every N. Sizes do not depend on the machine;
the repetitions only vary the memory peaks.

Run: `python -m kernels_bench.skip_state [--quick]`; writes
`kernels_bench/results/skip_state.json`.
"""

from __future__ import annotations

import json

import numpy as np

from feedpipe.core.skips import (
    RECORDS_KEPT,
    ErrorPolicy,
    SkipLedger,
    SkippedSample,
    describe,
    skip_digest,
)
from feedpipe.core.state import Position
from kernels_bench import harness

LENGTHS = (10**6, 10**8, 10**9)
GLOBAL_BATCH = 4096
BOOKED_MAX = 100_000
"""Skips booked one by one; the rest of a budget is counted at once (the ledger's size stops
growing at `RECORDS_KEPT` records and one count per step since its floor)."""
CHUNK = 1_000_000
"""Skips digested per numpy call."""


def _error(index: int) -> ValueError:
    """The error of a typical corrupt sample."""
    return ValueError(f"cannot decode /data/train/shard-{index % 1024:05d}/{index:010d}.jpg")


def skip_state_bytes(
    length: int, budget_fraction: float = 0.01, global_batch: int = GLOBAL_BATCH
) -> dict:
    """The state's JSON bytes and the ledger's memory, for an epoch of `length` samples whose
    skips spend the whole budget of `max_skipped=budget_fraction`.

    Returns the budget, the skips booked one by one, the state's bytes and records, the peak
    memory of booking them and of restoring the whole count, and the former format's bytes
    per record and state.
    """
    policy = ErrorPolicy("skip", budget_fraction)
    budget = policy.budget(length)
    stride = length // budget
    booked = min(budget, BOOKED_MAX)
    ledger = SkipLedger(policy, length)
    with harness.traced() as booking:
        for k in range(booked):
            index = k * stride
            error = _error(index)
            kind, message = describe(error)
            step = index // global_batch
            ledger.record(SkippedSample(0, index, step, kind, message), error)
            ledger.fold_before(Position(0, step))  # a consumer settled at the batch under way
    end = Position(0, -(-length // global_batch))
    state = ledger.state(end)
    records = state["skipped"]
    digest = int(state["skipped_digest"], 16)
    for first in range(booked, budget, CHUNK):
        indices = np.arange(first, min(first + CHUNK, budget), dtype=np.uint64) * np.uint64(stride)
        steps = indices // np.uint64(global_batch)
        digest += int(skip_digest(0, steps, indices).sum(dtype=np.uint64))
    whole = {"epoch": 0, **state, "skipped_count": budget}
    whole["skipped_digest"] = f"{digest % 2**64:016x}"
    restored = SkipLedger(policy, length)
    with harness.traced() as restoring:
        restored.restore(whole)
    measured = restored.state(end)
    if measured != {key: whole[key] for key in measured}:
        raise RuntimeError(f"the restored ledger's state differs from the one restored at {end}")
    per_record = len(json.dumps(records)) / len(records)
    return {
        "length": length,
        "budget": budget,
        "booked": booked,
        "state_bytes": len(json.dumps(measured)),
        "state_records": len(records),
        "records_kept": RECORDS_KEPT,
        "booking_peak_bytes": booking["peak_bytes"],
        "restore_peak_bytes": restoring["peak_bytes"],
        "old_bytes_per_record": per_record,
        "old_state_bytes": per_record * budget,
    }


def main(argv=None) -> None:
    settings = harness.parse_settings(__doc__, None, argv)
    report = harness.Report(
        "skip_state",
        'a single host\'s state and skip ledger when errors="skip" spends the whole default '
        "budget (1 % of an epoch) at N = 1e6, 1e8, 1e9",
        settings,
        "kernels_bench.skip_state",
    )
    for length in LENGTHS:
        case = f"N={length:.0e}"
        reps = [skip_state_bytes(length) for _ in range(settings.reps)]
        report.add_case(
            case,
            {"length": length, "budget_fraction": 0.01, "global_batch": GLOBAL_BATCH},
            reps,
            units={
                "state_bytes": "B",
                "booking_peak_bytes": "B",
                "restore_peak_bytes": "B",
                "old_bytes_per_record": "B",
                "old_state_bytes": "B",
            },
        )
        report.target(case, "state_bytes", "<=", 1e6, f"state bytes at {case}, default budget")
    report.finish()


if __name__ == "__main__":
    main()
