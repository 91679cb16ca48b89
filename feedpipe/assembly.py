"""Assembly: the pipeline a feeder's options build, source → sampler → producer → slots → stager.

It adapts the source and checks it against the options, reads what a sample looks like and what
the epochs' plan needs (a PyDataset's length), in a worker where there are workers (a source
that crashes or hangs on first use does so there), plans the epochs, picks who makes the
batches (one thread, workers, tf.data service, or the source's own threads), refuses host slots
the machine cannot map, and starts and stops the pipeline that makes batches and stages them on
the devices. It owns the host slot pools. It keeps no position: what the consumer has taken is
`feedpipe.consumer`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import optree

from feedpipe.core.agreement import check_hosts_agree
from feedpipe.core.auto import AutoProducer
from feedpipe.core.cost import SampleCost, Setting, probe
from feedpipe.core.description import (
    FeederDescription,
    describe_fields,
    describe_slots,
    describe_source,
    is_cpu,
)
from feedpipe.core.gather import GatherPlan, GatherPool, plan_gather
from feedpipe.core.pipeline import Pipeline
from feedpipe.core.producers import ThreadProducer, WorkerProducer
from feedpipe.core.remainder import Remainder
from feedpipe.core.sampler import Sampler
from feedpipe.core.skips import SkipLedger
from feedpipe.core.slots import SlotLayout, SlotPool, check_host_memory
from feedpipe.core.sources import ArraySource, SampleSpec, TFDatasetSource, as_source, field_name
from feedpipe.core.stage import HostStager, Layer
from feedpipe.core.state import Position, Stream
from feedpipe.core.stats import StatsRecorder
from feedpipe.core.writer import SampleWriter, first_look
from feedpipe.options import AUTO, FeedOptions


class Assembly:
    """The parts of one feeder's pipeline, built once from its options, and the pipeline run.

    Invariant: at most one pipeline runs, and every part this builds (workers, producer, slot
    pools, what the layer holds on the devices) is let go of by `close()`, which is idempotent.
    """

    def __init__(
        self,
        source: Any,
        options: FeedOptions,
        layer: Layer,
        *,
        transform: Callable[..., Any] | None,
        transpose: Any,
        service: str | None,
    ):
        self.options = options
        self.layer = layer
        self.share = layer.share
        """This host's rows of each global batch (all of them on one host)."""
        self.split = self.share.local_split
        """How this host's rows divide among its devices."""
        self.pipeline: Pipeline | None = None
        self.workers = None
        self.producer = None
        self.auto = False
        """Whether `workers="auto"` picks the workers (`feedpipe.core.auto`)."""
        self.kept: str | None = None
        self.gather_plan: GatherPlan | None = None
        """How many threads gather each batch of arrays without a transform, and why; None
        where batches are made otherwise."""
        """Why `workers="auto"` kept the one background thread, where it had nothing to pick."""
        self.pools: dict[bool, SlotPool] = {}
        """The host slot pools: batches staged on the devices (False) or kept on the host for
        a framework's own input pipeline (True)."""
        try:
            own_producer = self._adapt(source, transform, transpose, service)
            self._build(own_producer, transform, transpose, service)
        except BaseException:
            self.close()
            raise

    def _adapt(self, source: Any, transform: Any, transpose: Any, service: Any) -> Any:
        """Adapts `source` and checks it against the options; returns the producer of a source
        that makes batches in threads of its own (DALI), else None."""
        o = self.options
        self.source = as_source(
            source, text=transform is not None, global_batch_size=o.global_batch_size
        )
        """The source as feedpipe reads it (`feedpipe.core.sources`)."""
        rule = self.rule = Remainder(o.remainder, o.global_batch_size)
        own_producer = self.source.producer(self.share, self.layer.devices, rule)
        self.own_producer, self.service = own_producer, service
        self.transform, self.transpose = transform, transpose
        if o.workers == AUTO:
            self.kept = self._nothing_to_choose()
            self.auto = self.kept is None
            o = self.options = dataclasses.replace(o, workers=0)
        self._refuse_mismatches(own_producer, transform, transpose)
        self.rows_as_given = (
            own_producer is None
            and not o.workers
            and transform is None
            and transpose is None
            and service is None
        )
        """Each batch is the source's rows as they are, made in this process: nothing runs
        per sample, so a framework may gather the rows itself (`Consumer.gathered_pass`)."""
        self.refused = _unpicklable(source=self.source, transform=transform) if self.auto else ""
        """Why `workers="auto"` may not start processes ("" where it may)."""
        self.shared = (o.workers > 0 and o.worker_mode == "process") or (
            self.auto and not self.refused
        )
        """Whether the slots are shared memory that worker processes write into (or may:
        `workers="auto"` may pick processes)."""
        return own_producer

    def _nothing_to_choose(self) -> str | None:
        """Why the workers of this source are not the feeder's to choose; None where they
        are: an indexed source with work per sample."""
        source = self.source
        if self.own_producer is not None:
            return "a DaliSource makes its batches in DALI's own threads (num_threads)"
        if self.service is not None:
            return "the per-sample work runs on tf.data service workers"
        if not source.indexed:
            return (
                f"a {type(source).__name__}'s order depends on how many shards read it, so it "
                "is not changed behind the user's back: pass workers=N to read it in N shards"
            )
        if isinstance(source, ArraySource) and self.transform is None and self.transpose is None:
            return (
                "arrays without a transform are gathered with one vectorised copy a field, "
                "in the gather threads (describe().gather_threads), with no worker"
            )
        return None

    def sample_cost(self) -> SampleCost | None:
        """What one sample costs to make, probed on the source with its `transform` (see
        `feedpipe.core.cost.probe`); None where `_nothing_to_choose` says why not."""
        if self._nothing_to_choose() is not None:
            return None
        o = self.options
        spec, _ = first_look(self.source, self.transform, o.seed, policy=o.error_policy)
        axes = transposition(self.transpose, spec)
        writer = SampleWriter(self.source, spec, self.transform, o.seed, axes)
        return probe(lambda index: writer.read(index, 0), range(self.source.length))

    def _plan_epochs(self) -> None:
        """Plans the epochs of the source, measured (see `Source.measure`)."""
        o = self.options
        length = self.source.length
        self.plan = (
            None
            if length is None
            else Sampler(
                length,
                o.global_batch_size,
                remainder=o.remainder,
                shuffle=o.shuffle,
                seed=o.seed,
                block_size=self.source.block_size,
                share=self.share.rows,
            )
        )
        """The epoch's batches, where the length is known (it applies the remainder rules)."""
        self.sampler = self.plan if self.source.indexed else None
        """What chooses the samples of indexed sources; streams keep their own order."""
        self.skips = SkipLedger(o.error_policy, length) if o.error_policy.skips else None
        """The samples `errors="skip"` has left out (None with `errors="raise"`)."""

    def _refuse_mismatches(self, own_producer: Any, transform: Any, transpose: Any) -> None:
        """Refuses options the source cannot serve, naming what to pass instead."""
        o, source = self.options, self.source
        if self.share.num_hosts > 1 and not source.indexed and own_producer is None:
            raise ValueError(
                f"A {type(source).__name__} has no indices, but under a "
                f"MultiWorkerMirroredStrategy each of the {self.share.num_hosts} hosts makes "
                "only its replicas' rows of each global batch, chosen by index; pass an indexed "
                "source (arrays, a sequence with __len__ and __getitem__, a PyDataset)."
            )
        if own_producer is not None and (
            o.workers or transform is not None or transpose is not None
        ):
            raise ValueError(
                "A DaliSource decodes and augments in DALI's own threads: pass workers=0, "
                "transform=None and transpose=None, and do that work in the DALI pipeline "
                "(its num_threads sets the parallelism)."
            )
        if o.error_policy.skips:
            self._refuse_skips(own_producer)
        if o.shuffle and not source.indexed:
            raise ValueError(
                f"`shuffle`=True, but a {type(source).__name__} has no indices to shuffle; "
                "shuffle inside the generator, the tf.data.Dataset or the DALI reader "
                "(random_shuffle=True), and pass shuffle=False."
            )

    def _refuse_skips(self, own_producer: Any) -> None:
        """Refuses `errors="skip"` where a skipped sample could not stay a padding row of its
        batch without moving the others, naming why and what to do."""
        source, hosts = self.source, self.share.num_hosts
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

    def _build(self, own_producer: Any, transform: Any, transpose: Any, service: Any) -> None:
        """Reads the spec, plans the epochs and picks the producer; refuses slots the host
        cannot map."""
        o = self.options
        address, work, measured = None, None, None
        if service is not None:
            address, work = self._service_work(service, transform, transpose)
        if o.workers:
            self.workers = self._start_workers(transform, o.workers, o.worker_mode)
            # Read in a worker, with what the plan needs: a crash or a hang there is theirs.
            sample_spec, measured = self.workers.first_spec(o.error_policy)
            self.source.learn(measured)
        elif work is not None:
            sample_spec = SampleSpec.of(work.first_sample())
        else:
            sample_spec, _ = first_look(self.source, transform, o.seed, policy=o.error_policy)
        self._plan_epochs()
        axes = transposition(transpose, sample_spec)
        self.spec = sample_spec.transposed(axes)
        """What each host slot holds: the samples after `transform` and `transpose`."""
        as_given = isinstance(self.source, ArraySource) and transform is None
        self.staged_spec = self.layer.check_stageable(
            self.spec, self.source.arrays if as_given else None
        )
        """Each field as the step receives it: `spec`, or a dtype the framework narrows
        where no value changes (int64 ids that fit arrive as int32 on JAX without x64)."""
        rows = self.split.global_batch_size
        if own_producer is not None:
            self.producer = own_producer
        elif work is not None:
            from feedpipe.service.client import ServiceProducer

            if o.error_policy.skips:
                raise ValueError(
                    f'`errors`="skip" with `service`={service!r}: the transform runs on tf.data '
                    'service workers, which cannot skip a sample in place; pass errors="raise", '
                    "or workers=N without service."
                )
            self.producer = ServiceProducer(work, address, self.sampler)
        elif o.workers:
            self.producer = self._configured(self.workers, sample_spec, axes, measured)
        else:
            writer = SampleWriter(
                self.source, sample_spec, transform, o.seed, axes, skips=self.skips is not None
            )
            self.producer = ThreadProducer(
                writer, rows, self.sampler, self.rule, self.skips, self._gather_pool(writer)
            )
            if self.auto:
                start = functools.partial(self._worker_producer, sample_spec, axes)
                self.producer = AutoProducer(self.producer, start, self.refused)
        check_host_memory(
            SlotLayout(self.spec, self.split),
            self.slot_capacity() if self.producer.slots_in_flight else 0,
            shared=self.shared,
            hosts=self.share.num_hosts,
        )

    def _gather_pool(self, writer: SampleWriter) -> GatherPool | None:
        """The threads that gather each batch of arrays without a transform, sized from the
        machine and the batch (`feedpipe.core.gather`); None where one thread does it."""
        if not (writer.vectorised and self.sampler is not None):
            return None
        self.gather_plan = plan_gather(SlotLayout(self.spec, self.split).batch_bytes)
        if self.gather_plan.threads < 2:
            return None
        return GatherPool(self.source.take, self.gather_plan.threads)

    def _configured(self, workers: Any, sample_spec: SampleSpec, axes: list, measured: Any):
        """The producer of a pool started by `_start_workers`, once it knows the samples."""
        layouts = {c: SlotLayout(self.spec, self.split, contiguous=c) for c in (False, True)}
        workers.configure(sample_spec, axes, layouts, measured)
        rows = self.split.global_batch_size
        return WorkerProducer(workers, self.source, rows, self.sampler, self.rule, self.skips)

    def _worker_producer(self, sample_spec: SampleSpec, axes: list, setting: Setting):
        """The producer of `setting`'s pool, started for `workers="auto"` (in its background
        thread: a process pool takes a while to spawn)."""
        o = self.options
        workers = self._start_workers(self.transform, setting.workers, setting.mode)
        try:
            _, measured = workers.first_spec(o.error_policy)
            return self._configured(workers, sample_spec, axes, measured)
        except BaseException:
            workers.close()
            raise

    def _service_work(self, service: str, transform: Any, transpose: Any) -> tuple[str, Any]:
        """The dispatcher's address and the per-sample work it will run, both checked (see
        `feedpipe.service.client`)."""
        if self.options.workers or transpose is not None:
            raise ValueError(
                f"`service`={service!r} runs the per-sample work on tf.data service workers: "
                "pass workers=0, and transpose inside `transform` (tf.transpose)."
            )
        from feedpipe.service.client import ServiceWork, check_address

        address = check_address(service)
        return address, ServiceWork(self.source, transform, self.options.seed)

    def _start_workers(self, transform: Any, count: int, mode: str) -> Any:
        from feedpipe.core import workers as pool

        o = self.options
        if isinstance(self.source, TFDatasetSource):
            raise ValueError(
                f"`workers`={o.workers}, but a tf.data.Dataset runs in TensorFlow's own threads "
                "and cannot be read by workers; use workers=0 (and num_parallel_calls in "
                "dataset.map for parallel work)."
            )
        if mode == "process":
            pool.check_picklable("source", self.source)
            pool.check_picklable("transform", transform)
        setup = {
            "source": self.source,
            "transform": transform,
            "seed": o.seed,
            "num_shards": self.num_shards(),
            "skips": o.error_policy.skips,
        }
        kind = pool.ProcessWorkers if mode == "process" else pool.ThreadWorkers
        return kind(count, setup, o.timeout_s)

    # ---- the order, and what every host must agree on ------------------------------------

    def num_shards(self) -> int:
        """The generator shards whose rotation is the stream's order (1 for other sources)."""
        return self.options.workers if self.source.shards_order else 1

    def stream(self) -> Stream:
        """What this feeder's order depends on: a state restores only where it agrees."""
        return Stream(
            dataset_length=self.source.length,
            global_batch_size=self.options.global_batch_size,
            num_replicas=self.share.num_replicas,
            num_shards=self.num_shards(),
            seed=self.options.seed,
            shuffle=self.options.shuffle,
            steps_per_epoch=None if self.plan is None else len(self.plan),
            replicas_order=self.source.replicas_order,
        )

    def check_hosts_agree(self) -> None:
        """Refuses to start unless every host built a feeder of the same order, compared
        through the layer's collectives or store (`feedpipe.core.agreement`); the source's
        block_size orders a shuffle too."""
        fields = {
            "remainder": self.options.remainder,
            "block_size": self.source.block_size,
            "devices_per_host": self.share.local_replicas,
            **self.stream().order_fields(),
        }
        check_hosts_agree(self.layer.tally, self.share, fields)

    # ---- the pipeline ------------------------------------------------------------------------

    def slot_capacity(self) -> int:
        """Slots per pool: besides the staged batches, one the consumer holds, and those being
        filled."""
        return self.options.depth + 1 + self.producer.slots_in_flight

    def pool(self, host: bool) -> SlotPool:
        """The slot pool of batches staged on the devices, or with `host` kept on the host."""
        if host not in self.pools:
            # Batches handed to tf.data lease their slot as the device path's do: TensorFlow
            # takes the aligned arrays without a copy, and the slot returns when it frees them.
            self.pools[host] = SlotPool(
                SlotLayout(self.spec, self.split, contiguous=host),
                self.slot_capacity(),
                shared=self.shared,
                page_lock=None if host else self.layer.page_lock,
            )
        return self.pools[host]

    def start(self, host: bool, position: Position, stats: StatsRecorder) -> Pipeline:
        """The pipeline making batches from `position`, staged on the devices or, with `host`,
        kept on the host: the one running if it is of that kind, else a fresh one."""
        if self.pipeline is not None and self.pipeline.host == host:
            return self.pipeline
        self.stop()
        if self.skips is not None:  # the batches from `position` on are made again, and read
            self.skips.forget_from(position)
        stats.stream_started()
        pool = self.pool(host)
        stager = HostStager(pool.layout) if host else self.layer.stager(pool.layout, stats)
        self.pipeline = Pipeline(
            self.producer, stager, pool, self.options.depth, position, stats, host=host
        )
        return self.pipeline

    def stop(self) -> None:
        """Stops the pipeline; the batches it staged are made again by the next one."""
        # Forgotten first: a second Ctrl-C during the close must not leave a stopped pipeline
        # for the next loop to wait on (it stops by itself once `close` has set its stop).
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()

    def slot_stats(self) -> dict:
        """The slot figures of `FeedStats` (one-off slots, slots made, whether page-locked),
        and what `workers="auto"` picked."""
        pools = self.pools.values()
        device_pool = self.pools.get(False)
        locked = reason = None
        if self.layer.page_lock is not None and device_pool is not None:
            locked, reason = device_pool.page_locked, device_pool.page_lock_reason
        return {
            "overflow_slots": sum(pool.overflow_allocations for pool in pools),
            "slots_allocated": sum(pool.allocated + pool.overflow_allocations for pool in pools),
            "page_locked": locked,
            "page_lock_reason": reason,
            "staged": 0 if self.pipeline is None else self.pipeline.handoff.staged,
            "workers_picked": (
                self.producer.picked if isinstance(self.producer, AutoProducer) else None
            ),
        }

    def picked(self) -> Setting:
        """The setting making the batches now (which `workers="auto"` may change)."""
        if isinstance(self.producer, AutoProducer):
            return self.producer.setting
        return Setting(self.options.worker_mode, self.options.workers, math.nan)

    def workers_chosen(self) -> str | None:
        """What `workers="auto"` picked and why; None where the workers were given."""
        if isinstance(self.producer, AutoProducer):
            return self.producer.why
        return None if self.kept is None else f"workers=0: {self.kept}"

    def describe(self) -> FeederDescription:
        """What the pipeline is (see `Feeder.describe`)."""
        o, share, device_pool = self.options, self.share, self.pools.get(False)
        layout = (
            device_pool.layout if device_pool is not None else SlotLayout(self.spec, self.split)
        )
        devices = self.layer.devices
        accelerated = not all(is_cpu(device) for device in devices)
        return FeederDescription(
            framework=self.layer.name,
            source=describe_source(self.source, max(self.num_shards(), 1)),
            fields=describe_fields(self.staged_spec),
            service=getattr(self.producer, "service", None),
            global_batch_size=o.global_batch_size,
            per_replica_batch_size=self.split.per_replica,
            host_batch_size=self.split.global_batch_size,
            batch_bytes=layout.batch_bytes,
            steps_per_epoch=None if self.plan is None else len(self.plan),
            devices=tuple(str(device) for device in devices),
            accelerated=accelerated,
            hosts=share.num_hosts,
            host=share.host,
            workers=self.picked().workers,
            worker_mode=self.picked().mode,
            workers_chosen=self.workers_chosen(),
            gather_threads=0 if self.gather_plan is None else self.gather_plan.threads,
            gather_chosen=None if self.gather_plan is None else self.gather_plan.reason,
            depth=o.depth,
            remainder=o.remainder,
            shuffle=o.shuffle,
            seed=o.seed,
            slots=describe_slots(
                self.slot_capacity() if self.producer.slots_in_flight else 0,
                layout.nbytes,
                self.layer.name,
                accelerated,
                self.layer.page_lock,
                device_pool,
            ),
            copy_path=self.layer.copy_path.name,
            copy_path_reason=self.layer.copy_path.reason,
        )

    def close(self) -> None:
        """Stops the pipeline, the workers and the producer, and lets go of the slot pools and
        what the layer holds on the devices; idempotent."""
        self.stop()
        if self.workers is not None:
            self.workers.close()
        if self.producer is not None:
            self.producer.close()
        self.pools.clear()  # staged batches still held keep their own slots alive
        self.layer.close()  # and their own device blocks


def _unpicklable(**values: Any) -> str:
    """Why one of `values` cannot go to a worker process; "" where all of them can."""
    from feedpipe.core import workers as pool

    for name, value in values.items():
        try:
            pool.check_picklable(name, value)
        except TypeError as error:
            cause = error.__cause__ or error
            return f"the {name} cannot be pickled ({type(cause).__name__}: {cause})"
    return ""


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
