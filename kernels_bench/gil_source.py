"""Map-style sources for `kernels_bench.workers`, `kernels_bench.auto_workers` and
`kernels_bench.diagnosis_matrix`: each sample costs a known time of one kind of work.

This module imports only numpy and the standard library: worker processes unpickle these
sources by module reference (`kernels_bench.gil_source.GilSource`) and must never import
TensorFlow. Each source calibrates its work once, at construction, in the process that builds
it; the calibrated amount (an iteration count, a buffer size) travels with the pickle, so every
process and every peer does exactly the same work per sample.

* `GilSource`: about 1 ms per sample of an integer-arithmetic loop, which holds the GIL
  throughout: threads of one process cannot run it in parallel.
* `GilFreeSource`: about 1 ms per sample of `hashlib.sha256` over one buffer, which releases
  the GIL while it hashes: threads can run it in parallel.
* `SleepSource`: a wait of `sample_s` per sample and almost no CPU, as a slow disk or a remote
  store costs: threads wait in parallel, far beyond the cores.
* `NumpySource`: about `sample_s` of numpy (`np.sort` of one buffer), which releases the GIL.
* `MixedSource`: half a wait, half GIL-holding Python.

Both return `(x, y)`: `x` float32 (32, 32, 3) filled deterministically from the index, `y` an
int64 label. `make_batch` is the serial loop every peer without its own batching runs: 64
samples read one by one, then `np.stack`; `timed_batches` runs it in a bare worker process.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import numpy as np

SAMPLE_SHAPE = (32, 32, 3)
BATCH = 64
"""Samples per global batch in `make_batch`."""
NUM_CLASSES = 10
_PATTERN = np.arange(np.prod(SAMPLE_SHAPE), dtype=np.float32).reshape(SAMPLE_SHAPE) / 4096.0


def make_sample(index: int) -> tuple[np.ndarray, np.int64]:
    """The sample at `index`: a fixed pattern shifted by `index`, and the label `index % 10`."""
    x = _PATTERN + np.float32(index % 1000)
    return x, np.int64(index % NUM_CLASSES)


def spin(iterations: int) -> int:
    """Pure-Python integer arithmetic that holds the GIL for `iterations` loop turns."""
    acc = 0
    for k in range(iterations):
        acc = (acc * 31 + k) & 0xFFFFFFFF
    return acc


def _typical(fn, arg, trials: int = 9, calls: int = 20) -> float:
    """The time of one `fn(arg)`: the median over `trials` spaced 10 ms apart, each timing
    `calls` calls in a row.

    The median of spaced trials, not the fastest: on virtual CPUs the same Python loop runs
    now and then ~1.5x faster than usual for a moment, and a calibration on such a moment
    would make samples take ~1.5 ms most of the time.
    """
    times = []
    for _ in range(trials):
        time.sleep(0.01)
        started = time.perf_counter()
        for _ in range(calls):
            fn(arg)
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


class GilSource:
    """`length` samples, each costing about `sample_s` of GIL-holding Python code."""

    kind = "GIL-bound (pure-Python integer loop)"

    def __init__(self, length: int, sample_s: float = 0.001):
        self.length = length
        self.iterations = 5_000
        for _ in range(2):  # a first guess from a probe, then refined at about the target
            per_iteration_s = _typical(spin, self.iterations) / self.iterations
            self.iterations = max(1, round(sample_s / per_iteration_s))
        self.calibrated_s = _typical(spin, self.iterations)
        """What one sample's work took when calibrated (see `_typical`)."""

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        spin(self.iterations)
        return make_sample(int(index))

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "iterations": self.iterations,
            "calibrated_sample_s": self.calibrated_s,
            "length": self.length,
        }


class _BufferWork:
    """`length` samples, each costing about `sample_s` of `_work` over one buffer of `size`
    items, calibrated once where it is built; the buffer is made on first use in each process
    (not pickled)."""

    kind: str
    size_key: str
    """The name `as_dict` gives the buffer's size."""
    first_size: int
    least_size: int

    def __init__(self, length: int, sample_s: float = 0.001):
        self.length = length
        self.size = self.first_size
        for _ in range(2):  # a first guess from a probe, then refined at about the target
            per_item_s = _typical(self._work, self._make(self.size)) / self.size
            self.size = max(self.least_size, round(sample_s / per_item_s))
        self._buffer = None
        self.calibrated_s = _typical(self._work, self.buffer)

    @staticmethod
    def _make(size: int):
        raise NotImplementedError

    @staticmethod
    def _work(buffer) -> object:
        raise NotImplementedError

    @property
    def buffer(self):
        if self._buffer is None:
            self._buffer = self._make(self.size)
        return self._buffer

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buffer": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        self._work(self.buffer)
        return make_sample(int(index))

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            self.size_key: self.size,
            "calibrated_sample_s": self.calibrated_s,
            "length": self.length,
        }


class GilFreeSource(_BufferWork):
    """About `sample_s` a sample of `hashlib.sha256` over one buffer (`hashlib` releases the
    GIL while it hashes more than 2 KiB)."""

    kind = "GIL-releasing (hashlib.sha256 over one buffer)"
    size_key, first_size, least_size = "buffer_bytes", 1 << 20, 4096

    @staticmethod
    def _make(size: int) -> bytes:
        return bytes(size)

    @staticmethod
    def _work(buffer: bytes) -> bytes:
        return hashlib.sha256(buffer).digest()


class SleepSource:
    """`length` samples, each a wait of `sample_s` (`time.sleep`): time, not CPU."""

    kind = "waiting (time.sleep)"

    def __init__(self, length: int, sample_s: float = 0.001):
        self.length = length
        self.sample_s = sample_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        time.sleep(self.sample_s)
        return make_sample(int(index))

    def as_dict(self) -> dict:
        return {"kind": self.kind, "sample_s": self.sample_s, "length": self.length}


class NumpySource(_BufferWork):
    """About `sample_s` a sample of `np.sort` over one float64 buffer (numpy releases the GIL
    while it sorts)."""

    kind = "GIL-free numpy (np.sort of one buffer)"
    size_key, first_size, least_size = "values", 4096, 1024

    @staticmethod
    def _make(size: int) -> np.ndarray:
        return np.random.default_rng(0).random(size)

    @staticmethod
    def _work(values: np.ndarray) -> np.ndarray:
        return np.sort(values, kind="stable")


class MixedSource:
    """`length` samples, each half a wait and half GIL-holding Python, `sample_s` in all."""

    kind = "mixed (half time.sleep, half a pure-Python loop)"

    def __init__(self, length: int, sample_s: float = 0.001):
        self.waiting = SleepSource(length, sample_s / 2)
        self.working = GilSource(length, sample_s / 2)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        time.sleep(self.waiting.sample_s)
        spin(self.working.iterations)
        return make_sample(int(index))

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "wait_s": self.waiting.sample_s,
            "iterations": self.working.iterations,
            "length": self.length,
        }


KINDS = {"sleep": SleepSource, "gil": GilSource, "numpy": NumpySource, "mixed": MixedSource}
"""The four kinds of source a diagnosis must tell apart, by the names the benchmarks use."""


def make_batch(source, number: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batch `number` of `source`: its samples read one by one and stacked."""
    first = number * BATCH
    samples = [source[i] for i in range(first, first + BATCH)]
    return np.stack([x for x, _ in samples]), np.stack([y for _, y in samples])


def timed_batches(source, first_batch: int, count: int) -> tuple[int, float]:
    """Makes batches `first_batch`, ..., `first_batch + count - 1` of `source` with
    `make_batch` and drops them; returns (samples made, seconds taken). What a bare worker
    process does, with no pipeline around it."""
    started = time.perf_counter()
    for number in range(first_batch, first_batch + count):
        make_batch(source, number)
    return count * BATCH, time.perf_counter() - started


class Holding:
    """`source` holding `nbytes` of numpy arrays besides (in 64 MiB arrays, as a dataset class
    holding its data would): what a worker must be sent before it reads any sample."""

    def __init__(self, source, nbytes: int):
        self.source = source
        self.nbytes = nbytes
        chunk = 64 << 20
        self.arrays = [
            np.ones(min(chunk, nbytes - lo) // 4, np.float32) for lo in range(0, nbytes, chunk)
        ]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        return self.source[index]
