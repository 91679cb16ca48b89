"""Remedies: what would feed the step better, ranked by the rate each could reach.

Each remedy is an estimate from the three measurements of a `Diagnosis` and from what the input
is: for a Feeder, what `Feeder.describe()` says (its source, workers, depth, devices, the
tf.data service it reads) and the producer's own rate in `Feeder.stats()`; nothing else of the
feeder is read. The machine's figures (cores, a memcpy's time, memory) come from the caller, so
that a test can set them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from feedpipe.core.cost import THREAD_COUNTS, WAITING_SHARE, SampleCost, Setting
from feedpipe.core.description import FeederDescription
from feedpipe.core.stats import verdict
from feedpipe.diagnostics._headspace import CANNOT_TELL
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
GAIN_MARGIN = 1.02
"""A remedy is listed only where it could beat the rate reached together by 2 %."""

HEADROOM = 1.25
"""Workers are sized to make this many times the samples the step takes: the model leaves out
the feeder's own per-sample work (writing rows, handing over), which a real run pays."""


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """A remedy before ranking."""

    action: str
    why: str
    expected: float
    """Steps/s it could reach."""
    options: dict | None = None
    tier: int = 0
    """How it ranks before its rate: 0 works here as it is, 1 holds only where the samples
    are the same every epoch (caching), 2 needs more than this machine (`ELSEWHERE`)."""


IF_STATIC, ELSEWHERE = 1, 2


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
    tf.data service, where every setting here falls short, reaches the step's rate with as
    many worker cores as the sample's CPU time needs;
    caching removes the producer's per-sample work (one gather per batch remains); fewer host
    copies save the copies a Python pipeline makes beyond the one into a slot. Caching, which
    holds only where the samples are the same every epoch, ranks below every change that
    holds anyway, and a change that needs more than this machine below both.
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
    found = _parallel_remedies(diagnosis, described, cores, why)
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


def _parallel_remedies(
    diagnosis: Diagnosis, described: FeederDescription | None, cores: int, why: str
) -> list[Found]:
    """More of what makes the samples, sized by what a sample costs: DALI threads, the
    feeder's workers (threads or processes), tf.data service workers, or a feeder's workers
    for an input that has none."""
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    if described is None:
        return _feeder_remedies(diagnosis, cores, why)
    own_threads = described.source.threads
    if own_threads is not None:  # a DaliSource: DALI's threads do the work
        if own_threads >= cores:
            return []
        return [
            Found(
                f"more DALI threads: DaliSource(..., num_threads={cores}) (now {own_threads})",
                why + f"; {cores} cores can run the pipeline's operators in parallel",
                min(consumer, producer * cores / own_threads),
            )
        ]
    if described.service is not None:
        return [_service_remedy(diagnosis, described, None, why)]
    if described.source.kind == "tf.data":  # its own threads: num_parallel_calls
        return []
    cost = _with_feeder_cpu(
        diagnosis, described, diagnosis.sample_cost or _cost_from_rates(diagnosis, described, cores)
    )
    mode, workers = described.worker_mode, described.workers
    now = Setting(mode, workers, cost.rate(mode, workers))
    samples = described.host_batch_size
    found = []
    for setting in cost.settings(target=HEADROOM * consumer * samples):
        if setting.rate <= GAIN_MARGIN * now.rate:  # no faster than the setting now
            continue
        # The model's own rate, and the measured producer scaled by the model: the lower.
        per_step = setting.rate / samples
        expected = min(consumer, per_step, producer * setting.rate / now.rate)
        found.append(
            Found(
                f"more workers: {setting} (now {now})",
                f"{why}; {cost.describe()}, so {_sized(setting, cost)}",
                expected,
                setting.options,
            )
        )
    best = max((item.expected for item in found), default=producer)
    if best < consumer and described.framework == "tensorflow":
        found.append(_service_remedy(diagnosis, described, cost, why))
    elif best < consumer:
        found.append(_more_machines(diagnosis, described, cost, why))
    return found


def _sized(setting: Setting, cost: SampleCost) -> str:
    """Why `setting` is the one of its mode: what limits it."""
    kind = "threads" if setting.mode == "thread" else "processes"
    rate = cost.rate(setting.mode, setting.workers)  # not capped at the step's rate
    return f"{setting.workers} {kind} are predicted to make {rate:,.0f} samples/s" + (
        f" (threads share one GIL, held up to {cost.gil_s * 1e3:,.3f} ms a sample)"
        if setting.mode == "thread"
        else f" ({cost.free_cores:.1f} cores free for {cost.cpu_s * 1e3:,.3f} ms of CPU a sample)"
    )


def _with_feeder_cpu(
    diagnosis: Diagnosis, described: FeederDescription, cost: SampleCost
) -> SampleCost:
    """`cost` with the feeder's own CPU per sample: this process's CPU while the input ran
    alone, per sample made, less the sample's own where this process made them (one thread,
    or worker threads)."""
    made = diagnosis.producer_steps_per_s * described.host_batch_size
    if diagnosis.producer_cpu_share is None or made <= 0:
        return cost
    per_sample = diagnosis.producer_cpu_share / made
    in_process = described.workers == 0 or described.worker_mode == "thread"
    own = per_sample - (cost.cpu_s if in_process else 0.0)
    return dataclasses.replace(cost, feeder_cpu_s=max(0.0, own))


def _cost_from_rates(diagnosis: Diagnosis, described: FeederDescription, cores: int) -> SampleCost:
    """A sample's cost where it was not probed (a stream, or no probe): each of the producer's
    workers made one sample per its share of the producer's time, all of it CPU holding the
    GIL unless threads were seen to outrun one core."""
    used = max(described.workers, 1)
    made = diagnosis.producer_steps_per_s * described.host_batch_size
    wall_s = used / made if made > 0 else math.inf
    threads = described.worker_mode == "thread" and described.workers > 1
    gil_s = wall_s / used if threads else wall_s
    workers = described.workers if threads else 0
    return SampleCost(
        wall_s=wall_s,
        cpu_s=wall_s,
        gil_s=gil_s,
        threads=workers,
        threads_rate=made,
        parallel_cpu=math.nan,
        samples=0,
        free_cores=float(cores),
    )


def _service_remedy(
    diagnosis: Diagnosis, described: FeederDescription, cost: SampleCost | None, why: str
) -> Found:
    """tf.data service, where the step outruns every setting of this machine: worker cores
    sized by the sample's CPU time (its waiting needs none), or, for a feeder already on the
    service, its worker cores scaled by the step's rate over the producer's. Each sample then
    crosses the network once, at the step's rate.
    """
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    samples = described.host_batch_size
    network = diagnosis.batch_bytes * consumer
    crossing = (
        f"each sample then crosses the network once: {network / 2**20:,.1f} MiB/s "
        f"({network * 8e-9:,.2f} Gbit/s)"
    )
    if cost is None:
        scale = math.ceil(consumer / producer * 10) / 10
        return Found(
            f"more tf.data service workers: {scale:.1f}x the worker cores now (feedpipe "
            f"service worker --dispatcher {described.service.removeprefix('grpc://')})",
            f"{why}; the service's workers make {producer * samples:,.1f} samples/s; if they, "
            f"not the network, are the limit and the work scales with cores, {scale:.1f}x "
            f"their cores reach the step; {crossing}",
            consumer,
            tier=ELSEWHERE,
        )
    needed = math.ceil(round(consumer * samples * cost.cpu_s, 9))
    if described.source.kind == "arrays":
        what, costs = "offload the per-sample work", ""
    else:
        what = (
            "write the per-sample work as a TensorFlow-ops `transform` over arrays (such as "
            "file paths) and offload it"
        )
        costs = " and costs no more in TensorFlow ops"
    return Found(
        f"{what} to tf.data service: fp.Feeder(arrays, ..., transform=<TensorFlow ops>, "
        f'service="grpc://host:port") with {_cores(needed)} in all (feedpipe service '
        "worker --dispatcher host:port)",
        f"{why}; no setting here reaches the step: {cost.cpu_s * 1e3:,.2f} ms of one core a "
        f"sample on {cost.free_cores:.1f} free cores; if the work scales with cores{costs}, "
        f"{consumer:,.1f} steps/s of {samples} samples need {_cores(needed)}; {crossing}",
        consumer,
        tier=ELSEWHERE,
    )


def _cores(count: int) -> str:
    return f"{count} worker core" + ("" if count == 1 else "s")


def _more_machines(
    diagnosis: Diagnosis, described: FeederDescription, cost: SampleCost, why: str
) -> Found:
    """Where no setting here reaches the step and TensorFlow is not the framework: what the
    step's rate would take, and what offers it."""
    consumer = diagnosis.consumer_steps_per_s
    needed = math.ceil(round(consumer * described.host_batch_size * cost.cpu_s, 9))
    return Found(
        f"more CPU than this machine has: {needed} cores for the per-sample work",
        f"{why}; no setting here reaches the step: {cost.cpu_s * 1e3:,.2f} ms of one core a "
        f"sample on {cost.free_cores:.1f} free cores. tf.data service (feedpipe's `service=`) "
        f"runs it on other machines, but needs TensorFlow on the trainer too ({described.framework}"
        " feeds this step): install it beside, or make each sample cheaper (decode less, "
        "cache what repeats)",
        consumer,
        tier=ELSEWHERE,
    )


def _feeder_remedies(diagnosis: Diagnosis, cores: int, why: str) -> list[Found]:
    """For an input that is not a Feeder: its per-sample work in a feeder's workers, threads
    where the input waited (this process's CPU stayed low while it ran alone), processes
    else."""
    producer, consumer = diagnosis.producer_steps_per_s, diagnosis.consumer_steps_per_s
    share = diagnosis.producer_cpu_share
    if share is not None and share < 1 - WAITING_SHARE:
        counts = THREAD_COUNTS
        threads = next((n for n in counts if producer * n >= consumer), counts[-1])
        return [
            Found(
                f"move the per-sample work into a map-style source or `transform` and read "
                f'it in fp.Feeder(..., workers={threads}, worker_mode="thread")',
                why + f"; this process used {share:.2f} of a core while the input ran alone: "
                f"it waits rather than computes, and {threads} threads wait in parallel",
                min(consumer, producer * threads),
            )
        ]
    return [
        Found(
            f"move the per-sample work into a map-style source or `transform` and run it "
            f"in fp.Feeder(..., workers={cores})",
            why + f"; {cores} cores can run it in parallel, free of the GIL",
            min(consumer, producer * cores),
        )
    ]


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
