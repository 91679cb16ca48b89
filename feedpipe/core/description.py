"""What a feeder is, as plain data: the answer of `Feeder.describe()`.

A description says what the feeder was built as (where its samples come from, who makes them,
how they are batched, which devices they are staged on, in what host memory), never how it is
doing: that is `feeder.stats()`. Diagnostics and reports read it instead of the feeder's
insides. It holds no framework object (devices are their names), so `to_dict()` is JSON as it
is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from feedpipe.core.sources import (
    ArraySource,
    GeneratorSource,
    MapSource,
    PyDatasetSource,
    SampleSpec,
    Source,
    TFDatasetSource,
)

SOURCE_KINDS = ((ArraySource, "arrays"), (MapSource, "map"), (PyDatasetSource, "pydataset"))
"""Core's indexed sources and the word `SourceDescription.kind` uses for each."""
STREAM_KINDS = ((GeneratorSource, "generator"), (TFDatasetSource, "tf.data"))
"""Core's streams and their words."""


@dataclasses.dataclass(frozen=True, slots=True)
class SourceDescription:
    """Where the feeder's samples come from."""

    kind: str
    """"arrays" (numpy arrays in memory), "map" (an object with `__len__` and `__getitem__`),
    "pydataset" (a `keras.utils.PyDataset`), "generator" (`fp.from_generator`), "tf.data" (a
    `tf.data.Dataset`) or "dali" (a `feedpipe.dali.DaliSource`); another source class by its
    name."""
    length: int | None
    """Samples per epoch; None where the source does not say (a generator, a
    `tf.data.Dataset` of unknown cardinality)."""
    indexed: bool
    """Whether any sample can be read on demand, so that the feeder chooses the order (and
    can shuffle, and split each batch among workers)."""
    nbytes: int | None
    """Bytes of the arrays in memory, for "arrays"; None for the others."""
    shards: int | None
    """For "generator": the shards read in rotation (one per worker, else one); None for the
    others."""
    threads: int | None
    """Threads the source runs its own work in (DALI's `num_threads`); None: the feeder's
    thread or workers do the work."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotsDescription:
    """The host slots that batches are made in before they are staged on the devices."""

    count: int
    """Slots in the pool: `depth` staged batches, one the consumer holds, and those being
    filled. 0 where the source keeps its batches in memory of its own (DALI). `as_dataset()`
    keeps a pool of its own of the same size."""
    bytes_per_slot: int
    """Bytes of one slot: this host's rows of a global batch, each replica's region aligned."""
    page_locked: bool
    """Whether the slots are page-locked, so that copies to an accelerator read them at the
    link's rate; before the first loop, whether they will be."""
    page_lock_reason: str | None
    """Why they are not page-locked; None where they are."""


@dataclasses.dataclass(frozen=True, slots=True)
class FeederDescription:
    """What a feeder is: its framework, source, batch, devices, producers, staging and slots.

    A frozen dataclass rather than a dict: each field is documented here and read as an
    attribute that tools check; `to_dict()` gives the plain, JSON-serialisable form.
    """

    framework: str
    """The framework layer that stages the batches: "tensorflow" or "jax"."""
    source: SourceDescription
    """Where the samples come from."""
    fields: tuple[str, ...]
    """Each field of a sample as the step receives it (after `transform` and `transpose`),
    as `name: dtype[shape]`, the batch axis left out."""
    service: str | None
    """Where the per-sample work runs instead of here: the tf.data service dispatcher
    (`grpc://host:port`) or the Ray cluster (`ray`, `ray://host:port`); None where it runs
    here."""
    global_batch_size: int
    """Samples per step across every replica of every host."""
    per_replica_batch_size: int
    """Rows of each global batch that one replica takes."""
    host_batch_size: int
    """Rows of each global batch that this host makes (the global batch on one host)."""
    batch_bytes: int
    """Bytes of this host's rows of one global batch."""
    steps_per_epoch: int | None
    """`len(feeder)`; None where the source's length is unknown, so an epoch ends when the
    stream does."""
    devices: tuple[str, ...]
    """This host's replica devices, by name, in replica order."""
    accelerated: bool
    """Whether a device is an accelerator (not a CPU): batches then cross to it by copy."""
    hosts: int
    """Hosts (processes) sharing each global batch."""
    host: int
    """This host's index among them."""
    workers: int
    """Worker processes or threads making samples; 0: one background thread."""
    worker_mode: str
    """"process" or "thread"."""
    workers_chosen: str | None
    """Where `workers="auto"` picked them: the setting, its predicted rate and what a
    sample was measured to cost (see `feedpipe.core.cost`); None where they were given."""
    gather_threads: int
    """Threads gathering each batch of in-memory arrays without a `transform` (the producer's
    own included), each copying a range of its rows, the next batch's while this one is
    staged; 0 where batches are made otherwise (see `feedpipe.core.gather`). On TensorFlow,
    `as_dataset()` (what `model.fit` reads) gathers such arrays in tf.data's own threads
    instead; these serve the feeder's own loop."""
    gather_chosen: str | None
    """What set `gather_threads`: the cores, the batch's bytes or `FEEDPIPE_GATHER_THREADS`;
    None where batches are made otherwise."""
    depth: int
    """Batches staged on each device ahead of the step."""
    remainder: str
    """The rule for an epoch's last, partial batch: "pad", "drop" or "error"."""
    shuffle: bool
    """Whether each epoch's order is shuffled from (seed, epoch)."""
    seed: int
    """The seed of the order and of each sample's `transform` rng."""
    slots: SlotsDescription
    """The host slots batches are made in."""
    copy_path: str
    """How batches cross from the slots to the devices: "feedpipe streams" (a non-blocking CUDA
    stream of feedpipe's own per device, beside the running step, handed over with DLPack), the
    framework's own copy ("jax.device_put", "tensorflow"), or "none" (CPU devices)."""
    copy_path_reason: str
    """Why that path: what made feedpipe's own streams unavailable, where they are."""

    def to_dict(self) -> dict:
        """Every field, nested descriptions as dicts and tuples as lists: JSON as it is."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def describe_source(source: Source, shards: int) -> SourceDescription:
    """`source` described; `shards`: the generator shards it is read in (its workers)."""
    kind = next(
        (kind for cls, kind in SOURCE_KINDS + STREAM_KINDS if isinstance(source, cls)), None
    )
    if kind is None:
        # A source that makes whole batches in threads of its own is DALI's (feedpipe.dali,
        # which core does not import).
        kind = "dali" if source.own_threads is not None else type(source).__name__
    arrays = source.arrays if isinstance(source, ArraySource) else None
    return SourceDescription(
        kind=kind,
        length=source.length,
        indexed=source.indexed,
        nbytes=None if arrays is None else sum(int(array.nbytes) for array in arrays),
        shards=shards if isinstance(source, GeneratorSource) else None,
        threads=source.own_threads,
    )


def describe_fields(spec: SampleSpec) -> tuple[str, ...]:
    """Each field of `spec` as `name: dtype[shape]`."""
    return tuple(f"{leaf.name}: {leaf.dtype}{list(leaf.shape)}" for leaf in spec.leaves)


def is_cpu(device: Any) -> bool:
    """Whether `device`, a TensorFlow device name or a JAX device, is a CPU."""
    platform = getattr(device, "platform", None)
    return platform == "cpu" if platform is not None else "CPU" in str(device).upper()


def describe_slots(
    count: int, bytes_per_slot: int, framework: str, accelerated: bool, page_lock: Any, pool: Any
) -> SlotsDescription:
    """The slots, and whether they are (or will be) page-locked, and why not.

    `page_lock` is the framework layer's locker (None where it does not page-lock), `pool`
    the slot pool once the first loop made it (None before).
    """
    if count == 0:
        locked, reason = False, "the source keeps its batches in memory of its own: no slot is used"
    elif page_lock is None:
        locked = False
        reason = (
            f"{framework} copies to its devices through its own runtime, which is not asked to "
            "page-lock the slots"
            if accelerated
            else "the devices are CPUs: no batch is copied to an accelerator"
        )
    elif pool is not None:
        locked, reason = pool.page_locked, pool.page_lock_reason
    else:
        locked, reason = page_lock.available, page_lock.reason
    return SlotsDescription(count, bytes_per_slot, locked, reason)
