"""Plan: what a feeder's options make of its source, decided and checked before anything runs.

`plan_feeder` takes the source one way through: it adapts it and checks it against the options,
reads what a sample looks like (in a worker where there are workers, so that a source that
crashes or hangs on first use does so there), plans the epochs, picks who makes the batches (the
source's own threads, tf.data service, workers, one thread, or `workers="auto"`), and refuses
host slots the machine cannot map. Every refusal a feeder's construction raises is raised here.

Its answer comes in two parts, as SPDL separates a pipeline's config from the pipeline built
from it: a frozen `FeederPlan` of plain values (`to_json()`), which is what `feeder.describe()`
says, and the `PlanParts` planning made or started (the adapted source, the pool that read the
first sample), which are no data. `feedpipe.assembly.Assembly` is built from both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import optree

from feedpipe.core.agreement import check_hosts_agree
from feedpipe.core.auto import AutoProducer
from feedpipe.core.description import (
    FeederDescription,
    describe_fields,
    describe_slots,
    describe_source,
    is_cpu,
)
from feedpipe.core.gather import GatherPlan, plan_gather
from feedpipe.core.producers import ThreadProducer, WorkerProducer
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import Sampler
from feedpipe.core.services import is_ray
from feedpipe.core.skips import SkipLedger
from feedpipe.core.slots import SlotLayout, check_host_memory
from feedpipe.core.sources import (
    ArraySource,
    SampleSpec,
    Source,
    TFDatasetSource,
    as_source,
    field_name,
)
from feedpipe.core.stage import Layer
from feedpipe.core.state import Stream
from feedpipe.core.writer import SampleWriter, first_look
from feedpipe.options import AUTO, FeedOptions


@dataclasses.dataclass(frozen=True, slots=True)
class FieldPlan:
    """One field of a sample, as plain values."""

    name: str
    """The field as messages name it: `['image']`, `[0]`, or `sample` for a bare array."""
    shape: tuple[int, ...]
    """Its shape, the batch axis left out."""
    dtype: str
    """Its numpy dtype, by name."""


@dataclasses.dataclass(frozen=True, slots=True)
class FeederPlan:
    """What a feeder will run, decided and checked from its source, options and framework
    layer: plain values only, so that `to_json()` is JSON as it is and two plans compare."""

    options: FeedOptions
    """The options as planned: `workers="auto"` is 0 here, `producer` saying who picks."""
    description: FeederDescription
    """`feeder.describe()` as built; the running feeder puts on it only what changes as it
    runs (what `workers="auto"` picked, whether the slots were page-locked, the copy path)."""
    stream: Stream
    """What the feeder's order depends on: a state restores only where it agrees, and every
    host's feeder must agree on it (checked as the plan is made)."""
    producer: str
    """Who makes the batches: "dali" (DALI's own threads), "service" (tf.data service), "ray"
    (Ray tasks), "workers", "thread" (one background thread) or "auto" (it, while
    `workers="auto"` measures)."""
    producer_reason: str
    """Why that producer: the option that asked for it, or what ruled the others out."""
    rows_as_given: bool
    """Each batch is the source's rows as they are, made in this process: nothing runs per
    sample, so a framework may gather the rows itself (`Consumer.gathered_pass`)."""
    kept: str | None
    """Why the workers of this source are not the feeder's to choose (`workers="auto"` keeps
    one thread; `sample_cost()` is None); None where they are: indexed, with work per sample."""
    processes_refused: str
    """Why `workers="auto"` may not start processes ("" where it may, or does not pick)."""
    gather: GatherPlan | None
    """How many threads gather each batch of arrays without a transform, and why; None where
    batches are made otherwise."""
    slots_in_flight: int
    """Slots the producer fills at once (0: the source keeps its batches in memory of its own)."""
    shared: bool
    """Whether the slots are shared memory that worker processes write into (or may:
    `workers="auto"` may pick processes)."""
    axes: tuple[tuple[int, ...] | None, ...]
    """`transpose` as one axis order a field (None: as it is), applied as samples are written."""
    sample: tuple[FieldPlan, ...]
    """Each field as `transform` returns it, before `transpose`."""
    spec: tuple[FieldPlan, ...]
    """Each field as a host slot holds it: after `transform` and `transpose`."""
    staged_spec: tuple[FieldPlan, ...]
    """Each field as the step receives it: `spec`, or a dtype the framework narrows where no
    value changes (int64 ids that fit arrive as int32 on JAX without x64)."""

    def to_json(self) -> str:
        """The plan as JSON: every field, nested plans as objects and tuples as lists."""
        return json.dumps(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True, slots=True)
class PlanParts:
    """What planning made or started that is no plain data: the `feedpipe.assembly.Assembly`
    built from the plan runs them (and owns them from then on)."""

    source: Source
    """The source as feedpipe reads it (`feedpipe.core.sources`), measured."""
    rule: Remainder
    """The rule for an epoch's last, partial batch."""
    epochs: Sampler | None
    """The epoch's batches, where the length is known (it applies the remainder rules)."""
    skips: SkipLedger | None
    """Books the samples `errors="skip"` leaves out as batches are made; None: "raise"."""
    staged_spec: SampleSpec
    """Each field as the step receives it (see `FeederPlan.staged_spec`)."""
    worker_setup: dict | None
    """What every worker starts from (`feedpipe.core.workers`), where workers make the
    batches or `workers="auto"` may start them; else None."""
    own_producer: Any
    """The producer of a source that makes batches in threads of its own (DALI), else None."""
    work: Any
    """What tf.data service runs per sample (`feedpipe.service.client.ServiceWork`), or the
    work put on a Ray cluster (`feedpipe.ray.cluster.RayWork`); else None."""
    workers: Any
    """The pool started to read the first sample, which then makes the batches; else None."""
    measured: Any
    """What worker 0 measured of the source (`Source.measure`), for the others."""
    writer: SampleWriter
    """What each sample becomes in a slot: `transform` and the spec it returns (`spec`), the
    axes, and what a slot holds (`out_spec`); it makes the samples in the feeder's thread
    where no worker, service or DALI does."""

    def close(self) -> None:
        """Lets go of the pool planning started, for parts that will not be built."""
        if self.workers is not None:
            self.workers.close()
        if self.work is not None and hasattr(self.work, "close"):
            self.work.close()


def plan_feeder(
    source: Any,
    options: FeedOptions,
    layer: Layer,
    *,
    transform: Callable[..., Any] | None,
    transpose: Any,
) -> tuple[FeederPlan, PlanParts]:
    """The plan of a feeder of `source` with `options` on `layer`, and its parts.

    Raises every refusal of the feeder's construction, in this order: the source against the
    options and hosts; service; workers; the first sample (read in worker 0 where there are
    workers); the epochs; `transpose`; what the framework cannot stage; `errors="skip"` with
    service; gather threads; host memory; other hosts' feeders. What it started, it stops."""
    o, share, service = options, layer.share, options.service
    source = as_source(source, text=transform is not None, global_batch_size=o.global_batch_size)
    rule = Remainder(o.remainder, o.global_batch_size)
    own_producer = source.producer(share, layer.devices, rule)
    # What the options ask of this source, refused where it cannot serve them.
    kept = _nothing_to_choose(source, own_producer, service, transform, transpose)
    auto = o.workers == AUTO and kept is None
    chosen = None if o.workers != AUTO or auto else f"workers=0: {kept}"
    o = dataclasses.replace(o, workers=0) if o.workers == AUTO else o
    _refuse_mismatches(source, o, share.num_hosts, own_producer, transform, transpose)
    _refuse_service(service, o, transpose, source, transform)
    refused = _refuse_workers(source, o, transform, auto)
    producer, why = _producer(o, own_producer, service, auto, kept)
    setup = {
        "source": source,
        "transform": transform,
        "seed": o.seed,
        "num_shards": o.workers if source.shards_order else 1,
        "skips": o.error_policy.skips,
    }
    with contextlib.ExitStack() as on_failure:
        # The first sample: read in a worker where there are workers, with what the epochs'
        # plan needs (a PyDataset's length): a crash or a hang there is theirs.
        workers = measured = address = work = None
        if o.workers:
            from feedpipe.core.workers import start_pool

            workers = start_pool(o.worker_mode, o.workers, setup, o.timeout_s)
            on_failure.callback(workers.close)
            sample_spec, measured = workers.first_spec(o.error_policy)
            source.learn(measured)
        elif is_ray(service):
            from feedpipe.ray.cluster import RayWork, connect

            connect(service, o.timeout_s)
            address = service
            work = RayWork(source, transform, o.seed, o.error_policy.skips)
            on_failure.callback(work.close)
            sample_spec, measured = work.first_spec(o.error_policy, o.timeout_s)
            source.learn(measured)
        elif service is not None:
            from feedpipe.service.client import ServiceWork, check_address

            address = check_address(service)
            work = ServiceWork(source, transform, o.seed)
            sample_spec = SampleSpec.of(work.first_sample())
        else:
            sample_spec, _ = first_look(source, transform, o.seed, policy=o.error_policy)
        # The epochs, where the length is known (the sampler applies the remainder rules).
        epochs = None
        if source.length is not None:
            epochs = Sampler(
                source.length,
                o.global_batch_size,
                remainder=o.remainder,
                shuffle=o.shuffle,
                seed=o.seed,
                block_size=source.block_size,
                share=share.rows,
            )
        sampler = epochs if source.indexed else None
        # What a slot holds, and what the step receives.
        axes = transposition(transpose, sample_spec)
        writer = SampleWriter(
            source, sample_spec, transform, o.seed, axes, skips=o.error_policy.skips
        )
        spec = writer.out_spec
        as_given = isinstance(source, ArraySource) and transform is None
        staged_spec = layer.check_stageable(spec, source.arrays if as_given else None)
        if producer == "service" and o.error_policy.skips:
            raise ValueError(
                f'`errors`="skip" with `service`={service!r}: the transform runs on tf.data '
                'service workers, which cannot skip a sample in place; pass errors="raise", '
                "or workers=N without service."
            )
        # The slots: how many the producer fills at once (as each producer counts its
        # `slots_in_flight`), and whether the host can map them.
        layout = SlotLayout(spec, share.local_split)
        gather = None
        if producer in ("thread", "auto") and writer.vectorised and sampler is not None:
            gather = plan_gather(layout.batch_bytes)  # arrays gathered a field at a time
        if producer == "ray":
            from feedpipe.ray.producer import RayProducer

            work.set_plan(sample_spec, axes, measured, epochs)
            in_flight = RayProducer.slots_in_flight
        elif producer == "dali":
            in_flight = own_producer.slots_in_flight
        elif producer == "service":
            from feedpipe.service.producer import ServiceProducer

            in_flight = ServiceProducer.slots_in_flight
        elif producer == "workers":
            in_flight = WorkerProducer.in_flight(sampler is not None, o.workers)
        elif producer == "auto":
            in_flight = AutoProducer.slots_in_flight
        else:
            in_flight = ThreadProducer.in_flight(gather is not None and gather.threads >= 2)
        shared = (o.workers > 0 and o.worker_mode == "process") or (auto and not refused)
        slots = o.depth + 1 + in_flight if in_flight else 0
        check_host_memory(layout, slots, shared=shared, hosts=share.num_hosts)
        stream = Stream(
            dataset_length=source.length,
            global_batch_size=o.global_batch_size,
            num_replicas=share.num_replicas,
            num_shards=setup["num_shards"],
            seed=o.seed,
            shuffle=o.shuffle,
            steps_per_epoch=None if epochs is None else len(epochs),
            replicas_order=source.replicas_order,
        )
        if share.num_hosts > 1:
            # The source's block_size orders a shuffle too.
            order = {"remainder": o.remainder, "block_size": source.block_size}
            order.update(devices_per_host=share.local_replicas, **stream.order_fields())
            check_hosts_agree(layer.tally, share, order)
        on_failure.pop_all()  # the assembly owns what was started
    fields = {
        name: tuple(FieldPlan(leaf.name, leaf.shape, str(leaf.dtype)) for leaf in each.leaves)
        for name, each in (("sample", sample_spec), ("spec", spec), ("staged_spec", staged_spec))
    }
    accelerated = not all(is_cpu(device) for device in layer.devices)
    description = FeederDescription(
        framework=layer.name,
        source=describe_source(source, max(setup["num_shards"], 1)),
        fields=describe_fields(staged_spec),
        service=address if producer in ("service", "ray") else None,
        global_batch_size=o.global_batch_size,
        per_replica_batch_size=share.local_split.per_replica,
        host_batch_size=share.local_split.global_batch_size,
        batch_bytes=layout.batch_bytes,
        steps_per_epoch=stream.steps_per_epoch,
        devices=tuple(str(device) for device in layer.devices),
        accelerated=accelerated,
        hosts=share.num_hosts,
        host=share.host,
        workers=o.workers,
        worker_mode="thread" if auto else o.worker_mode,
        workers_chosen=why if auto else chosen,
        gather_threads=0 if gather is None else gather.threads,
        gather_chosen=None if gather is None else gather.reason,
        depth=o.depth,
        remainder=o.remainder,
        shuffle=o.shuffle,
        seed=o.seed,
        slots=describe_slots(
            slots, layout.nbytes, layer.name, accelerated, layer.page_lock, pool=None
        ),
        copy_path=layer.copy_path.name,
        copy_path_reason=layer.copy_path.reason,
    )
    plan = FeederPlan(
        options=o,
        description=description,
        stream=stream,
        rows_as_given=producer in ("thread", "auto") and transform is None and transpose is None,
        producer=producer,
        producer_reason=why,
        kept=kept,
        processes_refused=refused,
        axes=tuple(axes),
        gather=gather,
        slots_in_flight=in_flight,
        shared=shared,
        **fields,
    )
    parts = PlanParts(
        source=source,
        rule=rule,
        epochs=epochs,
        skips=SkipLedger(o.error_policy, source.length) if o.error_policy.skips else None,
        staged_spec=staged_spec,
        own_producer=own_producer,
        work=work,
        worker_setup=setup if o.workers or auto else None,
        workers=workers,
        measured=measured,
        writer=writer,
    )
    return plan, parts


def _nothing_to_choose(
    source: Source, own_producer: Any, service: str | None, transform: Any, transpose: Any
) -> str | None:
    """Why the workers of this source are not the feeder's to choose; None where they
    are: an indexed source with work per sample."""
    if own_producer is not None:
        return "a DaliSource makes its batches in DALI's own threads (num_threads)"
    if is_ray(service):
        return "the per-sample work runs in Ray tasks"
    if service is not None:
        return "the per-sample work runs on tf.data service workers"
    if not source.indexed:
        return (
            f"a {type(source).__name__}'s order depends on how many shards read it, so it "
            "is not changed behind the user's back: pass workers=N to read it in N shards"
        )
    if isinstance(source, ArraySource) and transform is None and transpose is None:
        return (
            "arrays without a transform are gathered with one vectorised copy a field, "
            "in the gather threads (describe().gather_threads), with no worker"
        )
    return None


def _refuse_mismatches(
    source: Source, o: FeedOptions, hosts: int, own_producer: Any, transform: Any, transpose: Any
) -> None:
    """Refuses options the source cannot serve, naming what to pass instead."""
    if hosts > 1 and not source.indexed and own_producer is None:
        raise ValueError(
            f"A {type(source).__name__} has no indices, but under a "
            f"MultiWorkerMirroredStrategy each of the {hosts} hosts makes "
            "only its replicas' rows of each global batch, chosen by index; pass an indexed "
            "source (arrays, a sequence with __len__ and __getitem__, a PyDataset)."
        )
    if own_producer is not None and (o.workers or transform is not None or transpose is not None):
        raise ValueError(
            "A DaliSource decodes and augments in DALI's own threads: pass workers=0, "
            "transform=None and transpose=None, and do that work in the DALI pipeline "
            "(its num_threads sets the parallelism)."
        )
    if o.error_policy.skips:
        _refuse_skips(source, hosts, own_producer)
    if o.shuffle and not source.indexed:
        raise ValueError(
            f"`shuffle`=True, but a {type(source).__name__} has no indices to shuffle; "
            "shuffle inside the generator, the tf.data.Dataset or the DALI reader "
            "(random_shuffle=True), and pass shuffle=False."
        )


def _refuse_skips(source: Source, hosts: int, own_producer: Any) -> None:
    """Refuses `errors="skip"` where a skipped sample could not stay a padding row of its
    batch without moving the others, naming why and what to do."""
    why = None
    if own_producer is not None:
        why = "a DaliSource makes its batches in DALI's own threads"
    elif not source.indexed:
        why = (
            f"a {type(source).__name__} is read in its own order, so a resumed stream "
            "cannot skip the same samples without reading them, and a generator that raised "
            "has ended"
        )
    elif hosts > 1:
        why = (
            f"each of the {hosts} hosts makes only its rows of a batch, and num_valid must "
            "be the same on every host"
        )
    if why is not None:
        raise ValueError(
            f'`errors`="skip" needs an indexed source on one host, but {why}; pass '
            'errors="raise", or an indexed source (arrays, a sequence with __len__ and '
            "__getitem__, a PyDataset) and drop the bad samples inside it."
        )


def _refuse_workers(source: Source, o: FeedOptions, transform: Any, auto: bool) -> str:
    """Refuses workers for a source or `transform` they cannot read; returns why
    `workers="auto"` may not start processes ("" where it may, or does not pick)."""
    if o.workers and isinstance(source, TFDatasetSource):
        raise ValueError(
            f"`workers`={o.workers}, but a tf.data.Dataset runs in TensorFlow's own threads "
            "and cannot be read by workers; use workers=0 (and num_parallel_calls in "
            "dataset.map for parallel work)."
        )
    processes = o.workers > 0 and o.worker_mode == "process"
    if not (processes or auto):
        return ""
    from feedpipe.core import workers as pool

    for name, value in (("source", source), ("transform", transform)):
        try:
            pool.check_picklable(name, value)
        except TypeError as error:
            if processes:
                raise
            cause = error.__cause__ or error
            return f"the {name} cannot be pickled ({type(cause).__name__}: {cause})"
    return ""


def _refuse_service(
    service: str | None, o: FeedOptions, transpose: Any, source: Source, transform: Any
) -> None:
    """Refuses what a service cannot run: the per-sample work is on its workers or tasks."""
    if is_ray(service):
        _refuse_ray(service, o, source, transform)
    elif service is not None and (o.workers or transpose is not None):
        raise ValueError(
            f"`service`={service!r} runs the per-sample work on tf.data service workers: "
            "pass workers=0, and transpose inside `transform` (tf.transpose)."
        )


RAY_FIX = (
    "Build it from picklable parts (open files, locks and connections inside the task, on "
    "first use), or run it on this host: drop `service`."
)
"""What to do about a source or `transform` that cannot reach Ray's tasks."""


def _refuse_ray(service: str, o: FeedOptions, source: Source, transform: Any) -> None:
    """Refuses what Ray tasks cannot run: they read samples by index, sent once to each node."""
    if o.workers:
        raise ValueError(
            f"`service`={service!r} runs the per-sample work in Ray tasks on the cluster's "
            f"CPUs, so `workers`={o.workers!r} has nothing to run; pass workers=0."
        )
    if not source.indexed:
        raise ValueError(
            f"`service`={service!r} reads samples by index in Ray tasks, but a "
            f"{type(source).__name__} has no indices; pass an indexed source (arrays, a "
            "sequence with __len__ and __getitem__, a PyDataset), or drop `service`."
        )
    from feedpipe.core.pickling import check_picklable

    for name, value in (("source", source), ("transform", transform)):
        check_picklable(name, value, to="Ray tasks", fix=RAY_FIX)


def _producer(
    o: FeedOptions, own_producer: Any, service: str | None, auto: bool, kept: str | None
) -> tuple[str, str]:
    """Who makes the batches (`FeederPlan.producer`), and why."""
    if own_producer is not None:
        return "dali", kept
    if is_ray(service):
        return "ray", kept
    if service is not None:
        return "service", kept
    if o.workers:
        return "workers", f"workers={o.workers}, worker_mode={o.worker_mode!r}: as given"
    if auto:
        return "auto", 'workers="auto": the feeder\'s thread makes the first batches, measured'
    return "thread", "workers=0: one background thread" if kept is None else f"workers=0: {kept}"


def transposition(transpose: Any, spec: SampleSpec) -> list[tuple[int, ...] | None]:
    """`transpose` as one axis order (or None) per field of `spec`, checked.

    `transpose` is an axis order for a sample that is one array, or a dict from field (a key
    of a dict sample, an index of a tuple sample, or a tuple of those for nested samples) to
    the order of that field's axes, as in `np.transpose`: `{"image": (2, 0, 1)}` makes HWC
    images CHW.
    """
    if transpose is None:
        return [None] * len(spec.leaves)
    paths = [tuple(p) for p in optree.tree_paths(spec.unflatten([0] * len(spec.leaves)))]
    if not isinstance(transpose, dict):
        if paths != [()]:
            raise TypeError(
                f"`transpose`={transpose!r} is one axis order, but samples have the fields "
                f"{', '.join(leaf.name for leaf in spec.leaves)}; pass a dict from field to "
                "axis order, e.g. {'image': (2, 0, 1)}."
            )
        transpose = {(): transpose}
    by_path = {}
    for key, order in transpose.items():
        path = key if isinstance(key, tuple) else (key,)
        if path not in paths:
            raise ValueError(
                f"`transpose` names the field {key!r}, which samples do not have; their fields "
                f"are {', '.join(field_name(p) for p in paths)}."
            )
        by_path[path] = order
    axes = []
    for path, leaf in zip(paths, spec.leaves, strict=True):
        order = by_path.get(path)
        if order is not None:
            order = tuple(order)
            if sorted(order) != list(range(len(leaf.shape))):
                raise ValueError(
                    f"`transpose` gives field {leaf.name} the axis order {order}, but that field "
                    f"has shape {leaf.shape}; give a permutation of "
                    f"{tuple(range(len(leaf.shape)))} (the batch axis is not counted)."
                )
        axes.append(order)
    return axes
