"""Assembly: the running pipeline of a feeder's plan, producer → slots → stager.

An `Assembly` is built from what `feedpipe.plan.plan_feeder` decided and started: it makes the
producer the plan chose, starts and stops the pipeline that makes batches and stages them on
the devices, owns the host slot pools, and says what the feeder is (`describe`: the plan, with
what changed as it ran). It decides and refuses nothing: that is the plan's. It keeps no
position: what the consumer has taken is `feedpipe.consumer`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from feedpipe.core.auto import AutoProducer
from feedpipe.core.cost import SampleCost, Setting, probe
from feedpipe.core.description import FeederDescription, describe_slots
from feedpipe.core.gather import GatherPool
from feedpipe.core.pipeline import Pipeline
from feedpipe.core.producers import Producer, ThreadProducer, WorkerProducer
from feedpipe.core.recorder import StatsRecorder
from feedpipe.core.slots import SlotLayout, SlotPool
from feedpipe.core.stage import HostStager, Layer
from feedpipe.core.state import Position, Stream
from feedpipe.core.writer import SampleWriter, first_look
from feedpipe.plan import FeederPlan, PlanParts


class Assembly:
    """The running pipeline of one feeder's plan: its producer, host slot pools and stagers.

    Invariant: at most one pipeline runs, and every part it runs (workers, producer, slot
    pools, what the layer holds on the devices) is let go of by `close()`, which is idempotent.
    """

    def __init__(self, plan: FeederPlan, parts: PlanParts, layer: Layer):
        """Builds what `plan` runs on `layer` from `parts` (see `feedpipe.plan.plan_feeder`),
        which it owns from then on: the producer the plan chose, now; the slot pools and
        stagers, as the first loop needs them (`start`). Where making the producer fails, the
        workers planning started are let go of."""
        self.feeder_plan = plan
        """What the feeder runs, as plain data (`feedpipe.plan`)."""
        self.parts = parts
        """What planning made or started, which this runs and owns (`feedpipe.plan`)."""
        self.options = plan.options
        self.layer = layer
        self.share = layer.share
        """This host's rows of each global batch (all of them on one host)."""
        self.split = self.share.local_split
        """How this host's rows divide among its devices."""
        self.source = parts.source
        """The source as feedpipe reads it (`feedpipe.core.sources`)."""
        self.transform = parts.writer.transform
        self.rule = parts.rule
        self.plan = parts.epochs
        """The epoch's batches, where the length is known (it applies the remainder rules)."""
        self.sampler = self.plan if self.source.indexed else None
        """What chooses the samples of indexed sources; streams keep their own order."""
        self.spec = parts.writer.out_spec
        """What each host slot holds: the samples after `transform` and `transpose`."""
        self.staged_spec = parts.staged_spec
        """Each field as the step receives it (see `FeederPlan.staged_spec`)."""
        self.rows_as_given = plan.rows_as_given
        """Each batch is the source's rows as they are (see `FeederPlan.rows_as_given`)."""
        self.workers = parts.workers
        """The pool that read the first sample and makes the batches; None without workers."""
        self.skips = parts.skips
        """The samples `errors="skip"` has left out (None with `errors="raise"`)."""
        self.pipeline: Pipeline | None = None
        self.pools: dict[bool, SlotPool] = {}
        """The host slot pools: batches staged on the devices (False) or kept on the host for
        a framework's own input pipeline (True)."""
        try:
            self.producer = self._producer()
        except BaseException:
            parts.close()
            raise

    def _producer(self) -> Producer:
        """The producer the plan chose, made from its parts."""
        plan, parts = self.feeder_plan, self.parts
        if plan.producer == "workers":
            return self._pool_producer(parts.workers, parts.measured)
        if plan.producer == "dali":
            return parts.own_producer
        if plan.producer == "ray":
            from feedpipe.ray.producer import RayProducer

            layout = SlotLayout(self.spec, self.split)
            o = self.options
            return RayProducer(
                parts.work,
                self.sampler,
                self.skips,
                layout,
                self.source.block_size,
                o.depth,
                o.timeout_s,
            )
        if plan.producer == "service":
            from feedpipe.service.producer import ServiceProducer

            return ServiceProducer(parts.work, plan.description.service, self.sampler)
        gather = None
        if plan.gather is not None and plan.gather.threads >= 2:
            gather = GatherPool(self.source.take, plan.gather.threads)
        rows = self.split.global_batch_size
        inline = ThreadProducer(parts.writer, rows, self.sampler, self.rule, self.skips, gather)
        if plan.producer == "thread":
            return inline
        return AutoProducer(inline, self._started_pool, plan.processes_refused)

    def _pool_producer(self, workers: Any, measured: Any) -> WorkerProducer:
        """The producer of a started pool, once it is told what the samples are."""
        writer, split = self.parts.writer, self.split
        layouts = {c: SlotLayout(self.spec, split, contiguous=c) for c in (False, True)}
        workers.configure(writer.spec, writer.axes, layouts, measured)
        rows = split.global_batch_size
        return WorkerProducer(workers, self.source, rows, self.sampler, self.rule, self.skips)

    def _started_pool(self, setting: Setting) -> WorkerProducer:
        """The producer of `setting`'s pool, started for `workers="auto"` (in its background
        thread: a process pool takes a while to spawn)."""
        from feedpipe.core.workers import start_pool

        o = self.options
        workers = start_pool(setting.mode, setting.workers, self.parts.worker_setup, o.timeout_s)
        try:
            _, measured = workers.first_spec(o.error_policy)
            return self._pool_producer(workers, measured)
        except BaseException:
            workers.close()
            raise

    def sample_cost(self) -> SampleCost | None:
        """What one sample costs to make, probed on the source with its `transform` (see
        `feedpipe.core.cost.probe`); None where the plan says the workers are not the
        feeder's to choose (`FeederPlan.kept`)."""
        if self.feeder_plan.kept is not None:
            return None
        o = self.options
        spec, _ = first_look(self.source, self.transform, o.seed, policy=o.error_policy)
        axes = list(self.feeder_plan.axes)
        writer = SampleWriter(self.source, spec, self.transform, o.seed, axes)
        return probe(lambda index: writer.read(index, 0), range(self.source.length))

    # ---- the order ---------------------------------------------------------------------------

    def stream(self) -> Stream:
        """What this feeder's order depends on: a state restores only where it agrees."""
        return self.feeder_plan.stream

    # ---- the pipeline ------------------------------------------------------------------------

    def slot_capacity(self) -> int:
        """Slots per pool: besides the staged batches, one the consumer holds, and those being
        filled."""
        return self.options.depth + 1 + self.feeder_plan.slots_in_flight

    def pool(self, host: bool) -> SlotPool:
        """The slot pool of batches staged on the devices, or with `host` kept on the host."""
        if host not in self.pools:
            # Batches handed to tf.data lease their slot as the device path's do: TensorFlow
            # takes the aligned arrays without a copy, and the slot returns when it frees them.
            self.pools[host] = SlotPool(
                SlotLayout(self.spec, self.split, contiguous=host),
                self.slot_capacity(),
                shared=self.feeder_plan.shared,
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
        where the per-sample work runs, and what `workers="auto"` picked."""
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
            "service": self.feeder_plan.description.service,
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
        return self.feeder_plan.description.workers_chosen

    def describe(self) -> FeederDescription:
        """What the pipeline is (see `Feeder.describe`): the plan's description, with what
        changes as it runs: the workers `workers="auto"` picked, whether the slots were
        page-locked, and the path batches are copied to the devices by."""
        planned, picked = self.feeder_plan.description, self.picked()
        return dataclasses.replace(
            planned,
            workers=picked.workers,
            worker_mode=picked.mode,
            workers_chosen=self.workers_chosen(),
            slots=describe_slots(
                planned.slots.count,
                planned.slots.bytes_per_slot,
                self.layer.name,
                planned.accelerated,
                self.layer.page_lock,
                self.pools.get(False),
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
