"""Sources, generators and transforms for worker processes: numpy only, never TensorFlow.

Worker processes unpickle these by module reference, so this module must not import
TensorFlow (`tests.fakes` does). Every field of sample `i` holds `i`, as in `tests.fakes`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

FEATURE_SHAPE = (3,)


def index_sample(index: int) -> tuple[np.ndarray, np.int64]:
    return np.full(FEATURE_SHAPE, index, np.float32), np.int64(index)


class IndexSource:
    """Map-style: sample `i` is `index_sample(i)`."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return index_sample(index)


class SourceBroke(Exception):
    """Raised by `FailingSource`: a type of its own, so tests can see it survive the trip."""


class FailingSource(IndexSource):
    """Raises `SourceBroke` at sample `fail_at`."""

    def __init__(self, length: int, fail_at: int):
        super().__init__(length)
        self.fail_at = fail_at

    def __getitem__(self, index: int):
        if index == self.fail_at:
            raise SourceBroke(f"sample {index} is broken")
        return super().__getitem__(index)


class UnpicklableError(Exception):
    """An error whose constructor takes two arguments, so it cannot be unpickled."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


class UnpicklableFailingSource(IndexSource):
    def __getitem__(self, index: int):
        if index == 5:
            raise UnpicklableError("left", "right")
        return super().__getitem__(index)


class ActionSource(IndexSource):
    """At sample `at`, does `action`: "hang", "exit" (code 3), "kill" (SIGKILL) or "segv"."""

    def __init__(self, length: int, at: int, action: str):
        super().__init__(length)
        self.at = at
        self.action = action

    def __getitem__(self, index: int):
        if index == self.at:
            if self.action == "hang":
                while True:
                    time.sleep(0.1)
            if self.action == "exit":
                os._exit(3)
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.action == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
        return super().__getitem__(index)


class SleepySource(IndexSource):
    """Each sample costs `sample_s` of GIL-free time."""

    def __init__(self, length: int, sample_s: float):
        super().__init__(length)
        self.sample_s = sample_s

    def __getitem__(self, index: int):
        time.sleep(self.sample_s)
        return super().__getitem__(index)


class TensorFlowProbe(IndexSource):
    """Sample `i` is `(i, 1 if TensorFlow is loaded in the process that made it else 0)`."""

    def __getitem__(self, index: int):
        return np.int64(index), np.int8("tensorflow" in sys.modules)


class PidSource(IndexSource):
    """Sample `i` is `(i, pid of the process that made it)`."""

    def __getitem__(self, index: int):
        return np.int64(index), np.int64(os.getpid())


class WrongShapeAt(IndexSource):
    """Sample `at` has features of shape (4,) instead of (3,)."""

    def __init__(self, length: int, at: int):
        super().__init__(length)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            return np.zeros(4, np.float32), np.int64(index)
        return super().__getitem__(index)


def sharded_range(length: int):
    """A generator function: shard `s` of `n` yields `index_sample(i)` for i = s, s+n, ..."""

    def generate(shard: int, num_shards: int):
        for index in range(shard, length, num_shards):
            yield index_sample(index)

    return generate


def uneven_shards(shard: int, num_shards: int):
    """Shard `s` yields 5 * (s + 1) + 3 samples, numbered so that ids never repeat."""
    for k in range(5 * (shard + 1) + 3):
        yield index_sample(1000 * shard + k)


def add_noise(sample, rng):
    """A transform that asks for an rng: adds one draw to the features."""
    features, label = sample
    return features + np.float32(rng.uniform()), label


def to_channels_last(sample):
    """Makes features of shape (2, 3, 4) from a sample's index (values encode their position)."""
    _, label = sample
    image = np.arange(24, dtype=np.float32).reshape(2, 3, 4) + 100 * float(label)
    return {"image": image, "label": label}


def drop_label(sample):
    """A transform that returns another structure than the sample's: just the features."""
    return sample[0]
