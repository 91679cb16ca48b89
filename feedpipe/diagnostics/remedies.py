"""Remedies: what would feed the step better, ranked by the rate each could reach.

Each remedy is an estimate from the three measurements of a `Diagnosis` and from what the input
is: for a Feeder, what `Feeder.describe()` says (its source, workers, depth, devices, the
service it reads) and the producer's own rate in `Feeder.stats()`; nothing else of the
feeder is read. The machine's figures (cores, a memcpy's time, memory) come from the caller, so
that a test can set them.
"""

from __future__ import annotations

import math
from typing import Any

from feedpipe.core.description import FeederDescription
from feedpipe.core.stats import verdict
from feedpipe.diagnostics._headspace import CANNOT_TELL
from feedpipe.diagnostics.parallel import (
    ELSEWHERE,
    GAIN_MARGIN,
    IF_STATIC,
    Found,
    parallel_remedies,
)
from feedpipe.diagnostics.verdict import Diagnosis, Remedy, rate
from feedpipe.feeder import Feeder

OVERLAP_SLACK = 0.95
"""Together within 5 % of the slower side alone counts as fully overlapped."""
HANDOFF_MARGIN = 2.0
"""The feeder's own producer at least this many times faster than the batches reaching the
step: the hand-off from `as_dataset()` into TensorFlow, not the feeder, limits the input."""
DIRECT_MARGIN = 1.1
"""Keras's own array input must beat the feeder by this much, side by side, to be suggested:
a smaller edge is within what a busy machine moves between two steps."""


def rank_remedies(
    diagnosis: Diagnosis,
    source: Any,
    *,
    cores: int,
    memcpy_s: float,
    memory_bytes: int,
    image_like: bool = False,
) -> tuple[Remedy, ...]:
    """Remedies for what `diagnosis` measured, best first, each with the rate it could reach.

    Estimates, from the three rates: staging deeper or ahead can reach the slower side alone;
    parallel production is sized by what a sample costs (`feedpipe.core.cost`): threads for
    time spent waiting, processes for Python that holds the GIL, cores only for CPU time;
    Ray, where the sample's CPU at the step's rate needs more cores than this host has free,
    reaches the step's rate with as many worker cores as the sample's own time needs (a task
    holds its core while it waits); tf.data service, where every setting here falls short,
    with as many worker cores as the sample's CPU time needs;
    caching removes the producer's per-sample work (one gather per batch remains); fewer host
    copies save the copies a Python pipeline makes beyond the one into a slot. Caching, which
    holds only where the samples are the same every epoch, ranks below every change that
    holds anyway, and a change that needs more than this machine below both. Equals keep the
    order they were found in: of what needs other machines, Ray (any Python, on any
    framework) before the service (TensorFlow ops only).
    """
    judged = _judged_remedy(diagnosis)
    if judged is not None:
        return (judged,)
    achieved = diagnosis.together_steps_per_s
    feeder = source if isinstance(source, Feeder) else None
    described = None if feeder is None else feeder.describe()
    handoff = _handoff_bound(diagnosis, feeder)
    found = [
        *_overlap_remedies(diagnosis, described),
        *_keras_arrays_remedies(diagnosis, described),
        *(
            _production_remedies(diagnosis, described, cores, memcpy_s, memory_bytes, image_like)
            if handoff is None
            else [_handoff_remedy(diagnosis, handoff)]
        ),
    ]
    found = [item for item in found if item.expected > achieved * GAIN_MARGIN] or _none_found(
        diagnosis
    )
    found.sort(key=lambda item: (item.tier, -item.expected))
    return tuple(
        Remedy(
            item.action,
            item.why,
            item.expected,
            item.expected / achieved if achieved > 0 else math.inf,
            item.options,
            elsewhere=item.tier == ELSEWHERE,
        )
        for item in found
    )


def _judged_remedy(diagnosis: Diagnosis) -> Remedy | None:
    """The one remedy where the verdict settles it: "cannot tell" (measure again) or "not
    input-bound" (the step is the bottleneck); None where the input is to blame."""
    achieved = diagnosis.together_steps_per_s
    if diagnosis.verdict == CANNOT_TELL:
        low, high = diagnosis.input_bound_range
        low_s, high_s = diagnosis.step_alone_range_s or (0.0, 0.0)
        return Remedy(
            "none until the verdict is clear: measure again on a quieter machine, or with "
            "more --steps",
            f"the step alone took {low_s * 1e3:.2f} to {high_s * 1e3:.2f} ms before and "
            "after together (other load on this machine changed its speed), so the step "
            f"waited between {low:.1%} and {high:.1%} of the time: {verdict(low)} to "
            f"{verdict(high)}, and a remedy picked now could be the wrong one",
            achieved,
            1.0,
        )
    if diagnosis.verdict == "not input-bound" and not _slowed_by_the_input(diagnosis):
        consumer = diagnosis.consumer_steps_per_s
        return Remedy(
            "none for the input: the step is the bottleneck",
            f"the step waits {diagnosis.input_bound_fraction:.1%} of the time; make the "
            "step itself faster (mixed precision, jit_compile, a larger per-replica batch)",
            consumer,
            consumer / achieved if achieved > 0 else 1.0,
        )
    return None


def _slowed_by_the_input(diagnosis: Diagnosis) -> bool:
    """Whether the step, though it hardly waits for its batches, runs slower beside the input
    than alone, at about the input's own rate: the input's Python holds the GIL (or its work
    the cores) that the step's own Python needs, so the input is what to make faster."""
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    together = diagnosis.together_steps_per_s
    return producer < OVERLAP_SLACK * consumer and together < OVERLAP_SLACK * consumer


def _staged(diagnosis: Diagnosis) -> list[int]:
    """The batches staged when each step asked, where the input is a Feeder."""
    return [s.staged for s in diagnosis.together if s.staged is not None]


def _overlap_bound(diagnosis: Diagnosis) -> float:
    """The rate of the slower side alone: what full overlap would reach."""
    return min(diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s)


def _overlaps(diagnosis: Diagnosis) -> bool:
    return diagnosis.together_steps_per_s >= OVERLAP_SLACK * _overlap_bound(diagnosis)


def _overlap_remedies(diagnosis: Diagnosis, described: FeederDescription | None) -> list[Found]:
    """Staging ahead, where production and the step do not overlap."""
    if _overlaps(diagnosis):
        return []
    bound = _overlap_bound(diagnosis)
    why = (
        f"together reaches {diagnosis.overlap_efficiency:.2f} of the slower side alone "
        f"({bound:,.1f} steps/s): production and the step do not fully overlap"
    )
    if described is None:
        return [Found("stage batches ahead on the devices: fp.Feeder(...)", why, bound)]
    staged = _staged(diagnosis)
    fast_enough = diagnosis.producer_steps_per_s >= diagnosis.consumer_steps_per_s
    if fast_enough and staged and min(staged) == 0:
        # Fast enough on average, yet the ring ran dry: more of it rides out the jitter.
        depth = described.depth
        empty = sum(count == 0 for count in staged) / len(staged)
        return [
            Found(
                f"deeper staging: depth={2 * depth} (now {depth})",
                why + f"; the step found no batch staged at {empty:.0%} of its steps",
                bound,
                {"depth": 2 * depth},
            )
        ]
    return []


def _keras_arrays_remedies(
    diagnosis: Diagnosis, described: FeederDescription | None
) -> list[Found]:
    """Keras's own array input, where it was measured faster than the feeder side by side."""
    if not diagnosis.keras_arrays_step_s or described is None:
        return []
    direct = rate(diagnosis.keras_arrays_step_s)
    beside = rate(diagnosis.feeder_beside_step_s)
    if direct <= DIRECT_MARGIN * beside:
        return []
    return [
        Found(
            f"model.fit(x, y, batch_size={described.global_batch_size}) on the arrays "
            "directly, without fp.Feeder (if they need no per-sample `transform`)",
            f"measured here, step by step in turn: Keras's own array input ran "
            f"{direct:,.1f} steps/s, the feeder {beside:,.1f}; for these arrays in memory "
            "on a CPU, feedpipe does not help",
            diagnosis.together_steps_per_s * direct / beside,
        )
    ]


def _handoff_bound(diagnosis: Diagnosis, feeder: Feeder | None) -> str | None:
    """Where a TensorFlow Feeder feeds a Keras model and its own producer is far faster than
    the batches that reach the step: the measurement that says the hand-off limits the input
    (its remedy, `fp.train`, is TensorFlow's; JAX and PyTorch take the staged batches as they
    are, with no `as_dataset()` between)."""
    producer = diagnosis.producer_steps_per_s
    if feeder is None or feeder.layer.name != "tensorflow" or not diagnosis.waits_derived:
        return None
    if producer >= diagnosis.consumer_steps_per_s:
        return None
    own = feeder.stats().producer_samples_per_s / feeder.options.global_batch_size
    if own < HANDOFF_MARGIN * producer:
        return None
    return (
        f"the feeder's own producer makes {own:,.0f} batches/s, yet {producer:,.1f}/s reach "
        f"the step, which could take {diagnosis.consumer_steps_per_s:,.1f}/s: handing each "
        "batch from as_dataset() into TensorFlow (Python and a copy per batch) is the "
        "bottleneck, not the feeder"
    )


def _handoff_remedy(diagnosis: Diagnosis, why: str) -> Found:
    return Found(
        "fp.train(model, feeder, ...) instead of model.fit(feeder.as_dataset()): the "
        "feeder's own loop takes batches already on the devices, with no hand-off",
        why,
        diagnosis.consumer_steps_per_s,
    )


def _production_remedies(
    diagnosis: Diagnosis,
    described: FeederDescription | None,
    cores: int,
    memcpy_s: float,
    memory_bytes: int,
    image_like: bool,
) -> list[Found]:
    """Faster production, where the input alone is slower than the step: in parallel, on
    the service, cached, with fewer copies, or decoded by DALI."""
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    if producer >= consumer:
        return []
    why = f"the input alone makes {producer:,.1f} batches/s, the step could take {consumer:,.1f}/s"
    own_threads = None if described is None else described.source.threads
    found = parallel_remedies(diagnosis, described, cores, why)
    epoch_bytes = (
        None
        if described is None or described.steps_per_epoch is None
        else described.steps_per_epoch * diagnosis.batch_bytes
    )
    if epoch_bytes is None or epoch_bytes <= memory_bytes / 2:
        size = "" if epoch_bytes is None else f" ({epoch_bytes / 2**20:,.0f} MiB an epoch)"
        gather_s = 2 * memcpy_s
        found.append(
            Found(
                "cache the decoded samples in memory (numpy arrays as the source)",
                why + f"; if the samples are the same every epoch{size}, only a gather per "
                "batch remains from the second epoch on",
                min(consumer, 1 / gather_s if gather_s > 0 else consumer),
                tier=IF_STATIC,
            )
        )
    extra_copies_s = 2 * memcpy_s
    if described is None and 1 / producer > extra_copies_s:
        found.append(
            Found(
                "fewer host copies: fp.Feeder writes each sample once, into its replica's slot",
                why + f"; a batch's memcpy costs {memcpy_s * 1e3:.2f} ms here, and a Python "
                "pipeline usually copies it about three times",
                min(consumer, 1 / (1 / producer - extra_copies_s)),
            )
        )
    if image_like and own_threads is None:
        found.append(
            Found(
                "decode and augment the images with DALI (feedpipe.dali; pip install "
                "feedpipe[dali]), on the GPU where there is one",
                why + "; the batches hold uint8 images",
                min(consumer, producer * cores),
            )
        )
    return found


def _none_found(diagnosis: Diagnosis) -> list[Found]:
    """What to say where no remedy is predicted to beat the rate reached."""
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    achieved = diagnosis.together_steps_per_s
    if not _overlaps(diagnosis):
        staged = _staged(diagnosis)
        ready = (
            ", and the feeder always had a batch staged when the step asked"
            if staged and min(staged) > 0
            else ""
        )
        return [
            Found(
                "none predicted to help: the input and the step slow each other down",
                f"each alone is faster than together ({producer:,.1f} and {consumer:,.1f} "
                f"against {achieved:,.1f} steps/s){ready}: run at once, they share the CPU's "
                "cores and Python's GIL; on a GPU the step would leave those to the input",
                achieved,
            )
        ]
    # Input-bound, yet no remedy is predicted to beat the rate reached.
    return [
        Found(
            "none predicted to help: measure again with more --steps",
            f"the step waits {diagnosis.input_bound_fraction:.1%} of the time, yet together "
            f"reaches {diagnosis.overlap_efficiency:.2f} of the slower side alone and no "
            "change above would be more than 2 % faster; short measurements put start-up "
            "waits in that figure",
            achieved,
        )
    ]
