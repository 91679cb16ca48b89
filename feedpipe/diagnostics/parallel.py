"""Parallel production, sized by what a sample costs (`feedpipe.core.cost`): more DALI threads,
more of the feeder's workers (threads or processes), Ray's worker cores where the sample's CPU
at the step's rate needs more cores than this host has free, tf.data service workers or more
machines where no setting here reaches the step, or a feeder's workers for an input that is not
a feeder; and `Found`, the form every remedy of `feedpipe.diagnostics.remedies` takes before
ranking."""

from __future__ import annotations

import dataclasses
import math

from feedpipe.core.cost import THREAD_COUNTS, WAITING_SHARE, SampleCost, Setting
from feedpipe.core.description import FeederDescription
from feedpipe.core.services import is_ray
from feedpipe.diagnostics.verdict import Diagnosis

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


def parallel_remedies(
    diagnosis: Diagnosis, described: FeederDescription | None, cores: int, why: str
) -> list[Found]:
    """More of what makes the samples, sized by what a sample costs: DALI threads, the
    feeder's workers (threads or processes), Ray's or tf.data service's workers, or a
    feeder's workers for an input that has none.

    Of what needs other machines, Ray comes first: it runs the per-sample work as it is, any
    Python on any framework, where the service runs TensorFlow ops only; what the step's rate
    would take, where nothing offers it, comes last. They reach the same rate, so this order
    is their rank (`rank_remedies` keeps the order of equals)."""
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
        if is_ray(described.service):
            return [_more_ray_cores(diagnosis, why)]
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
    if described.source.indexed and _cpu_cores(cost, consumer * samples) > cost.free_cores:
        found.append(_ray_remedy(diagnosis, described, cost, why))
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
    crossing = _crossing(diagnosis)
    if cost is None:
        scale = _scale(diagnosis)
        return Found(
            f"more tf.data service workers: {scale:.1f}x the worker cores now (feedpipe "
            f"service worker --dispatcher {described.service.removeprefix('grpc://')})",
            f"{why}; the service's workers make {producer * samples:,.1f} samples/s; if they, "
            f"not the network, are the limit and the work scales with cores, {scale:.1f}x "
            f"their cores reach the step; {crossing}",
            consumer,
            tier=ELSEWHERE,
        )
    needed = math.ceil(round(_cpu_cores(cost, consumer * samples), 9))
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


def _ray_remedy(
    diagnosis: Diagnosis, described: FeederDescription, cost: SampleCost, why: str
) -> Found:
    """Ray past this host, where the sample's CPU at the step's rate needs more cores than this
    host has free: the source and `transform` run as they are, any Python on any framework,
    in Ray tasks on other machines. Sized by the sample's own time, waits included: a task
    holds its worker core while it reads its samples one after another."""
    consumer = diagnosis.consumer_steps_per_s
    samples_per_s = consumer * described.host_batch_size
    own_s = cost.wall_s - cost.queued_s
    needed = math.ceil(round(samples_per_s * own_s, 9))
    # Ray's tasks are the workers: a feeder with workers of its own is refused on Ray.
    workers = ", workers=0" if described.workers or described.workers_chosen else ""
    return Found(
        f"Ray past this host, with {_cores(needed)} in all: fp.Feeder(source, ..., "
        f'service="ray"{workers}) on a Ray cluster with feedpipe installed on every node, '
        "joined first by ray.init(address=...)",
        f"{why}; the step's {samples_per_s:,.1f} samples/s of {cost.cpu_s * 1e3:,.2f} ms of "
        f"one core each need {_cpu_cores(cost, samples_per_s):,.1f} cores, and "
        f"{cost.free_cores:.1f} are free here. Ray runs the per-sample work as it is, any "
        f"Python on any framework; each task reads its samples one after another, "
        f"{own_s * 1e3:,.2f} ms each, so the step's rate needs about {_cores(needed)}; "
        f"{_crossing(diagnosis)}",
        consumer,
        tier=ELSEWHERE,
    )


def _more_ray_cores(diagnosis: Diagnosis, why: str) -> Found:
    """For a feeder already on Ray: its cluster's worker cores scaled by the step's rate over
    the producer's."""
    scale = _scale(diagnosis)
    return Found(
        f"more Ray worker cores: {scale:.1f}x the cluster's worker cores now",
        f"{why}; if the cluster's workers, not the network, are the limit and the work scales "
        f"with cores, {scale:.1f}x their cores reach the step; {_crossing(diagnosis)}",
        diagnosis.consumer_steps_per_s,
        tier=ELSEWHERE,
    )


def _cpu_cores(cost: SampleCost, samples_per_s: float) -> float:
    """The cores' worth of CPU that `samples_per_s` samples of `cost` take."""
    return samples_per_s * cost.cpu_s


def _scale(diagnosis: Diagnosis) -> float:
    """The step's rate over the producer's, rounded up to a tenth: how many times its present
    workers a producer on other machines needs."""
    return math.ceil(diagnosis.consumer_steps_per_s / diagnosis.producer_steps_per_s * 10) / 10


def _crossing(diagnosis: Diagnosis) -> str:
    """What the step's rate sends over the network, each sample once."""
    network = diagnosis.batch_bytes * diagnosis.consumer_steps_per_s
    return (
        f"each sample then crosses the network once: {network / 2**20:,.1f} MiB/s "
        f"({network * 8e-9:,.2f} Gbit/s)"
    )


def _cores(count: int) -> str:
    return f"{count} worker core" + ("" if count == 1 else "s")


def _more_machines(
    diagnosis: Diagnosis, described: FeederDescription, cost: SampleCost, why: str
) -> Found:
    """Where no setting here reaches the step and TensorFlow is not the framework: what the
    step's rate would take, and what offers it."""
    consumer = diagnosis.consumer_steps_per_s
    needed = math.ceil(round(_cpu_cores(cost, consumer * described.host_batch_size), 9))
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
