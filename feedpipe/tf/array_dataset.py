"""`as_dataset()` over arrays in memory: TensorFlow's own threads gather each batch's rows, in
the feeder's order, with no Python per batch.

The feeder begins a pass as its iterator starts (`Consumer.gathered_pass`) and plans its
batches' rows and real rows a chunk of steps at a time as tf.data reads them
(`Sampler.padded_chunks`), so the first batch waits for one chunk whatever the epoch's length.
A `map` gathers the rows from tensors made once per feeder, one batch at a time in the thread
of the `prefetch` after it, and a last, synchronous `map` runs as the consumer takes
each batch: it refuses a batch of a pass that was superseded and records which batch was taken
(`TakenBatches`). From that record the feeder learns the consumer's position, as the batches it
hands out tell it on its own path, and its stats: the steps and samples taken, the time from one
taken batch to the next and the time spent gathering, all timed in the graph (by Python's clock
where TensorFlow's op determinism refuses `tf.timestamp`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import optree
import tensorflow as tf

from feedpipe._internals.tf import generator_dataset, op_determinism_enabled, single_device_map
from feedpipe.core.weights import broadcastable, row_weights

GATHER_MAX_BYTES = 1 << 30
"""Arrays above this many bytes in all stay on the feeder's own path. Gathering copies them
into TensorFlow's memory once, a second copy of the data for the life of the feeder (numpy
memory cannot be shared: TensorFlow needs it aligned), and a dataset graph that holds them
cannot be serialised past protobuf's 2 GiB. Below it, the copy is what `from_tensor_slices`
makes too."""

STEPS_PER_PASS = 1 << 32
"""A taken batch is recorded as one int64, `pass * STEPS_PER_PASS + step + 1`, so that the pass
and the step are written together."""

_OPEN, _LAST = 0, 1
_LAST_AT, _STEP_US, _INTERVALS, _BUSY_US, _MADE = 2, 3, 4, 5, 6
"""Keys of what is timed in the graph: when the last batch was taken, the microseconds from
one batch taken to the next of the same pass and how many such intervals, the microseconds
spent gathering, and the real samples gathered."""


class TakenBatches:
    """What the consumer of one dataset's gathered passes took, kept where TensorFlow's threads
    write it: the pass whose batches may still be taken, and the last batch taken (its pass
    and step).

    A lookup table rather than a `tf.Variable`: under a strategy's scope a variable would be
    made one per replica.
    """

    def __init__(self):
        with tf.device("/cpu:0"):
            self._table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
        self.python_clock = op_determinism_enabled()
        """The graph reads Python's clock: with op determinism enabled
        (`tf.config.experimental.enable_op_determinism`), TensorFlow refuses `tf.timestamp`.
        Chosen as the dataset is made, since a choice in the graph would cost every batch."""

    def _read(self, key: int) -> int:
        return int(self._table.lookup(tf.constant(key, tf.int64)))

    def _write(self, key: int, value: int) -> None:
        self._table.insert(tf.constant(key, tf.int64), tf.constant(value, tf.int64))

    def open(self, number: int) -> None:
        """Pass `number` begins: the batches of every earlier pass are refused from now on."""
        self._write(_OPEN, number)

    def revoke(self, number: int) -> None:
        """Pass `number` has ended: its batches still waiting are refused when taken."""
        if self._read(_OPEN) == number:
            self._write(_OPEN, 0)

    def after(self, number: int) -> int | None:
        """The step after the last batch of pass `number` taken; None if none was."""
        pass_taken, step = divmod(self._read(_LAST), STEPS_PER_PASS)
        return step if pass_taken == number else None

    @staticmethod
    def tags(number: int, first: int, count: int) -> np.ndarray:
        """What each of `count` batches of pass `number`, from step `first` on, records once
        taken."""
        return number * STEPS_PER_PASS + np.arange(first, first + count, dtype=np.int64) + 1

    def measured(self) -> dict[str, int]:
        """What the graph has timed so far (see `_LAST_AT`), for `Feeder.stats()`."""
        keys = {"step_us": _STEP_US, "intervals": _INTERVALS, "busy_us": _BUSY_US, "made": _MADE}
        return {name: self._read(key) for name, key in keys.items()}

    def _get(self, key: int) -> tf.Tensor:
        return self._table.lookup(tf.constant(key, tf.int64))

    def _add(self, values: dict[int, tf.Tensor]) -> tf.Operation:
        """In the graph: adds each value to its key's (one thread writes each key)."""
        keys = list(values)
        sums = [self._get(key) + values[key] for key in keys]
        return self._table.insert(tf.constant(keys, tf.int64), tf.stack(sums))

    def take(self, tag: tf.Tensor, message: str) -> tf.Operation:
        """In the dataset's graph: refuses the batch `tag` if its pass is no longer open, with
        `message`, then records it as taken, and the time since the pass's previous batch."""
        is_open = tf.equal(self._get(_OPEN), tag // STEPS_PER_PASS)
        with tf.control_dependencies([tf.debugging.Assert(is_open, [message])]):
            now = self.microseconds()
            same_pass = tf.equal(self._get(_LAST) // STEPS_PER_PASS, tag // STEPS_PER_PASS)
            since = tf.where(same_pass, now - self._get(_LAST_AT), tf.constant(0, tf.int64))
            counted = self._add({_STEP_US: since, _INTERVALS: tf.cast(same_pass, tf.int64)})
        with tf.control_dependencies([counted]):
            keys = tf.constant([_LAST, _LAST_AT], tf.int64)
            return self._table.insert(keys, tf.stack([tag, now]))

    def made(self, started: tf.Tensor, samples: tf.Tensor) -> tf.Operation:
        """In the dataset's graph: a batch of `samples` real samples gathered, begun at
        `started` (`microseconds()`)."""
        return self._add({_BUSY_US: self.microseconds() - started, _MADE: samples})

    def microseconds(self) -> tf.Tensor:
        """In the graph: now, in microseconds since the epoch."""
        if self.python_clock:
            return tf.numpy_function(_python_microseconds, [], tf.int64, stateful=True)
        return tf.cast(tf.timestamp() * 1e6, tf.int64)  # float64 seconds keep them exactly


def _python_microseconds() -> np.int64:
    """Now, in microseconds since the epoch, as `tf.timestamp()` reads it."""
    return np.int64(time.time_ns() // 1000)


def gathered_dataset(
    feeder: Any,
    signature: Any,
    how: str | None,
    steps: int | None,
    superseded: str,
    *,
    real_only: bool = False,
) -> tf.data.Dataset:
    """The batches of `feeder`'s next pass of `steps` steps (None: the rest of its epoch),
    gathered by TensorFlow, each element `signature` (with an added sample weight where `how`
    is "add"; with `real_only`, a batch's real rows alone); a batch of a superseded pass
    raises `superseded` when taken."""
    tensors = feeder._source_tensors()
    # The dataset's own record: a pass of another dataset ends this one's through
    # `TakenBatches.revoke`, as any pass's end does.
    taken, spec = TakenBatches(), feeder.spec
    size = feeder.options.global_batch_size
    labels = optree.tree_structure(signature[1]) if how == "add" else None
    label_ranks = [] if labels is None else [y.shape.rank for y in optree.tree_leaves(signature[1])]
    owner = weakref.ref(feeder)  # TensorFlow keeps `chunks` for the life of the process

    def chunks() -> Iterator[list[np.ndarray]]:
        """Begins the pass, then gives its steps a chunk at a time (see `_chunks`)."""
        this = owner()
        if this is None:
            raise RuntimeError(
                "The fp.Feeder of this dataset was closed and collected; keep the feeder "
                "while its dataset is read."
            )
        if op_determinism_enabled() and not taken.python_clock:
            raise RuntimeError(
                "tf.config.experimental.enable_op_determinism() was called after this dataset "
                "was made: its graph times batches with tf.timestamp, which TensorFlow then "
                "refuses. Make the dataset again, feeder.as_dataset(), or enable op determinism "
                "first, at the start of the program."
            )
        this_pass = this._consumer.gathered_pass(steps, taken)
        planned = this._consumer.gathered_rows(this_pass)
        return _chunks(planned, this_pass.number, size, label_ranks)

    def gather(tag, rows, valid, *weights):
        if real_only:  # the real rows are the first `valid`, as a slot pads
            rows = rows[:valid]
        started = taken.microseconds()
        with tf.control_dependencies([started]):
            arrays = [tf.gather(tensor, rows) for tensor in tensors]
        with tf.control_dependencies(arrays):
            made = taken.made(started, valid)
        with tf.control_dependencies([made]):
            sample = spec.unflatten([tf.identity(array) for array in arrays])
        if labels is None:
            return tag, sample
        return tag, (*sample, optree.tree_unflatten(labels, list(weights)))

    def take_batch(tag, sample):
        with tf.control_dependencies([taken.take(tag, superseded)]):
            return tf.nest.map_structure(tf.identity, sample)

    chunk = [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, size], tf.int64)]
    chunk += [tf.TensorSpec([None], tf.int64)]
    chunk += [tf.TensorSpec([None, size] + [1] * (rank - 1), tf.float32) for rank in label_ranks]
    # A generator's iterator keeps its own pass and order (its start begins the pass, its end
    # frees them), with no function of the dataset instantiated per pass. tf.data cannot
    # serialise it, so it skips its static rewrites: none applies to these maps (stateful,
    # and prefetching is set here), as on the handed-over path.
    planned = generator_dataset(chunks, tuple(chunk)).unbatch()
    # One gather at a time is enough: a batch's gather (~50 µs for 400 KB; TensorFlow's Gather
    # spreads a large one over its intra-op threads) is far shorter than a step that uses it,
    # and a second at once (a parallel map runs as many as there are cores without autotuning)
    # only takes a core from the step on a small machine.
    gathered = single_device_map(planned, gather).prefetch(feeder.options.depth)
    return single_device_map(gathered, take_batch, in_calling_thread=True)


def _chunks(
    planned: Iterator[tuple[int, np.ndarray, np.ndarray]],
    number: int,
    size: int,
    label_ranks: list[int],
) -> Iterator[list[np.ndarray]]:
    """The chunks of steps `planned` for pass `number` (see `Sampler.padded_chunks`), each as
    its steps' tags (see `TakenBatches.tags`), rows and counts of real rows, and the weights of
    each label field of rank in `label_ranks`, for batches of `size` rows."""
    for first, rows, valid in planned:
        chunk = [TakenBatches.tags(number, first, len(rows)), rows, valid]
        if label_ranks:
            by_count = {v: row_weights(size, slice(v), v, size) for v in set(valid.tolist())}
            weights = np.stack([by_count[v] for v in valid.tolist()])
            chunk += [broadcastable(weights, rank) for rank in label_ranks]
        yield chunk


def weight_spec(label: tf.TensorSpec) -> tf.TensorSpec:
    """The sample weight of a label field: `[batch, 1, ..., 1]`, of the label's rank."""
    return tf.TensorSpec((label.shape[0],) + (1,) * (label.shape.rank - 1), tf.float32)
