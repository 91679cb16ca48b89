"""What TensorFlow tests share: the framework-free sources of `tests.worker_fakes`, named here
too, and helpers to read batches back, a Keras `PyDataset`, a model whose step sleeps, and logical
CPU devices.

Every field of sample `i` holds the value `i`, so the ids a batch delivered can be read from any
field, and a row whose fields disagree is a row mixed up by the pipeline.
"""

from __future__ import annotations

import collections
import importlib.util
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from tests.worker_fakes import (
    FEATURE_SHAPE,
    CountingSource,
    FailingSource,
    SlowSource,
    SourceBroke,
    TransformBroke,
    index_arrays,
    index_sample,
    sharded_range,
)

__all__ = [
    "EXAMPLES",
    "FEATURE_SHAPE",
    "CountingSource",
    "FailingSource",
    "SlowSource",
    "SourceBroke",
    "TransformBroke",
    "all_ids",
    "configure_logical_cpus",
    "epoch_ids",
    "host_batch_ids",
    "index_arrays",
    "index_pydataset",
    "index_sample",
    "load_example",
    "real_ids",
    "regression_data",
    "replica_ids",
    "replica_masks",
    "sharded_range",
    "sleeping_model",
]


def _leaves(structure) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in tf.nest.flatten(structure)]


def _row_ids(leaves: list[np.ndarray]) -> np.ndarray:
    """The index every row carries; fails if any field of a row holds another value."""
    first = leaves[0].reshape(len(leaves[0]), -1)[:, 0]
    for leaf in leaves:
        flat = leaf.reshape(len(leaf), -1)
        np.testing.assert_array_equal(
            flat, np.broadcast_to(first[:, None], flat.shape).astype(flat.dtype)
        )
    return first.astype(np.int64)


def replica_ids(batch) -> list[np.ndarray]:
    """Per replica, the sample index of every row (padding rows included), in row order."""
    return [_row_ids(_leaves(replica)) for replica in batch.replicas]


def replica_masks(batch) -> list[np.ndarray]:
    return [np.asarray(mask) for mask in batch.masks]


def real_ids(batch) -> list[int]:
    """The sample indices of the rows whose mask is True, in global row order."""
    ids = []
    for rows, mask in zip(replica_ids(batch), replica_masks(batch), strict=True):
        ids.extend(rows[mask].tolist())
    return ids


def all_ids(batch) -> list[int]:
    """Every row's sample index, padding included, in global row order."""
    return [i for rows in replica_ids(batch) for i in rows.tolist()]


def host_batch_ids(element) -> np.ndarray:
    """Every row's sample index in one element of `feeder.as_dataset()` (weights left out)."""
    leaves = _leaves(element)
    return _row_ids(leaves[:2] if len(leaves) > 2 else leaves)


def epoch_ids(feeder) -> list[int]:
    """The real sample indices of one full `for` loop over `feeder`."""
    return [i for batch in feeder for i in real_ids(batch)]


def index_pydataset(length: int, batch_size: int, broken=()):
    """A `keras.utils.PyDataset` of `index_sample` rows, counting reads of each of its batches;
    the batches numbered in `broken` raise `SourceBroke` when read."""
    import keras

    class IndexPyDataset(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.batch_reads: collections.Counter[tuple[int, int]] = collections.Counter()
            """Reads of each batch, keyed by (epochs ended so far, batch number)."""
            self.epochs_ended = 0

        def __len__(self) -> int:
            return -(-length // batch_size)

        def __getitem__(self, number: int):
            if not 0 <= number < len(self):
                raise IndexError(number)
            self.batch_reads[self.epochs_ended, number] += 1
            if number in broken:
                raise SourceBroke(f"batch {number} is broken")
            return index_arrays(length)[0][number * batch_size : (number + 1) * batch_size], (
                np.arange(length, dtype=np.int64)[number * batch_size : (number + 1) * batch_size]
            )

        def on_epoch_end(self):
            self.epochs_ended += 1

    return IndexPyDataset()


class Sleep(keras.layers.Layer):
    """Passes its input through after sleeping `seconds`, once per step, inside the graph."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def _sleep(self, _):
        time.sleep(self.seconds)
        return np.float32(0)

    def call(self, x):
        slept = tf.numpy_function(self._sleep, [x], tf.float32, stateful=True)
        slept.set_shape(())
        return x + slept


def sleeping_model(step_s: float, steps_per_execution: int = 1) -> keras.Model:
    """A Dense model whose compiled step also sleeps `step_s` (an emulated accelerator)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), Sleep(step_s), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=False, steps_per_execution=steps_per_execution)
    return model


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """The module of `examples/<name>.py` (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configure_logical_cpus(count: int) -> None:
    """Splits the CPU into `count` logical devices; must run before TensorFlow initialises."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) == count:
        return
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )


def regression_data(length: int) -> tuple[np.ndarray, np.ndarray]:
    """`length` samples of a noisy linear map from 6 features to 1: what the training tests fit."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(length, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(length, 1))).astype(np.float32)
    return x, y
