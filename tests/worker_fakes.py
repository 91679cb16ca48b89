"""Fake sources, generators and transforms whose samples carry their own index: numpy only.

Every field of sample `i` made here holds the value `i` (features filled with it, label = it),
so the ids a batch delivered can be read from any field, and a row whose fields disagree is a
row mixed up by the pipeline. Worker processes unpickle these by module reference, and
`tests/core` and `tests/jax_layer` run where TensorFlow is not installed, so this module imports
no framework; `tests.fakes` names the ones TensorFlow tests use beside its TensorFlow helpers.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time

import numpy as np

FEATURE_SHAPE = (3,)
KEPT: list = []
"""Sources that keep themselves alive (`ActionSource(..., action="keep")`)."""


def index_sample(index: int, label_dtype: type = np.int64) -> tuple[np.ndarray, np.integer]:
    """Sample `index`: `(features filled with index, label=index)`; labels are int64 unless
    `label_dtype` says otherwise (np.int32 on JAX without x64, which refuses unknown int64s)."""
    return np.full(FEATURE_SHAPE, index, np.float32), label_dtype(index)


def index_arrays(length: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole dataset of `index_sample`s as `(features [N, 3], labels [N])`."""
    labels = np.arange(length, dtype=np.int64)
    features = np.repeat(labels.astype(np.float32)[:, None], FEATURE_SHAPE[0], axis=1)
    return features, labels


def index_pairs(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples that carry their own index in JAX's default 32-bit types: `x[i] = [i, i]`,
    `y[i] = i`."""
    index = np.arange(length)
    return np.stack([index, index], 1).astype(np.float32), index.astype(np.int32)


def sharded_range(length: int, label_dtype: type = np.int64):
    """A generator function for `fp.from_generator`: shard `s` of `n` yields `index_sample(i)`
    for i = s, s+n, ... below `length`."""

    def generate(shard: int, num_shards: int):
        for index in range(shard, length, num_shards):
            yield index_sample(index, label_dtype)

    return generate


def uneven_shards(shard: int, num_shards: int):
    """Shard `s` yields 5 * (s + 1) + 3 samples, numbered so that ids never repeat."""
    for k in range(5 * (shard + 1) + 3):
        yield index_sample(1000 * shard + k)


class IndexSource:
    """Map-style: sample `i` is `index_sample(i)`."""

    def __init__(self, length: int, label_dtype: type = np.int64):
        self.length = length
        self.label_dtype = label_dtype

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return index_sample(index, self.label_dtype)


class CountingSource(IndexSource):
    """An `IndexSource` that counts how often each index is read, and by which threads (it
    holds a lock, so it cannot be sent to a worker process)."""

    def __init__(self, length: int):
        super().__init__(length)
        self.reads: collections.Counter[int] = collections.Counter()
        self.reader_threads: set[str] = set()
        self._lock = threading.Lock()

    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        with self._lock:
            self.reads[index] += 1
            self.reader_threads.add(threading.current_thread().name)
        return sample


class SourceBroke(Exception):
    """Raised by `FailingSource`: a type of its own, so tests can see it survive the trip."""


class TransformBroke(ArithmeticError):
    """Raised by the tests' transforms: a type of its own, so tests can see it survive."""


class FailingSource(IndexSource):
    """Raises `SourceBroke` at sample `fail_at`."""

    def __init__(self, length: int, fail_at: int):
        super().__init__(length)
        self.fail_at = fail_at

    def __getitem__(self, index: int):
        if index == self.fail_at:
            raise SourceBroke(f"sample {index} is broken")
        return super().__getitem__(index)


class SlowSource(IndexSource):
    """Each sample costs `delay_s` of GIL-free time (an expensive decode)."""

    def __init__(self, length: int, delay_s: float):
        super().__init__(length)
        self.delay_s = delay_s

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return super().__getitem__(index)


class EmptyArraySource(IndexSource):
    """Holds an empty numpy array (say, no class weights), its only array: sent to workers,
    it takes a shared buffer of 0 bytes."""

    def __init__(self, length: int):
        super().__init__(length)
        self.class_weights = np.array([])


class AddressSpaceLimited(IndexSource):
    """Samples of 1 MiB, in a worker whose address space is limited, from the moment the
    source is loaded there, to what it uses plus 16 MiB (as `ulimit -v` would): a host slot
    of 32 samples or more cannot be mapped there (ENOMEM)."""

    HEADROOM_BYTES = 16 << 20

    def __setstate__(self, state):
        import resource

        self.__dict__.update(state)
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * resource.getpagesize()
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (used + self.HEADROOM_BYTES, hard))

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return np.full(1 << 18, index, np.float32), np.int64(index)


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
    """At sample `at`, does `action`: "hang", "exit" (code 3), "kill" (SIGKILL), "segv", or
    "keep" (keeps itself alive in this module, as a cache of user code would)."""

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
            if self.action == "keep":
                KEPT.append(self)
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


class OSErrorSource(IndexSource):
    """Raises FileNotFoundError at sample `fail_at`, as a source reading a missing file does."""

    def __init__(self, length: int, fail_at: int):
        super().__init__(length)
        self.fail_at = fail_at

    def __getitem__(self, index: int):
        if index == self.fail_at:
            raise FileNotFoundError(2, "No such file or directory", f"/data/{index}.npy")
        return super().__getitem__(index)


class StopIterationSource(IndexSource):
    """Raises StopIteration at sample `at`, as code ending its data with `next()` does."""

    def __init__(self, length: int, at: int):
        super().__init__(length)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            raise StopIteration("no more rows")
        return super().__getitem__(index)


class RaisingBaseException(IndexSource):
    """Raises `kind` (a BaseException, e.g. SystemExit) at sample `at`."""

    def __init__(self, length: int, at: int, kind: type[BaseException]):
        super().__init__(length)
        self.at = at
        self.kind = kind

    def __getitem__(self, index: int):
        if index == self.at:
            raise self.kind(f"raised at sample {index}")
        return super().__getitem__(index)


class Custom(BaseException):
    """A BaseException of the user's own."""


class LazyFileSource(IndexSource):
    """Opens its file on first use and keeps it open, as feedpipe's own message advises: an
    object that has read a sample cannot be pickled."""

    def __init__(self, length: int, path: str):
        super().__init__(length)
        self.path = path
        self.file = None

    def __getitem__(self, index: int):
        if self.file is None:
            self.file = open(self.path, "rb")  # noqa: SIM115 (kept open on purpose)
        return super().__getitem__(index)


class NotInTheTrainingProcess(IndexSource):
    """Refuses to be read in a process that has TensorFlow loaded (the training process)."""

    def __getitem__(self, index: int):
        if "tensorflow" in sys.modules:
            raise RuntimeError(f"sample {index} was read in the training process")
        return super().__getitem__(index)


class HangsOnLoad(IndexSource):
    """Hangs while it is unpickled in a worker (as a source that connects to a server might)."""

    def __setstate__(self, state):
        while True:
            time.sleep(0.1)


class FailsOnLoad(IndexSource):
    """Raises OSError while it is unpickled in a worker (a missing file opened at load)."""

    def __setstate__(self, state):
        raise FileNotFoundError(2, "No such file or directory", "/data/index.bin")


class GILHolder(IndexSource):
    """At sample `at`, runs one C call that holds the GIL for minutes (a regex that
    backtracks exponentially)."""

    def __init__(self, length: int, at: int):
        super().__init__(length)
        self.at = at

    def __getitem__(self, index: int):
        if index == self.at:
            import re

            re.match(r"(a+)+$", "a" * 40 + "b")
        return super().__getitem__(index)


def import_a_package_named_tensorflow(sample, fake_root: str):
    """A transform that imports `tensorflow` (a stand-in package under `fake_root`, so the
    test does not pay for loading the real one in every worker)."""
    if fake_root not in sys.path:
        sys.path.insert(0, fake_root)
    import tensorflow  # noqa: F401

    return sample


class BadSample(Exception):
    pass


class FailsOn:
    """A transform that raises on the samples `bad` (labels are indices), counting its calls
    where it runs in this process."""

    def __init__(self, bad):
        self.bad = frozenset(bad)
        self.calls: dict[int, int] = {}

    def __call__(self, sample):
        index = int(sample[1])
        self.calls[index] = self.calls.get(index, 0) + 1
        if index in self.bad:
            raise BadSample(f"sample {index} is corrupt")
        return sample


class UnprintableError(Exception):
    """An error whose `__str__` raises, as a user's exception class can by mistake."""

    def __str__(self):
        raise ValueError("this __str__ is broken")


class UnpicklableUnprintableError(UnprintableError):
    """An `UnprintableError` holding a lock, so it cannot be pickled back from a worker."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


class FailsUnprintably(FailsOn):
    """A transform that raises `error` (an `UnprintableError` by default) on the samples `bad`."""

    def __init__(self, bad, error: type[Exception] = UnprintableError):
        super().__init__(bad)
        self.error = error

    def __call__(self, sample):
        try:
            return super().__call__(sample)
        except BadSample:
            raise self.error() from None


class FailsOnce(FailsOn):
    """A transform whose samples `bad` raise on their first call only (a read that timed out
    once): made again, they succeed."""

    def __call__(self, sample):
        index = int(sample[1])
        if index in self.bad and self.calls.get(index, 0) >= 1:
            self.calls[index] += 1
            return sample
        return super().__call__(sample)


class FrameworkProbe(IndexSource):
    """Sample `i` is `(i, how many of TensorFlow, Keras, JAX and PyTorch the process that made
    it has imported)`."""

    def __getitem__(self, index: int):
        loaded = {"tensorflow", "keras", "jax", "torch"} & set(sys.modules)
        return np.int64(index), np.int8(len(loaded))


class MarkedSource(IndexSource):
    """An `IndexSource` that `LeftoverProbe` looks for."""


class LeftoverProbe(IndexSource):
    """Sample `i` is `(i, how many MarkedSource objects the process that made it holds)`."""

    def __getitem__(self, index: int):
        import gc

        gc.collect()
        held = sum(type(thing) is MarkedSource for thing in gc.get_objects())
        return np.int64(index), np.int64(held)


class HeldArraySource:
    """Map-style over an array held in the source (`row_bytes` a row): sample `i` is
    `(row i, filled with i; i)`, so a worker reads it from the shared copy of the array."""

    def __init__(self, length: int, row_bytes: int):
        self.rows = np.empty((length, max(row_bytes // 8, 1)), np.int64)
        self.rows[:] = np.arange(length)[:, None]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return self.rows[index], np.int64(index)


class PlaceProbe(IndexSource):
    """Sample `i` is `(i, the number in ./offset.txt plus $FEEDPIPE_TEST_OFFSET)`, read where
    the sample is made."""

    def __getitem__(self, index: int):
        with open("offset.txt") as file:
            offset = int(file.read())
        return np.int64(index), np.int64(offset + int(os.environ["FEEDPIPE_TEST_OFFSET"]))


class ImportingSource(IndexSource):
    """An `IndexSource` that imports `module` where it makes a sample, as a source using a
    framework would."""

    def __init__(self, length: int, module: str):
        super().__init__(length)
        self.module = module

    def __getitem__(self, index: int):
        import importlib

        importlib.import_module(self.module)
        return super().__getitem__(index)
