"""Feeder: the consumer's end of the pipeline, and the object users build.

It wires source → sampler → producer → slots → stage, keeps the consumer's position (what it
has taken, never what was produced), and serves batches as a Python iterator and its position as
state for checkpoints. It knows no framework: `fp.Feeder(...)` builds the subclass of the
framework that `devices` or `strategy` name (`feedpipe.tf.feeder`, `feedpipe.jax.feeder`),
which supplies the `Layer` that stages on its devices and its own ways in (`as_dataset`, a
sharded global batch, a checkpoint adapter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

import optree

from feedpipe._frameworks import feeder_class
from feedpipe.core._sync import Failure
from feedpipe.core.agreement import check_hosts_agree
from feedpipe.core.checks import check_int
from feedpipe.core.description import (
    FeederDescription,
    describe_fields,
    describe_slots,
    describe_source,
    is_cpu,
)
from feedpipe.core.pipeline import Pipeline
from feedpipe.core.producers import ThreadProducer, WorkerProducer
from feedpipe.core.remainder import Remainder, check_remainder, warn_dropped
from feedpipe.core.sampler import EpochEnd, Sampler
from feedpipe.core.slots import SlotLayout, SlotPool, check_host_memory
from feedpipe.core.source import (
    ArraySource,
    SampleSpec,
    TFDatasetSource,
    as_source,
    field_name,
)
from feedpipe.core.stage import HostStager, Layer
from feedpipe.core.state import Position, Stream
from feedpipe.core.stats import FeedStats, StatsRecorder
from feedpipe.core.writer import SampleWriter, first_look

WORKER_MODES = ("process", "thread")


@dataclasses.dataclass(frozen=True, slots=True)
class FeedOptions:
    """How a `Feeder` batches, orders and stages samples; validated on creation.

    `global_batch_size`, the one required field, may come first by position, as it does in
    `fp.Feeder(source, 256)`: `FeedOptions(128, shuffle=True)`. Every other field is keyword-only,
    so a call names what it sets and a field added later cannot change what an old call means.
    """

    global_batch_size: int
    """Samples per step across all replicas; must divide evenly among them."""
    _: dataclasses.KW_ONLY
    remainder: str = "pad"
    """The last partial batch: "pad" (repeat real samples, masked), "drop", or "error".
    Default "pad": every sample is seen and every replica runs the same steps."""
    shuffle: bool = False
    """Shuffle each epoch's order from (seed, epoch). Default off: the order users expect."""
    seed: int = 0
    """Seeds the order and each sample's `transform` rng, so runs are reproducible."""
    workers: int = 0
    """0 produces in one background thread; N > 0 in N workers. Default 0: arrays without a
    `transform` are gathered fastest in one thread; Python per-sample code wants workers."""
    depth: int = 2
    """Batches staged per device ahead of the step. Default 2 hides one transfer behind one
    step while the next is being made."""
    worker_mode: str = "process"
    """"process" (each worker its own interpreter and GIL) or "thread" (shares this process's
    GIL; for code that releases it). Default "process": per-sample Python holds the GIL, and
    only processes scale it (see kernels_bench/workers.py)."""
    timeout_s: float | None = None
    """Longest a worker may spend on one sample before `TimeoutError`; None waits forever
    (`close()` still ends a hung worker)."""

    def __post_init__(self):
        check_int("global_batch_size", self.global_batch_size, "pass the samples per step")
        check_remainder(self.remainder)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"`shuffle`={self.shuffle!r} must be True or False.")
        check_int("seed", self.seed, "pass seed=0 or any larger integer", minimum=0)
        check_int(
            "workers",
            self.workers,
            "use 0 for one background thread, or the number of worker processes (for example "
            "os.cpu_count())",
            minimum=0,
        )
        check_int("depth", self.depth, "use depth=2 to hide one step's transfer")
        if self.worker_mode not in WORKER_MODES:
            raise ValueError(f'`worker_mode`={self.worker_mode!r} must be "process" or "thread".')
        if self.timeout_s is not None:
            if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
                raise TypeError(f"`timeout_s`={self.timeout_s!r} must be a number of seconds.")
            if not self.timeout_s > 0:
                raise ValueError(f"`timeout_s`={self.timeout_s!r} must be > 0 seconds or None.")
            if self.workers == 0:
                raise ValueError(
                    f"`timeout_s`={self.timeout_s!r} watches workers, but `workers`=0; use "
                    "workers >= 1 or timeout_s=None."
                )


@dataclasses.dataclass(eq=False, slots=True)
class _Pass:
    """One loop over the feeder: its mode, where it started, and the stats it started from."""

    fit: bool
    """A pass a framework's `fit` reads (`as_dataset`, Keras's adapter), not the user's loop."""
    start: Position
    counters: dict
    number: int
    """Passes begun on this feeder so far, this one included."""
    handed: int = 0
    """Batches handed to the consumer; a pass's batches are consecutive steps of one epoch."""
    end: Position | None = None
    """Where the next pass starts, once this one has reached the end of its epoch."""
    taken: Any = None
    """For a pass whose batches the framework gathers itself (see `Feeder._gathered_pass`):
    what its consumer took, as the framework's threads record it (`TakenBatches`); None where
    this feeder hands out the batches and counts them as it does."""
    valid: Any = None
    """For a gathered pass: each of its batches' count of real samples."""
    measured: dict | None = None
    """For a gathered pass: what `taken` had timed when it began (see `Feeder._gathered`)."""
    counted: bool = False
    """For a gathered pass: its batches are in the feeder's stats."""

    def catch_up(self, steps_per_epoch: int) -> None:
        """Reads how far the consumer of a gathered pass has got: `handed`, and `end` once it
        took the epoch's last batch."""
        if self.taken is None:
            return
        step = self.taken.after(self.number)
        self.handed = 0 if step is None else step - self.start.step
        if step == steps_per_epoch:
            self.end = Position(self.start.epoch + 1, 0)

    def after(self, count: int) -> Position:
        """The position once the consumer has used the first `count` batches of this pass."""
        if count == self.handed and self.end is not None:
            return self.end
        return Position(self.start.epoch, self.start.step + count)


_SUPERSEDED = (
    "This loop over feeder.as_dataset() was superseded: another loop over the dataset (or the "
    "feeder) began, or set_state() was called, before it ended. A feeder is one stream with one "
    "consumer: finish or drop one iterator before starting the next, and build a second "
    "fp.Feeder to read the same data twice at once."
)


class Feeder:
    """Builds each global batch on the host, splits it per replica, and stages it on each device.

    Iterating yields batches whose arrays already sit on their devices; each `for` loop runs
    one epoch from the feeder's position (a loop left early resumes where it stopped). Invariant:
    at most `depth` batches wait on each device, and `depth + 2` host slots (allocated once,
    reused) hold everything in flight.

    `fp.Feeder(...)` is the feeder of the framework `devices` or `strategy` belong to (see
    `feedpipe._frameworks`), or of `framework=` ("tensorflow" or "jax").
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Feeder:
        if cls is Feeder:
            devices = kwargs.get("devices", args[2] if len(args) > 2 else None)
            strategy = kwargs.get("strategy", args[3] if len(args) > 3 else None)
            cls = feeder_class(kwargs.get("framework"), devices, strategy)
        return super().__new__(cls)

    @property
    def _active(self) -> _Pass | None:
        """The pass being iterated, if any."""
        return self._active_pass

    @_active.setter
    def _active(self, this: _Pass | None) -> None:
        # Whatever ends a gathered pass, its batches still waiting in the framework's threads
        # must be refused when taken, as `_iterate` refuses a superseded pass's.
        left, self._active_pass = self._active_pass, this
        if left is not None and left is not this and left.taken is not None:
            left.taken.revoke(left.number)
            if not left.counted:
                left.counted = True
                self._stats.gathered(**self._gathered(left))

    def _layer(self, devices: Any, strategy: Any, global_batch_size: int) -> Layer:
        """The framework layer that stages this feeder's batches (each framework's subclass)."""
        raise NotImplementedError

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        devices: Any = None,
        strategy: Any = None,
        remainder: str = "pad",
        shuffle: bool = False,
        seed: int = 0,
        workers: int = 0,
        depth: int = 2,
        transform: Callable[..., Any] | None = None,
        *,
        worker_mode: str = "process",
        timeout_s: float | None = None,
        transpose: Any = None,
        service: str | None = None,
        framework: str | None = None,
    ):
        self._pipeline: Pipeline | None = None
        self._active_pass: _Pass | None = None
        self._workers = None
        self._producer = None
        self._pools: dict[bool, SlotPool] = {}
        self._closed = False
        self.options = FeedOptions(
            global_batch_size,
            remainder=remainder,
            shuffle=shuffle,
            seed=seed,
            workers=workers,
            depth=depth,
            worker_mode=worker_mode,
            timeout_s=timeout_s,
        )
        if transform is not None and not callable(transform):
            raise TypeError(
                f"`transform` must be callable or None; got {type(transform).__name__}."
            )
        self.layer = self._layer(devices, strategy, global_batch_size)
        """The framework layer: its devices, this host's share, how it stages."""
        self.devices = self.layer.devices
        """This host's replica devices (under a multi-worker strategy, not the other hosts')."""
        self.strategy = strategy
        self.share = self.layer.share
        """This host's rows of each global batch (all of them on one host)."""
        self.split = self.share.local_split
        """How this host's rows divide among its devices."""
        self.source = source
        """The source as it was given (the arrays, the dataset, the generator source)."""
        self._source = as_source(
            source, text=transform is not None, global_batch_size=global_batch_size
        )
        rule = self._rule = Remainder(remainder, global_batch_size)
        own_producer = self._source.producer(self.share, self.devices, rule)
        if self.share.num_hosts > 1 and not self._source.indexed and own_producer is None:
            raise ValueError(
                f"A {type(self._source).__name__} has no indices, but under a "
                f"MultiWorkerMirroredStrategy each of the {self.share.num_hosts} hosts makes "
                "only its replicas' rows of each global batch, chosen by index; pass an indexed "
                "source (arrays, a sequence with __len__ and __getitem__, a PyDataset)."
            )
        if own_producer is not None and (workers or transform is not None or transpose is not None):
            raise ValueError(
                "A DaliSource decodes and augments in DALI's own threads: pass workers=0, "
                "transform=None and transpose=None, and do that work in the DALI pipeline "
                "(its num_threads sets the parallelism)."
            )
        self._rows_as_given = (
            own_producer is None
            and not workers
            and transform is None
            and transpose is None
            and service is None
        )
        """Each batch is the source's rows as they are, made in this process: nothing runs
        per sample, so a framework may gather the rows itself (`_gathered_pass`)."""
        if shuffle and not self._source.indexed:
            raise ValueError(
                f"`shuffle`=True, but a {type(self._source).__name__} has no indices to shuffle; "
                "shuffle inside the generator, the tf.data.Dataset or the DALI reader "
                "(random_shuffle=True), and pass shuffle=False."
            )
        length = self._source.length
        self._plan = (
            None
            if length is None
            else Sampler(
                length,
                global_batch_size,
                remainder=remainder,
                shuffle=shuffle,
                seed=seed,
                block_size=self._source.block_size,
                share=self.share.rows,
            )
        )
        """The epoch's batches, where the length is known (it applies the remainder rules)."""
        self._sampler = self._plan if self._source.indexed else None
        """What chooses the samples of indexed sources; streams keep their own order."""
        self._shared = workers > 0 and worker_mode == "process"
        address, work = None, None
        if service is not None:
            address, work = self._service_work(service, transform, transpose)
        if workers:
            self._workers = self._start_workers(transform)
        try:
            # With workers, sample 0 is read in a worker: a crash or hang there is theirs.
            if workers:
                sample_spec = self._workers.first_spec()
            elif work is not None:
                sample_spec = SampleSpec.of(work.first_sample())
            else:
                sample_spec, _ = first_look(self._source, transform, seed)
            axes = _axes(transpose, sample_spec)
            self.spec = sample_spec.transposed(axes)
            """What each host slot holds: the samples after `transform` and `transpose`."""
            as_given = isinstance(self._source, ArraySource) and transform is None
            self.staged_spec = self.layer.check_stageable(
                self.spec, self._source.arrays if as_given else None
            )
            """Each field as the step receives it: `spec`, or a dtype the framework narrows
            where no value changes (int64 ids that fit arrive as int32 on JAX without x64)."""
            if own_producer is not None:
                self._producer = own_producer
            elif work is not None:
                from feedpipe.service.client import ServiceProducer

                self._producer = ServiceProducer(work, address, self._sampler)
            elif workers:
                layouts = {
                    c: SlotLayout(self.spec, self.split, contiguous=c) for c in (False, True)
                }
                self._workers.configure(sample_spec, axes, layouts)
                self._producer = WorkerProducer(
                    self._workers, self._source, self.split.global_batch_size, self._sampler, rule
                )
            else:
                writer = SampleWriter(self._source, sample_spec, transform, seed, axes)
                self._producer = ThreadProducer(
                    writer, self.split.global_batch_size, self._sampler, rule
                )
            check_host_memory(
                SlotLayout(self.spec, self.split),
                self._slot_capacity() if self._producer.slots_in_flight else 0,
                shared=self._shared,
                hosts=self.share.num_hosts,
            )
        except BaseException:
            self.close()
            raise
        self._stats = StatsRecorder(depth)
        self._position = Position(0, 0)
        self._active = None
        self._passes = 0
        self._last_fit: _Pass | None = None
        """The latest pass of `as_dataset`, ended or not: what a `fit` has been reading."""
        self._settled = (self._position, 0)
        """The position and pass count when the position was last known to be the consumer's
        (set_state, the end of a `for` loop or of a tracked `fit`); later passes of
        `as_dataset` may be Keras's look at a batch before training."""
        self._settled_counters = self._stats.consumer_counters()
        """The consumer's stats then: what Keras's look at a batch took is not a step."""
        self._tracker: Any = None
        """The `FitTracker` of the `model.fit` reading `as_dataset()`, if any."""
        self._fit_start = self._position
        """Where the tracked `fit` began."""
        self._failure: BaseException | None = None
        """The error that closed the feeder: every later read raises it again."""
        self._untracked = False
        """Passes of `as_dataset` were read since the position was settled, with no tracker."""
        self._interrupted_at: Position | None = None
        """Where the last tracked `fit` stopped, if it raised (an error, Ctrl-C)."""
        if self.share.num_hosts > 1:
            self._check_hosts_agree()

    def _check_hosts_agree(self) -> None:
        """Refuses to start unless every host built a feeder of the same order, exchanged
        through the layer's collectives (`feedpipe.core.agreement`); the source's block_size
        orders a shuffle too."""
        fields = {
            "remainder": self.options.remainder,
            "block_size": self._source.block_size,
            **self._stream().order_fields(),
        }
        try:
            check_hosts_agree(self.layer.exchange, self.share, fields)
        except BaseException:
            self.close()
            raise

    def _service_work(self, service: str, transform, transpose) -> tuple[str, Any]:
        """The dispatcher's address and the per-sample work it will run, both checked (see
        `feedpipe.service.client`)."""
        if self.options.workers or transpose is not None:
            raise ValueError(
                f"`service`={service!r} runs the per-sample work on tf.data service workers: "
                "pass workers=0, and transpose inside `transform` (tf.transpose)."
            )
        from feedpipe.service.client import ServiceWork, check_address

        address = check_address(service)
        return address, ServiceWork(self._source, transform, self.options.seed)

    def _start_workers(self, transform):
        from feedpipe.core import workers as pool

        o = self.options
        if isinstance(self._source, TFDatasetSource):
            raise ValueError(
                f"`workers`={o.workers}, but a tf.data.Dataset runs in TensorFlow's own threads "
                "and cannot be read by workers; use workers=0 (and num_parallel_calls in "
                "dataset.map for parallel work)."
            )
        if self._shared:
            pool.check_picklable("source", self._source)
            pool.check_picklable("transform", transform)
        setup = {
            "source": self._source,
            "transform": transform,
            "seed": o.seed,
            "num_shards": self._num_shards(),
        }
        kind = pool.ProcessWorkers if self._shared else pool.ThreadWorkers
        return kind(o.workers, setup, o.timeout_s)

    # ---- iteration ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Steps per epoch."""
        if self._plan is None:
            raise TypeError(
                f"The number of steps is unknown: a {type(self._source).__name__} does not say "
                "how many samples it has."
            )
        return len(self._plan)

    def __iter__(self) -> Iterator[Any]:
        """The batches of the next epoch (or of the rest of an epoch left early)."""
        return self._iterate(fit=False, host=False)

    def _pool(self, host: bool) -> SlotPool:
        if host not in self._pools:
            layout = SlotLayout(self.spec, self.split, contiguous=host)
            capacity = self._slot_capacity()
            # Batches handed to tf.data lease their slot as the device path's do: TensorFlow
            # takes the aligned arrays without a copy, and the slot returns when it frees them.
            self._pools[host] = SlotPool(
                layout,
                capacity,
                shared=self._shared,
                page_lock=None if host else self.layer.page_lock,
            )
        return self._pools[host]

    def _slot_capacity(self) -> int:
        """Slots per pool: besides the staged batches, one the consumer holds, and those being
        filled."""
        return self.options.depth + 1 + self._producer.slots_in_flight

    def _start(self, host: bool) -> Pipeline:
        if self._pipeline is not None and self._pipeline.host == host:
            return self._pipeline
        self._stop_pipeline()
        self._stats.stream_started()
        pool = self._pool(host)
        stager = HostStager(pool.layout) if host else self.layer.stager(pool.layout, self._stats)
        self._pipeline = Pipeline(
            self._producer,
            stager,
            pool,
            self.options.depth,
            self._position,
            self._stats,
            host=host,
        )
        return self._pipeline

    def _stop_pipeline(self) -> None:
        # Forgotten first: a second Ctrl-C during the close must not leave a stopped pipeline
        # for the next loop to wait on (it stops by itself once `close` has set its stop).
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()

    def _iterate(self, *, fit: bool, host: bool, steps: int | None = None) -> Iterator[Any]:
        """One pass over the rest of the current epoch (`steps` batches, where given), staged
        on the devices or, with `host`, kept on the host.

        A loop left early keeps its position (the next loop resumes there). A `fit` pass
        (`as_dataset`, Keras's adapter) left early does not count unless a `FitTracker` says
        which of its batches the step used, because TensorFlow prefetches batches the step never
        takes and Keras peeks at a batch to build the model: the next pass starts again where
        it began. Such a pass, if TensorFlow finalises it late, is superseded, and raises if
        read again.
        """
        this = self._begin_pass(fit=fit, steps=steps)
        pipeline = self._start(host)
        try:
            while True:
                item = self._next(pipeline)
                if isinstance(item, EpochEnd):
                    if this.handed == 0 and this.start.step > 0:
                        # A source of unknown length learns its epoch's end by reading on, so
                        # a state taken after the last batch can say (e, steps): that epoch is
                        # over, and this pass is the next one, never an empty one.
                        self._position = this.start = Position(item.epoch + 1, 0)
                        continue
                    self._end_epoch(this, item)
                    return
                self._position = Position(item.epoch, item.step + 1)
                this.handed += 1
                if self._plan is not None and item.step + 1 == len(self._plan):
                    # The epoch's end is taken with its last batch: Keras never asks past it,
                    # nor does a loop that takes len(feeder) batches (islice, zip with range).
                    self._end_epoch(this, self._next(pipeline))
                    yield item
                    return
                yield item
                del item  # the slot returns when the consumer drops the batch, not this frame
                if self._active is not this:
                    raise RuntimeError(_SUPERSEDED)
        finally:
            # At interpreter exit a suspended loop is finalised after modules are torn down.
            if self._active is this and not sys.is_finalizing():
                self._stats.loop_ended()
                if fit:
                    self._supersede()
                else:
                    self._active = None
                    self._stop_pipeline()  # staged batches are made again by the next loop
                    self._settle()

    def _begin_pass(self, *, fit: bool, steps: int | None, taken: Any = None) -> _Pass:
        """Begins a pass from the consumer's position, superseding a `fit` pass still open."""
        if self._closed:
            if self._failure is not None:
                raise self._failure
            raise RuntimeError("The feeder is closed; build a new fp.Feeder to read again.")
        if self._active is not None:
            if not self._active.fit:
                raise RuntimeError(
                    "The feeder is already being iterated; finish or break that loop first "
                    "(one consumer per feeder)."
                )
            self._supersede()
        if not fit:
            self._end_interrupted_fit()
        if steps is not None:
            self._check_passes_from(self._position, steps, None)
        self._passes += 1
        this = _Pass(
            fit, self._position, self._stats.consumer_counters(), self._passes, taken=taken
        )
        self._active = this
        if fit:
            self._last_fit = this
            self._untracked = self._untracked or self._tracker is None
        return this

    def _gathered_pass(self, steps: int | None, taken: Any) -> tuple[_Pass, Any, Any]:
        """Begins a pass of `as_dataset()` whose batches the framework gathers itself from the
        source's arrays, in its own threads, with no Python per batch: the pass, the rows of
        each of its `steps` batches (padded as a slot pads: the real rows repeated in
        order, so `HostSlot.pad` and this agree row for row) and each batch's count of real
        rows.

        The consumer's position follows from what `taken` records of the pass (see
        `_Pass.catch_up`), read when the pass ends; until then `_position` is where it began.
        """
        this = self._begin_pass(fit=True, steps=steps, taken=taken)
        self._stop_pipeline()  # nothing this feeder's thread stages is read in such a pass
        rows, valid = self._plan.padded_rows(this.start.epoch, this.start.step)
        this.valid, this.measured = valid, taken.measured()
        taken.open(this.number)
        return this, rows, valid

    def _gathered(self, this: _Pass) -> dict:
        """What the consumer of the gathered pass `this` has taken so far, for the stats: its
        steps and samples, their time (the mean time from one taken batch to the next, times
        the steps), and the producer's (the framework's gathering) time and samples."""
        this.catch_up(len(self._plan))
        now, then = this.taken.measured(), this.measured
        steps = max(this.handed, 0)
        if self._tracker is not None:  # batches read ahead of the step were not trained on
            per_epoch, trained = len(self._plan), self._tracked()
            begun = this.start.epoch * per_epoch + this.start.step
            steps = max(0, min(steps, trained.epoch * per_epoch + trained.step - begun))
        intervals = now["intervals"] - then["intervals"]
        step_s = (now["step_us"] - then["step_us"]) / 1e6
        return {
            "steps": steps,
            "samples": int(this.valid[:steps].sum()),
            "wall_s": step_s / intervals * steps if intervals else 0.0,
            "busy_s": (now["busy_us"] - then["busy_us"]) / 1e6,
            "produced": now["made"] - then["made"],
        }

    def _next(self, pipeline: Pipeline) -> Any:
        """The next item of the hand-off; a failure closes the feeder and raises its error."""
        item = pipeline.get()
        if isinstance(item, Failure):
            self._failure = item.error
            self.close()
            raise item.error
        return item

    def _end_epoch(self, this: _Pass, end: EpochEnd) -> None:
        self._position = this.end = Position(end.epoch + 1, 0)
        if end.dropped and self._plan is None:
            warn_dropped(end.epoch, end.dropped, stacklevel=4)
        self._active = None
        if not this.fit:
            self._settle()

    def _supersede(self) -> None:
        """Ends the pass of `as_dataset` being read: the consumer's position is the end of its
        epoch where a gathered pass's last batch was taken, else what a tracker says it used,
        else where the pass began (its batches will be made and taken again)."""
        left, self._active = self._active, None
        self._stop_pipeline()
        if left is not None and self._plan is not None:
            left.catch_up(len(self._plan))
        if left is not None and left.end is not None:
            self._position = left.end  # a gathered pass whose last batch was taken
        elif self._tracker is not None:
            self._position = self._tracked()
        elif left is not None:
            self._position = left.start
            self._stats.restore_consumer(left.counters)

    def _settle(self) -> None:
        self._settled = (self._position, self._passes)
        self._settled_counters = self._stats.consumer_counters()
        self._untracked = False

    def fit_callback(self) -> Any:
        """A Keras callback for `model.fit(feeder.as_dataset(), callbacks=[...])`: with it,
        `get_state()` and checkpoints taken in any callback hold exactly the batches the step
        trained on, and an error in the source or `transform` leaves `fit` as itself where the
        step has not reached it yet (see `feedpipe.fit.FitTracker`)."""
        from feedpipe.keras.fit import FitTracker  # Keras is loaded only for a fit

        return FitTracker(self)

    # ---- diagnostics and state ------------------------------------------------------------

    def stats(self) -> FeedStats:
        """A snapshot of how well the step has been fed so far."""
        pools = self._pools.values()
        device_pool = self._pools.get(False)
        locked = reason = None
        if self.layer.page_lock is not None and device_pool is not None:
            locked, reason = device_pool.page_locked, device_pool.page_lock_reason
        snapshot = self._stats.snapshot(
            overflow_slots=sum(pool.overflow_allocations for pool in pools),
            slots_allocated=sum(pool.allocated + pool.overflow_allocations for pool in pools),
            page_locked=locked,
            page_lock_reason=reason,
            staged=0 if self._pipeline is None else self._pipeline.handoff.staged,
        )
        this = self._active
        if this is None or this.taken is None or this.counted:
            return snapshot
        # A gathered pass being read: what its consumer has taken so far counts already.
        got, s = self._gathered(this), snapshot
        busy_s, produced = s.producer_busy_s + got["busy_s"], s.produced_samples + got["produced"]
        return dataclasses.replace(
            s,
            steps=s.steps + got["steps"],
            samples=s.samples + got["samples"],
            wall_s=s.wall_s + got["wall_s"],
            untimed_steps=s.untimed_steps + got["steps"],
            untimed_s=s.untimed_s + got["wall_s"],
            producer_busy_s=busy_s,
            produced_samples=produced,
        )

    def describe(self) -> FeederDescription:
        """What this feeder is: its framework, source, batch, devices, workers, staging and
        host slots, as a frozen `feedpipe.core.description.FeederDescription`: a dataclass
        rather than a dict, so each field is documented where it is defined and read as an
        attribute that tools check; `to_dict()` gives the JSON. It says what the feeder was
        built as, never how it is doing (that is `stats()`)."""
        o, share, device_pool = self.options, self.share, self._pools.get(False)
        layout = (
            device_pool.layout if device_pool is not None else SlotLayout(self.spec, self.split)
        )
        accelerated = not all(is_cpu(device) for device in self.devices)
        return FeederDescription(
            framework=self.layer.name,
            source=describe_source(self._source, max(self._num_shards(), 1)),
            fields=describe_fields(self.staged_spec),
            service=getattr(self._producer, "service", None),
            global_batch_size=o.global_batch_size,
            per_replica_batch_size=self.split.per_replica,
            host_batch_size=self.split.global_batch_size,
            batch_bytes=layout.batch_bytes,
            steps_per_epoch=None if self._plan is None else len(self._plan),
            devices=tuple(str(device) for device in self.devices),
            accelerated=accelerated,
            hosts=share.num_hosts,
            host=share.host,
            workers=o.workers,
            worker_mode=o.worker_mode,
            depth=o.depth,
            remainder=o.remainder,
            shuffle=o.shuffle,
            seed=o.seed,
            slots=describe_slots(
                self._slot_capacity() if self._producer.slots_in_flight else 0,
                layout.nbytes,
                self.layer.name,
                accelerated,
                self.layer.page_lock,
                device_pool,
            ),
            copy_path=self.layer.copy_path.name,
            copy_path_reason=self.layer.copy_path.reason,
        )

    def get_state(self) -> dict:
        """The consumer's position, as a small JSON-serialisable dict.

        After `as_dataset()` has been read, the position is known only with a
        `fit_callback()` in the fit's callbacks (TensorFlow takes batches ahead of the step);
        without one this raises, until `set_state()` or a loop over the feeder itself.
        """
        state = self._position_state(self._consumed())
        source_state = self._producer.state_at(Position(state["epoch"], state["step"]))
        if source_state is not None:  # a DALI source: its pipelines' own checkpoints
            state["source"] = source_state
        return state

    def _consumed(self) -> Position:
        """The batches the consumer has used, as a position."""
        if self._tracker is not None:
            return self._tracked()
        if self._untracked:
            raise RuntimeError(
                "get_state() cannot tell which batches of feeder.as_dataset() were trained on: "
                "TensorFlow and Keras take batches ahead of the step (and Keras reads some to "
                "build the model), so the batches the dataset handed out are not the ones used. "
                "Pass the feeder's callback to fit, model.fit(dataset, "
                "callbacks=[feeder.fit_callback(), ...]), and the state is exactly the batches "
                "the step consumed; in a loop of your own, iterate the feeder (for batch in "
                "feeder), whose state is exact."
            )
        return self._position

    def _tracked(self) -> Position:
        """The position after the batches the tracked `fit` has trained on: the fit's start
        moved on by its steps, whatever reads ahead (`prefetch`) or repeats the dataset; where
        the epochs' length is unknown, the passes of the dataset mark their ends."""
        if self._plan is not None:
            return self._stream().after(self._fit_start, self._tracker.trained)
        last, tracker = self._last_fit, self._tracker
        if last is None or last.number <= tracker.first_pass:
            return self._position  # this epoch's pass has not begun: it begins there
        return last.after(min(tracker.finished, last.handed))

    def _position_state(self, position: Position) -> dict:
        """The state at `position`, without what the source adds."""
        return self._stream().state(position)

    def _stream(self) -> Stream:
        """What this feeder's order depends on: a state restores only where it agrees."""
        return Stream(
            dataset_length=self._source.length,
            global_batch_size=self.options.global_batch_size,
            num_replicas=self.share.num_replicas,
            num_shards=self._num_shards(),
            seed=self.options.seed,
            shuffle=self.options.shuffle,
            steps_per_epoch=None if self._plan is None else len(self._plan),
            replicas_order=self._source.replicas_order,
        )

    def _num_shards(self) -> int:
        """The generator shards whose rotation is the stream's order (1 for other sources)."""
        return self.options.workers if self._source.shards_order else 1

    def set_state(self, state: dict) -> None:
        """Continues the stream exactly where `state` was taken; staged batches are remade.

        A loop over `as_dataset()` that is still open is superseded (Keras's look at a batch
        before training, for a restore in a callback's `on_train_begin`).
        """
        if self._active is not None and not self._active.fit:
            raise RuntimeError(
                "set_state() was called while a loop over the feeder is running; restore "
                "before the loop starts (or break out of it first)."
            )
        position = self._stream().position(state)
        if position.step > 0:
            self._source.check_resumable(position.step * self.options.global_batch_size)
        self._active = None
        self._stop_pipeline()
        self._position = position
        self._interrupted_at = None
        self._producer.restore(self._position, state.get("source"))
        self._settle()

    # ---- model.fit -----------------------------------------------------------------------

    def _track(self, tracker: Any) -> None:
        """A tracked `fit` begins: passes of `as_dataset` since the position was last settled
        were Keras's look at a batch to build the model, not training. A fit on the same
        dataset that raised goes on from what it trained."""
        self._end_interrupted_fit()
        position, passes = self._settled
        if self._passes != passes:
            if self._active is not None:
                self._active.counted = True  # Keras's look, not a step
            self._active = None
            self._stop_pipeline()
            self._position = position
            self._stats.restore_consumer(self._settled_counters)
            self._settle()
        self._fit_start = self._position
        self._tracker = tracker

    def _untrack(self, tracker: Any) -> None:
        """A tracked `fit` ended: the position becomes what it trained on."""
        if self._tracker is not tracker:
            return
        position = self._tracked()
        if position != self._position or self._active is not None:
            self._active = None  # while the tracker still says what the pass trained
            self._stop_pipeline()
            self._position = position
        self._tracker = None
        self._settle()

    def _end_interrupted_fit(self) -> None:
        """A `fit` that raised (an error, Ctrl-C) never tells its tracker it ended: what it
        trained on becomes the position before anything else reads the feeder."""
        if self._tracker is not None:
            self._tracker.interrupted()
            self._untrack(self._tracker)
            self._interrupted_at = self._position

    def _reads_this(self, data: Any) -> bool:
        """Whether `data` reads this feeder (a framework adds its own datasets)."""
        return data is self

    def _refuse_as_validation(self, data: Any) -> None:
        """Refuses a fit whose `validation_data` reads this feeder: validation would take the
        epoch after each one trained, so training would see every other epoch."""
        if data is not None and self._reads_this(data):
            raise ValueError(
                "`validation_data` reads the feeder this fit trains on: each validation would "
                "take the feeder's next epoch, and training would see every other one. Give "
                "validation data of its own: a second fp.Feeder over the validation samples, "
                "or arrays, validation_data=(x_val, y_val)."
            )

    def _untake(self, batch: Any) -> None:
        """`batch` and the batches taken after it trained nothing (the step raised): the next
        loop begins at it. Call once the loop that took them is closed."""
        self._stop_pipeline()
        self._position = Position(batch.epoch, batch.step)
        self._settle()

    def _end_open_pass(self) -> None:
        """Ends a fit pass left open (Keras's look at a batch, a pass read in part), so that
        the rest of the epoch is counted from what the step trained on."""
        if self._active is not None and self._active.fit:
            self._supersede()

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A block whose reads train nothing (`fp.diagnose` measures in one): they read whole
        epochs from the next one begun (so `as_dataset().repeat()` can repeat), and the
        position, and so `get_state()`, is put back as it was when the block ends."""
        self._end_interrupted_fit()
        self._end_open_pass()
        position = self._position
        if position.step > 0 and self._plan is not None:
            self._stop_pipeline()
            self._position = Position(position.epoch + 1, 0)
        try:
            yield
        finally:
            self._active = None
            self._stop_pipeline()
            self._position = position
            self._settle()

    def _steps_left(self) -> int | None:
        """Batches left in the current epoch (None where the length is unknown): a feeder left
        or restored mid-epoch serves the rest of that epoch in a fit's first pass."""
        if self._plan is None:
            return None
        return len(self._plan) - self._position_state(self._position)["step"]

    def _check_fit_epochs(
        self, steps: int | None, epochs: int, *, total: int, itself: bool = False
    ) -> None:
        """Refuses a tracked fit's `epochs` epochs (of `total`) of `steps` batches that are
        not the feeder's next, from what the fit has trained (a `prefetch` may have taken the
        next epoch's first batches already). A fit that reads the feeder `itself` (Keras's
        adapter) runs Keras epochs of a whole epoch's batches: its first pass, begun mid-epoch,
        ends with that epoch, which Keras takes as an epoch that ran out early."""
        if itself and self._plan is not None and steps == len(self._plan):
            return
        if self._plan is None:
            self._check_unknown_epochs(steps, epochs, total=total, itself=itself)
            return
        self._check_passes_from(self._tracked(), steps, epochs, total=total)

    def _check_unknown_epochs(
        self, steps: int | None, epochs: int, *, total: int, itself: bool
    ) -> None:
        """Refuses a fit of several epochs begun mid-epoch on a source of unknown length:
        Keras takes its first epoch's steps, here the rest of the feeder's, for every epoch,
        and would run short ones (its warning that the input ran out is the feeder's to quiet
        at an epoch's end, so nothing would say so)."""
        position = self._tracked()
        if steps is not None or epochs <= 1 or position.step == 0:
            return
        epoch, step = position
        entry = "feeder" if itself else "feeder.as_dataset()"
        if position == self._interrupted_at:
            what = (
                f"The last fit on this feeder was interrupted (Ctrl-C or an error) at step "
                f"{step} of epoch {epoch}"
            )
        else:
            what = f"The feeder is at step {step} of epoch {epoch} (restored there)"
        raise ValueError(
            f"{what}, and its source does not say how many samples it has, so Keras would take "
            f"the rest of that epoch's length for each of the {epochs} epochs of this fit and "
            f"run short ones. Finish that epoch in a fit of its own, model.fit({entry}, "
            f"epochs=1, callbacks=[feeder.fit_callback(), ...]), then go on with "
            f"model.fit({entry}, epochs={total - 1}, ...)."
        )

    def _check_passes_from(
        self, position: Position, steps: int | None, epochs: int | None, total: int | None = None
    ) -> None:
        """Refuses passes of `steps` batches (`epochs` of them) from `position` that are not
        the feeder's epochs.

        Keras runs every epoch of a fit for the same number of steps, the dataset's length,
        fixed when `as_dataset()` is called: the rest of an epoch needs a fit of its own on
        a dataset, where `model.fit(feeder)` goes on by itself.
        """
        if self._plan is None:
            return
        state = self._position_state(position)
        epoch, step = state["epoch"], state["step"]
        left = len(self._plan) - step
        if steps == left and (step == 0 or epochs is None or epochs <= 1):
            return
        entry = "feeder.as_dataset()" if self.layer.name == "tensorflow" else "feeder"
        runs = "" if epochs is None else f" (model.fit runs {epochs} such epochs)"
        if step > 0 and position == self._interrupted_at:
            more = "" if total is None else f"epochs={total}, "
            raise ValueError(
                f"This dataset cannot go on after an interrupted fit: the last fit on this "
                f"feeder stopped (Ctrl-C or an error) at step {step} of epoch {epoch}, which "
                f"has {left} batches left; each pass over this "
                f"dataset has {steps} batches{runs}, and Keras runs every epoch of a fit for "
                f"the same number of steps. Pass the feeder itself, which goes on: "
                f"model.fit(feeder, {more}"
                "callbacks=[feeder.fit_callback(), ...]) trains the rest of epoch "
                f"{epoch}, then whole epochs."
            )
        if step == 0:
            fix = (
                f"this dataset was made mid-epoch and serves only the rest of that epoch; for "
                f"the next epochs make a new one, model.fit({entry}, "
                f"initial_epoch={epoch}, epochs=...)"
            )
        else:
            fix = (
                f"after a restore mid-epoch, finish that epoch in a fit of its own on a dataset "
                f"made after the restore, model.fit({entry}, initial_epoch={epoch}, "
                f"epochs={epoch + 1}), then go on with model.fit({entry}, "
                f"initial_epoch={epoch + 1}, epochs=...)"
            )
        raise ValueError(
            f"Each pass over this dataset has {steps} batches{runs}, but the feeder is at step "
            f"{step} of epoch {epoch}, which has {left} batches left, and later epochs have "
            f"{len(self._plan)}: Keras runs every epoch of a fit for the same number of steps. "
            f"Leave steps_per_epoch unset; {fix}."
        )

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background thread and the workers, and frees staged batches; idempotent."""
        self._closed = True
        self._stop_pipeline()
        if self._workers is not None:
            self._workers.close()
        if self._producer is not None:
            self._producer.close()
        self._pools.clear()  # staged batches still held keep their own slots alive
        self.layer.close()  # and their own device blocks

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Feeder({self._source!r}, global_batch_size={o.global_batch_size}, "
            f"devices={list(self.devices)}, remainder={o.remainder!r}, shuffle={o.shuffle}, "
            f"seed={o.seed}, workers={o.workers}, depth={o.depth}"
            + (f", worker_mode={o.worker_mode!r}" if o.workers else "")
            + (f", timeout_s={o.timeout_s}" if o.timeout_s is not None else "")
            + (
                f", host={self.share.host} of {self.share.num_hosts}"
                if self.share.num_hosts > 1
                else ""
            )
            + ")"
        )


def _axes(transpose: Any, spec: SampleSpec) -> list[tuple[int, ...] | None]:
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
