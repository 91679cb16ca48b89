"""The TensorFlow feeder: staging on TensorFlow devices, `as_dataset()` for `model.fit`, and
the feeder inside a `tf.train.Checkpoint`.

`fp.Feeder(...)` is this class where `devices` are TensorFlow device strings, `strategy` is a
`tf.distribute` strategy, or TensorFlow is the framework in use (see `feedpipe._frameworks`).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Hashable
from typing import Any

import optree
import tensorflow as tf

from feedpipe import feeder as core
from feedpipe._internals.tf import dataset_pipeline, generator_dataset
from feedpipe.core.sources import ArraySource
from feedpipe.core.stage import HostBatch
from feedpipe.core.weights import row_weights, weighting, with_weights
from feedpipe.passes import SUPERSEDED
from feedpipe.tf.array_dataset import GATHER_MAX_BYTES, gathered_dataset, weight_spec
from feedpipe.tf.keras import class_weighted, keras_batches
from feedpipe.tf.layer import TensorFlowLayer


class Feeder(core.Feeder, tf.train.experimental.PythonState):
    """A feeder whose batches are `tf.Tensor`s on TensorFlow devices (see `feedpipe.Feeder`).

    Being a `PythonState`, it can sit in a `tf.train.Checkpoint` beside the model: the
    checkpoint holds its state, `get_state()`, as JSON. Under a MultiWorkerMirroredStrategy,
    building it checks that every host built a feeder of the same order.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self._datasets: weakref.WeakSet = weakref.WeakSet()
        """The datasets `as_dataset()` made, while they live: what reads this feeder."""
        self._padding: weakref.WeakSet = weakref.WeakSet()
        """Those of them whose last batch is padded to full size (see `_pads`)."""
        self._tensors: list[tf.Tensor] | None = None
        """The source's arrays as tensors, made once, for gathered passes (`_gathers`)."""
        super().__init__(*args, **kwargs)

    def _layer(self, devices: Any, strategy: Any, global_batch_size: int) -> TensorFlowLayer:
        return TensorFlowLayer(devices, strategy, global_batch_size)

    def _keras_batches(
        self, reading: str | None, class_weight: dict | None
    ) -> tf.data.Dataset | tf.distribute.DistributedDataset:
        """What Keras's TensorFlow trainer reads from this feeder (`feedpipe.tf.keras`)."""
        return keras_batches(self, reading=reading, class_weight=class_weight)

    def as_dataset(
        self, *, pad_last: bool | None = None
    ) -> tf.data.Dataset | tf.distribute.DistributedDataset:
        """A `tf.data.Dataset` of global batches for `model.fit` and other wrappers.

        Each complete pass over the dataset is the feeder's next epoch; a pass left early does
        not count (see `Consumer.iterate`). Under `model.fit`, pass
        `callbacks=[feeder.fit_callback()]` so that the feeder's state (and a checkpoint
        holding it) is the batches the step trained on.

        On one host (no strategy, or one such as MirroredStrategy) Keras gets what
        `model.fit(x, y, batch_size=B, shuffle=False)` gives itself on the same rows: an
        uneven last batch goes over as its real rows, a shorter batch, with no added element,
        and an `(x, y, w)` source's weights as they are. BatchNormalization, a "sum" loss,
        `add_loss` and regularizers, History and the metrics then see the samples alone, and
        a custom `train_step` unpacks `x, y = data`.

        `pad_last=True` keeps every batch `global_batch_size` rows (static shapes): the last
        batch is padded and an `(x, y)` source gets a third element, `sample_weight`, 0 on
        padding rows and `global_batch_size / num_valid` on real ones (an `(x, y, w)`
        source's own weights are scaled so). The weighted mean loss is then the real rows'
        mean, but what the weights do not reach counts the padding rows: BatchNormalization's
        statistics, a "sum" loss, `add_loss` and regularizers, unweighted `metrics`, and
        History's loss (which weighs the padded batch as full). Each label field's weight has
        shape `[batch, 1, ..., 1]`, one 1 per dimension of the label's sample, so that it
        broadcasts against per-element losses too.

        Under a MultiWorkerMirroredStrategy the last batch is always padded (`pad_last=None`,
        the default, pads there; `pad_last=False` is refused): each host makes only its
        replicas' rows, through `distribute_datasets_from_function`, and the stream runs on
        from epoch to epoch without end, so that no step pays TensorFlow's all-reduce asking
        whether every host still has data; a shorter last batch would need that all-reduce.
        Take `len(feeder)` steps per epoch from one iterator.

        Arrays in memory read as they are (no `transform`, `transpose` or workers) are
        gathered by TensorFlow's own threads in the feeder's order, with no Python per batch
        (see `feedpipe.tf.array_dataset`); every other source's batches are handed over from the
        feeder's thread, each leasing its host slot to TensorFlow without a copy. The dataset
        runs without tf.data's autotuning (freeing an iterator whose autotuning runs stalled
        ~1 s at many of Keras's epoch boundaries); `with_options` turns it back on.

        The dataset holds the feeder; the feeder does not hold the dataset, so dropping both
        frees the workers and memory.

        For `model.predict` and `model.evaluate` pass the feeder itself: Keras then reads
        each real sample once, with no padding row (see `_dataset`).
        """
        return self._dataset(real_only=not self._pads_last(pad_last), whole=False)

    def _pads_last(self, pad_last: bool | None) -> bool:
        """Whether `as_dataset(pad_last=...)` pads the last batch to full size: on one host
        only when asked; across hosts always (see `as_dataset`)."""
        if pad_last not in (None, True, False):
            raise TypeError(
                f"as_dataset(pad_last=...) takes True, False or None, not {pad_last!r}; pass "
                "pad_last=True for batches of global_batch_size rows every step."
            )
        hosts = self.share.num_hosts > 1
        if hosts and pad_last is False:
            raise ValueError(
                f"as_dataset(pad_last=False) under a MultiWorkerMirroredStrategy of "
                f"{self.share.num_hosts} hosts: the hosts' streams run on without an end, so "
                "every step gives each replica a full batch, and the last batch of an epoch "
                "is padded with zero sample weights. Leave pad_last unset (or pass "
                "pad_last=True) there."
            )
        return hosts if pad_last is None else pad_last

    def _dataset(
        self,
        *,
        real_only: bool,
        whole: bool,
        aside: bool = False,
        class_weight: dict | None = None,
    ) -> tf.data.Dataset | tf.distribute.DistributedDataset:
        """`as_dataset()`, or with `real_only` its batches cut to their real rows and without
        added weights, as Keras's adapter reads it: a padded batch is then a smaller one, as
        `fit(x, y)`'s last batch is (Keras and `tf.distribute` take it), so that the loss, the
        metrics and BatchNormalization see the samples alone, and `predict` and `evaluate`
        predict or count no padding row. With `whole` (Keras's adapter, whose `num_batches`
        says how long Keras's epochs are) each pass is the rest of the feeder's epoch,
        whatever its position, and states no cardinality; with `aside` (`predict`,
        `evaluate`) each pass reads a whole epoch and leaves the position where it was (see
        `Consumer.iterate`). `class_weight` weighs each row by its class, as Keras weighs
        arrays (`feedpipe.keras.arguments`)."""
        self._consumer.fits.end_interrupted()
        self._consumer.end_open_pass()
        self._consumer.fits.entry = "feeder" if whole else "feeder.as_dataset()"
        hosts = self.share.num_hosts > 1
        if real_only and hosts:
            raise ValueError(
                "model.predict(feeder) and model.evaluate(feeder) under a "
                "MultiWorkerMirroredStrategy would read the padding rows of the last batch as "
                "samples; predict and evaluate each host's share from arrays, "
                "model.predict(x_shard), or iterate the feeder and keep the rows batch.masks "
                "marks real."
            )
        rows = self.split.per_replica if hosts else self.options.global_batch_size
        rows = None if real_only else rows
        unflatten = _as_tuples(self.spec).unflatten  # made once: it runs for every batch
        leaves = self.spec.leaves
        signature = unflatten(
            [tf.TensorSpec((rows, *leaf.shape), tf.as_dtype(leaf.dtype)) for leaf in leaves]
        )
        o = self.options
        how = None if real_only else weighting(self.spec, o.remainder, o.errors)
        if how == "add":
            signature = (*signature, optree.tree_map(weight_spec, signature[1]))
        steps = None if hosts or whole else self._consumer.steps_left()
        if self._gathers(how) and not aside:
            dataset = gathered_dataset(self, signature, how, steps, SUPERSEDED, real_only=real_only)
            dataset = class_weighted(dataset, class_weight)
            return self._as_dataset(dataset, steps, padded=not real_only)
        feeder = weakref.ref(self)  # TensorFlow keeps `generate` for the life of the process
        reader = object()  # this dataset's record: its passes are told from another's by it

        def generate():
            this = feeder()
            if this is None:
                raise RuntimeError(
                    "The fp.Feeder of this dataset was closed and collected; keep the feeder "
                    "while its dataset is read."
                )
            if not hosts:
                kind = "aside" if aside else "fit"
                batches = this._consumer.iterate(kind, host=True, steps=steps, reader=reader)
                for batch in batches:
                    yield (
                        _real(batch, unflatten)
                        if real_only
                        else _weighted(this, batch, how, unflatten)
                    )
                return
            per_replica = this.split.per_replica
            while True:  # every epoch, one replica's rows at a time, as the strategy takes them
                for batch in this._consumer.iterate("fit", host=True, reader=reader):
                    sample = _weighted(this, batch, how, unflatten)
                    for lo in range(0, len(batch.arrays[0]), per_replica):
                        yield optree.tree_map(lambda a, lo=lo: a[lo : lo + per_replica], sample)

        dataset = class_weighted(generator_dataset(generate, signature), class_weight)
        if hosts:
            dataset = dataset.apply(
                tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY)
            )
        return self._as_dataset(dataset, steps, padded=not real_only)

    def _as_dataset(
        self, dataset: tf.data.Dataset, steps: int | None, *, padded: bool
    ) -> tf.data.Dataset:
        """`dataset`, of this feeder's batches (`steps` a pass, where known; `padded`: its
        last batch padded to full size), made ready for a strategy and Keras."""
        hosts = self.share.num_hosts > 1
        if steps is not None:
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps))
        options = tf.data.Options()
        # On one host elements are global batches: a strategy splits each among its replicas.
        # (Under a multi-worker strategy the dataset is this host's alone: nothing to shard.)
        policy = tf.data.experimental.AutoShardPolicy.DATA
        options.experimental_distribute.auto_shard_policy = policy
        # The feeder stages `depth` batches ahead in its own thread, or `prefetch(depth)`'s
        # thread gathers them: a prefetch that TensorFlow would add only takes batches before
        # the step asks.
        options.experimental_optimization.inject_prefetch = False
        # Freeing an iterator whose autotuning runs waits for its model thread: ~1 s at many
        # of Keras's epoch boundaries (two iterators made, one freed, each epoch). The feeder
        # sizes its own buffers (`depth`); `with_options` can turn autotuning back on.
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
        dataset._feedpipe_feeder = self  # the feeder lives as long as its dataset
        self._datasets.add(dataset)
        if padded:
            self._padding.add(dataset)
        # Keras's fit(shuffle=True), its default, cannot shuffle a dataset and says so on every
        # fit; the feeder shuffles (fp.Feeder(shuffle=True)), so the warning says nothing here.
        warnings.filterwarnings(
            "ignore",
            message="`shuffle=True` was passed, but will be ignored since the data `x` was "
            "provided as a tf.data.Dataset",
            category=UserWarning,
        )
        if hosts:
            dataset = self._per_host(dataset)
            self._datasets.add(dataset)
            if padded:
                self._padding.add(dataset)
        return dataset

    def _gathers(self, how: str | None = None) -> bool:
        """Whether TensorFlow's own threads gather this feeder's batches (see
        `feedpipe.tf.array_dataset`), weighted as `how` says (`weighting`): arrays in memory up to
        `GATHER_MAX_BYTES`, read as they are, on one host, with no weights of the source's
        own to scale."""
        return (
            self._assembly.rows_as_given
            and isinstance(self._assembly.source, ArraySource)
            and self.share.num_hosts == 1
            and how != "scale"
            and sum(array.nbytes for array in self._assembly.source.arrays) <= GATHER_MAX_BYTES
        )

    def _source_tensors(self) -> list[tf.Tensor]:
        """The source's arrays as tensors on the host, made on first use."""
        if self._tensors is None:
            with tf.device("/cpu:0"):
                self._tensors = [tf.convert_to_tensor(a) for a in self._assembly.source.arrays]
        return self._tensors

    def _pads(self, data: Any) -> bool:
        """Whether `data`, read by a fit, hands Keras this feeder's last batch padded to full
        size: a dataset `as_dataset(pad_last=True)` made (or one across hosts), or one built
        on it."""
        if isinstance(data, Hashable) and data in self._padding:
            return True
        if not isinstance(data, tf.data.Dataset):
            return False
        return any(node in self._padding for node in dataset_pipeline(data))

    def _reads_this(self, data: Any) -> bool:
        """Whether `data` reads this feeder: it, or a dataset built on one it made."""
        if data is self or (isinstance(data, Hashable) and data in self._datasets):
            return True
        if not isinstance(data, tf.data.Dataset):
            return False
        return any(node in self._datasets for node in dataset_pipeline(data))

    def _per_host(self, dataset: tf.data.Dataset) -> tf.distribute.DistributedDataset:
        """`dataset`, this host's replicas' rows, as the strategy's input on this host."""
        host = self.share.host

        def this_host(context: tf.distribute.InputContext) -> tf.data.Dataset:
            if context.input_pipeline_id != host:  # the feeder was built for another strategy
                raise ValueError(
                    f"The strategy asks this host for input pipeline {context.input_pipeline_id} "
                    f"but the feeder makes host {host}'s rows; build the feeder with the "
                    "strategy that reads its dataset."
                )
            return dataset

        return self.strategy.distribute_datasets_from_function(this_host)

    def serialize(self) -> bytes:
        """For `tf.train.Checkpoint`: the state as JSON."""
        return json.dumps(self.get_state()).encode()

    def deserialize(self, string_value: bytes) -> None:
        """For `tf.train.Checkpoint`: restores a state written by `serialize`."""
        self.set_state(json.loads(string_value))


def _as_tuples(spec: Any) -> optree.PyTreeSpec:
    """The structure of `spec`'s samples with their lists made tuples: a `tf.data.Dataset`'s
    elements cannot hold lists, and Keras takes a list `[x, y]` as the tuple `(x, y)`."""

    def tuples(node: Any) -> Any:
        if isinstance(node, list) or (isinstance(node, tuple) and not hasattr(node, "_fields")):
            return tuple(tuples(item) for item in node)
        if isinstance(node, dict):
            return {key: tuples(item) for key, item in node.items()}
        return node

    return optree.tree_structure(tuples(spec.unflatten(list(range(len(spec.leaves))))))


def _real(batch: HostBatch, unflatten: Any) -> Any:
    """The batch's sample (made by `unflatten`), its real rows only."""
    if batch.num_valid == len(batch.arrays[0]):
        return unflatten(batch.arrays)
    real = slice(batch.num_valid) if batch.real is None else batch.real
    return unflatten([array[real] for array in batch.arrays])


def _weighted(feeder: Feeder, batch: HostBatch, how: str | None, unflatten: Any) -> Any:
    """The batch's sample (made by `unflatten`), its padding weighted as `how` says."""
    sample = unflatten(batch.arrays)
    if how is None:
        return sample
    real = slice(batch.num_valid) if batch.real is None else batch.real
    size = feeder.options.global_batch_size
    return with_weights(sample, row_weights(len(batch.arrays[0]), real, batch.num_valid, size), how)
