"""Feeder: the consumer's end of the pipeline, and the object users build.

It wires source → sampler → producer → split → stage, keeps the consumer's position (what it
has taken, never what was produced), and serves batches as a Python iterator, as a
`tf.data.Dataset` for `model.fit`, and as state for checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import optree
import tensorflow as tf

from feedpipe._pipeline import Pipeline
from feedpipe._sync import Failure
from feedpipe.producers import Position, ThreadProducer, WorkerProducer
from feedpipe.remainder import Remainder, check_remainder, warn_dropped
from feedpipe.sampler import EpochEnd, Sampler
from feedpipe.slots import SlotLayout, SlotPool
from feedpipe.source import SampleSpec, TFDatasetSource, as_source, field_name
from feedpipe.split import ReplicaSplit
from feedpipe.stage import Batch, HostBatch, HostStager, Stager, resolve_devices
from feedpipe.stats import FeedStats, StatsRecorder
from feedpipe.writer import SampleWriter, accepts_rng, apply_transform

STATE_VERSION = 1
WORKER_MODES = ("process", "thread")


def _positive_int(name: str, value: Any, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"`{name}`={value!r} must be an integer >= 1; {fix}.")


@dataclasses.dataclass(frozen=True, slots=True)
class FeedOptions:
    """How a `Feeder` batches, orders and stages samples; validated on creation."""

    global_batch_size: int
    """Samples per step across all replicas; must divide evenly among them."""
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
        _positive_int("global_batch_size", self.global_batch_size, "pass the samples per step")
        check_remainder(self.remainder)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"`shuffle`={self.shuffle!r} must be True or False.")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int | np.integer)
            or self.seed < 0
        ):
            raise ValueError(f"`seed`={self.seed!r} must be an integer >= 0.")
        if (
            isinstance(self.workers, bool)
            or not isinstance(self.workers, int | np.integer)
            or self.workers < 0
        ):
            raise ValueError(
                f"`workers`={self.workers!r} must be an integer >= 0: 0 for one background "
                "thread, or the number of worker processes (for example os.cpu_count())."
            )
        _positive_int("depth", self.depth, "use depth=2 to hide one step's transfer")
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

    host: bool
    start: Position
    counters: dict


class Feeder(tf.train.experimental.PythonState):
    """Builds each global batch on the host, splits it per replica, and stages it on each device.

    Iterating yields `Batch`es whose tensors already sit on their devices; each `for` loop runs
    one epoch from the feeder's position (a loop left early resumes where it stopped). Invariant:
    at most `depth` batches wait on each device, and `depth + 2` host slots (allocated once,
    reused) hold everything in flight.
    """

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        devices: Sequence[str] | None = None,
        strategy: tf.distribute.Strategy | None = None,
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
    ):
        self._pipeline: Pipeline | None = None
        self._workers = None
        self._closed = False
        self.options = FeedOptions(
            global_batch_size, remainder, shuffle, seed, workers, depth, worker_mode, timeout_s
        )
        if transform is not None and not callable(transform):
            raise TypeError(
                f"`transform` must be callable or None; got {type(transform).__name__}."
            )
        self.devices = resolve_devices(devices, strategy)
        self.strategy = strategy
        self.split = ReplicaSplit(global_batch_size, len(self.devices))
        self._source = as_source(source)
        dali = hasattr(self._source, "producer")
        if dali and (workers or transform is not None or transpose is not None):
            raise ValueError(
                "A DaliSource decodes and augments in DALI's own threads: pass workers=0, "
                "transform=None and transpose=None, and do that work in the DALI pipeline "
                "(its num_threads sets the parallelism)."
            )
        indexed = hasattr(self._source, "sample")
        if shuffle and not indexed:
            raise ValueError(
                f"`shuffle`=True, but a {type(self._source).__name__} has no indices to shuffle; "
                "shuffle inside the generator, the tf.data.Dataset or the DALI reader "
                "(random_shuffle=True), and pass shuffle=False."
            )
        sample_spec = self._read_spec(transform)
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
                block_size=getattr(self._source, "block_size", 1),
            )
        )
        """The epoch's batches, where the length is known (it applies the remainder rules)."""
        self._sampler = self._plan if indexed else None
        """What chooses the samples of indexed sources; streams keep their own order."""
        writer = SampleWriter(
            self._source, sample_spec, transform, seed, _axes(transpose, sample_spec)
        )
        self.spec = writer.out_spec
        """What each batch holds: the samples after `transform` and `transpose`."""
        rule = Remainder(remainder, global_batch_size)
        self._shared = workers > 0 and worker_mode == "process"
        if dali:
            self._producer = self._source.producer(self.split, self.devices, rule)
        elif workers:
            self._producer = self._start_workers(writer, transform)
        else:
            self._producer = ThreadProducer(writer, global_batch_size, self._sampler, rule)
        self._stats = StatsRecorder(depth)
        self._pools: dict[bool, SlotPool] = {}
        self._position = Position(0, 0)
        self._active: _Pass | None = None
        """The pass being iterated, if any."""

    def _start_workers(self, writer: SampleWriter, transform) -> WorkerProducer:
        from feedpipe import workers as pool

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
            "writer": writer,
            "layouts": {c: SlotLayout(self.spec, self.split, contiguous=c) for c in (False, True)},
            "num_shards": o.workers if self._sampler is None else 1,
        }
        kind = pool.ProcessWorkers if self._shared else pool.ThreadWorkers
        self._workers = kind(o.workers, setup, o.timeout_s)
        return WorkerProducer(
            self._workers,
            self._source,
            o.global_batch_size,
            self._sampler,
            Remainder(o.remainder, o.global_batch_size),
        )

    def _read_spec(self, transform) -> SampleSpec:
        """The spec of what producers will make: the first sample, after `transform`."""
        try:
            if hasattr(self._source, "sample"):
                sample = self._source.sample(0)
            else:
                sample = self._source.first_sample()
        except Exception as error:
            error.add_note(
                "feedpipe: raised while reading sample 0 to learn the structure, shapes and "
                "dtypes of the samples."
            )
            raise
        if transform is not None:
            seed = self.options.seed
            sample = apply_transform(transform, accepts_rng(transform), sample, seed, 0, 0)
        return SampleSpec.of(sample)

    # ---- iteration ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Steps per epoch."""
        if self._plan is None:
            raise TypeError(
                f"The number of steps is unknown: a {type(self._source).__name__} does not say "
                "how many samples it has."
            )
        return len(self._plan)

    def __iter__(self) -> Iterator[Batch]:
        """The batches of the next epoch (or of the rest of an epoch left early)."""
        return self._iterate(host=False)

    def _pool(self, host: bool) -> SlotPool:
        if host not in self._pools:
            layout = SlotLayout(self.spec, self.split, contiguous=host)
            # Besides the staged batches: one the consumer holds, and those being filled.
            capacity = self.options.depth + 1 + self._producer.slots_in_flight
            # Batches handed to tf.data get memory of their own, except from shared slots,
            # which are copied out instead (see HostStager).
            reuse = self._shared or not host
            self._pools[host] = SlotPool(layout, capacity, reuse=reuse, shared=self._shared)
        return self._pools[host]

    def _start(self, host: bool) -> Pipeline:
        if self._pipeline is not None and self._pipeline.host == host:
            return self._pipeline
        self._stop_pipeline()
        self._stats.stream_started()
        pool = self._pool(host)
        stager: Any = (
            HostStager(pool.layout, copy=self._shared)
            if host
            else Stager(self.devices, pool.layout, self.strategy)
        )
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
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def _iterate(self, host: bool) -> Iterator[Batch | HostBatch]:
        """One pass over the rest of the current epoch.

        A loop left early keeps its position (the next loop resumes there). A pass of
        `as_dataset` left early does not count, because TensorFlow prefetches batches the step
        never takes and Keras peeks at a batch to build the model: the next pass starts again
        where it began. Such a pass, if TensorFlow finalises it late, is superseded.
        """
        if self._closed:
            raise RuntimeError("The feeder is closed; build a new fp.Feeder to read again.")
        if self._active is not None:
            if not (host and self._active.host):
                raise RuntimeError(
                    "The feeder is already being iterated; finish or break that loop first "
                    "(one consumer per feeder)."
                )
            self._stop_pipeline()
            self._abandon(self._active)
        this = _Pass(host, self._position, self._stats.consumer_counters())
        self._active = this
        pipeline = self._start(host)
        finished = False
        try:
            while self._active is this:
                staged = pipeline.handoff.staged
                asked = time.perf_counter()
                item = pipeline.get()
                got = time.perf_counter()
                if isinstance(item, EpochEnd):
                    self._stats.loop_ended(asked)
                    self._position = Position(item.epoch + 1, 0)
                    if item.dropped and self._plan is None:
                        warn_dropped(item.epoch, item.dropped, stacklevel=2)
                    finished = True
                    return
                if isinstance(item, Failure):
                    self.close()
                    raise item.error
                self._stats.taken(asked=asked, got=got, occupancy=staged, samples=item.num_valid)
                self._position = Position(item.epoch, item.step + 1)
                yield item
                del item  # the slot returns when the consumer drops the batch, not this frame
        finally:
            # At interpreter exit a suspended loop is finalised after modules are torn down.
            if self._active is this and not sys.is_finalizing():
                self._active = None
                if not finished:
                    self._stats.loop_ended()
                    # Staged batches are dropped and made again by the next pass.
                    self._stop_pipeline()
                    if host:
                        self._abandon(this)

    def _abandon(self, left: _Pass) -> None:
        """Undoes a pass of `as_dataset` left early: its batches will be made and taken again."""
        self._position = left.start
        self._stats.restore_consumer(left.counters)

    def as_dataset(self) -> tf.data.Dataset:
        """A `tf.data.Dataset` of global batches for `model.fit` and other wrappers.

        Each complete pass over the dataset is the feeder's next epoch; a pass left early does
        not count (see `_iterate`). With `remainder="pad"` an `(x, y)` source gets a third
        element, `sample_weight`: 0 on padding rows, and real rows scaled by
        `global_batch_size / num_valid` so the batch's mean loss is the mean over its real
        samples (an `(x, y, w)` source has its weights scaled the same way).
        """
        size = self.options.global_batch_size
        signature = self.spec.unflatten(
            [
                tf.TensorSpec((size, *leaf.shape), tf.as_dtype(leaf.dtype))
                for leaf in self.spec.leaves
            ]
        )
        weighting = self._weighting()
        if weighting == "add":
            signature = (*signature, tf.TensorSpec((size,), tf.float32))

        def generate():
            for batch in self._iterate(host=True):
                yield self._with_weights(batch, weighting)

        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
        # A feeder left or restored mid-epoch first serves the rest of that epoch: shorter.
        if self._plan is not None and self._position_state()["step"] == 0:
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(self)))
        return dataset

    def _weighting(self) -> str | None:
        """How padding is weighted in `as_dataset`: add a sample_weight, scale one, or none."""
        treespec = self.spec.treespec
        if self.options.remainder != "pad" or treespec.kind != optree.PyTreeKind.TUPLE:
            return None
        return {2: "add", 3: "scale"}.get(treespec.num_children)

    def _with_weights(self, batch: HostBatch, weighting: str | None) -> Any:
        sample = self.spec.unflatten(batch.arrays)
        if weighting is None:
            return sample
        size = self.options.global_batch_size
        weights = np.zeros(size, np.float32)
        real = slice(batch.num_valid) if batch.real is None else batch.real
        weights[real] = size / batch.num_valid
        if weighting == "add":
            return (*sample, weights)
        x, y, given = sample
        return x, y, (np.asarray(given, np.float32) * weights).astype(given.dtype, copy=False)

    # ---- diagnostics and state ------------------------------------------------------------

    def stats(self) -> FeedStats:
        """A snapshot of how well the step has been fed so far."""
        pools = self._pools.values()
        return self._stats.snapshot(
            overflow_slots=sum(pool.overflow_allocations for pool in pools),
            slots_allocated=sum(pool.allocated + pool.overflow_allocations for pool in pools),
        )

    def _staged(self) -> int:
        """Batches staged and not yet taken (0 when no loop runs): `diagnose`'s occupancy."""
        return 0 if self._pipeline is None else self._pipeline.handoff.staged

    def get_state(self) -> dict:
        """The consumer's position, as a small JSON-serialisable dict."""
        state = self._position_state()
        state_at = getattr(self._producer, "state_at", None)
        if state_at is not None:  # a DALI source: its pipelines' own checkpoints
            state["source"] = state_at((state["epoch"], state["step"]))
        return state

    def _position_state(self) -> dict:
        """The state without what the source adds: what a restore must agree with."""
        epoch, step = self._position
        if self._plan is not None and step >= len(self._plan):
            epoch, step = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "step": step,
            "dataset_length": self._source.length,
            "global_batch_size": self.options.global_batch_size,
            "num_replicas": self.split.num_replicas,
            "seed": self.options.seed,
            "shuffle": self.options.shuffle,
        }

    def set_state(self, state: dict) -> None:
        """Continues the stream exactly where `state` was taken; staged batches are remade."""
        if self._active is not None:
            raise RuntimeError(
                "set_state() was called while a loop over the feeder is running; restore "
                "before the loop starts (or break out of it first)."
            )
        mine = self._position_state()
        if hasattr(self._producer, "state_at"):
            mine["source"] = None
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"The state lacks {', '.join(missing)}; pass a dict from get_state().")
        for field in (
            "version",
            "dataset_length",
            "global_batch_size",
            "num_replicas",
            "seed",
            "shuffle",
        ):
            if state[field] != mine[field]:
                raise ValueError(
                    f"Cannot restore: the state has {field}={state[field]!r} but this feeder has "
                    f"{field}={mine[field]!r}; build the feeder with the same {field}."
                )
        for field in ("epoch", "step"):
            if not isinstance(state[field], int) or state[field] < 0:
                raise ValueError(f"The state's {field}={state[field]!r} must be an integer >= 0.")
        self._stop_pipeline()
        self._position = Position(state["epoch"], state["step"])
        if hasattr(self._producer, "restore"):
            self._producer.restore(tuple(self._position), state["source"])

    def serialize(self) -> bytes:
        """For `tf.train.Checkpoint`: the state as JSON."""
        return json.dumps(self.get_state()).encode()

    def deserialize(self, string_value: bytes) -> None:
        """For `tf.train.Checkpoint`: restores a state written by `serialize`."""
        self.set_state(json.loads(string_value))

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the background thread and the workers, and frees staged batches; idempotent."""
        self._closed = True
        self._stop_pipeline()
        if self._workers is not None:
            self._workers.close()
            self._producer.close()
        self._pools.clear()  # staged batches still held keep their own slots alive

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
