"""A Python source of images that costs CPU per sample, and the inputs each peer builds over it.

`ImageSource` is the source of the GPU benchmarks' fit and train parts (`gpu_fit.py`,
`keras_jax_fit.py`, `torch_gpu.py`); `pydataset`, `grain_dataset` and `feeder_input` are the
peers' inputs over a map-style source. This module imports only numpy and the standard library
at the top: feedpipe's worker processes unpickle `ImageSource` from it and never import a
framework.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from kernels_bench.gil_source import _typical, spin

SAMPLE_SHAPE = (96, 96, 3)
NUM_CLASSES = 10
CONV_WIDTHS = (32, 64, 128, 256)
"""The convnet's channels, one stride-2 3x3 convolution each (Keras in `keras_fit`, torch in
`torch_gpu.py`)."""


class ImageSource:
    """`length` float32 images with int32 labels, each costing about `sample_s` of CPU in Python.

    The cost is a GIL-holding integer loop (`gil_source.spin`) plus building the image, as a
    decode and augment written in Python would hold the interpreter. The loop's length is
    calibrated once, in the process that builds the source, and travels with the pickle, so
    every process and every peer does the same work per sample. `image(i)` alone is free of
    the loop: `arrays()` builds the same images in memory for `fit(x, y)`.
    """

    def __init__(self, length: int, sample_s: float, shape: tuple[int, ...] = SAMPLE_SHAPE):
        self.length = length
        self.shape = tuple(shape)
        self._pattern: np.ndarray | None = None
        self.iterations = 0
        self.build_s = _typical(self.__getitem__, 0)
        """What building one image alone took (the part of a sample that is not the loop)."""
        if sample_s > self.build_s:
            self.iterations = 2_000
            per_iteration_s = _typical(spin, self.iterations) / self.iterations
            for _ in range(2):  # a first guess from a probe, then refined at about the target
                self.iterations = max(0, round((sample_s - self.build_s) / per_iteration_s))
                measured = _typical(self.__getitem__, 0)
                if self.iterations:
                    per_iteration_s = max(measured - self.build_s, 1e-9) / self.iterations
        self.calibrated_s = _typical(self.__getitem__, 0)
        """What one sample took when calibrated."""

    def prefix(self, length: int) -> ImageSource:
        """The first `length` samples, each costing what this source's do."""
        other = copy.copy(self)
        other.length = length
        return other

    @property
    def pattern(self) -> np.ndarray:
        """The base image, made on first use in each process (not pickled)."""
        if self._pattern is None:
            size = math.prod(self.shape)
            self._pattern = (np.arange(size, dtype=np.float32) / size).reshape(self.shape)
        return self._pattern

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pattern": None}

    def __len__(self) -> int:
        return self.length

    def image(self, index: int) -> np.ndarray:
        return self.pattern + np.float32((index % 251) / 251.0)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        index = int(index)
        spin(self.iterations)
        return self.image(index), np.int32(index % NUM_CLASSES)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample in memory, made without the per-sample cost: `(x, y)`."""
        count = self.length
        x = np.empty((count, *self.shape), np.float32)
        for i in range(count):
            x[i] = self.image(i)
        return x, (np.arange(count) % NUM_CLASSES).astype(np.int32)

    def as_dict(self) -> dict:
        return {
            "kind": "GIL-holding Python loop + image build per sample",
            "shape": list(self.shape),
            "iterations": self.iterations,
            "build_s": self.build_s,
            "calibrated_sample_s": self.calibrated_s,
            "length": self.length,
        }


def make_batch(source: ImageSource, number: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `number` of `source`: its samples read one by one and stacked (PyDataset's)."""
    samples = [source[i] for i in range(number * batch, (number + 1) * batch)]
    return np.stack([x for x, _ in samples]), np.stack([y for _, y in samples])


def pydataset(source: ImageSource, batch: int, workers: int):
    """A `keras.utils.PyDataset` whose batch `i` stacks samples `i*batch ...` of `source`."""
    import keras

    class SourceBatches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=max(workers, 1), use_multiprocessing=workers > 0)

        def __len__(self):
            return len(source) // batch

        def __getitem__(self, number):
            return make_batch(source, number, batch)

    return SourceBatches()


def grain_dataset(source: ImageSource, batch: int, workers: int):
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():
        # Grain reads its absl flags when it starts workers; outside `absl.app.run` (and
        # without TensorFlow, whose import parses them) nobody has: take their defaults.
        flags.FLAGS.mark_as_parsed()

    dataset = grain.MapDataset.source(source).batch(batch, drop_remainder=True).to_iter_dataset()
    if workers:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return dataset


def have_grain() -> bool:
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


def feeder_input(source: ImageSource, batch: int, workers: int, seed: int):
    import jax

    import feedpipe as fp

    return fp.Feeder(source, batch, devices=jax.devices()[:1], workers=workers, seed=seed)
