"""A source for the GPU tests whose bytes are a function of the index, and its checksum on the
host: numpy only.

Worker processes unpickle `Images` by module reference, so this module imports no framework
(the test modules import torch or JAX at the top).
"""

from __future__ import annotations

import numpy as np

MODULUS = 2**31 - 1
"""The checksum's terms are taken modulo this prime: a sum of a few million of them fits int64
exactly, on any device."""


class Images:
    """`length` samples whose bytes are a function of their index: `(x, y)` with `y = index`."""

    def __init__(self, length: int, shape: tuple[int, ...]):
        self.length = length
        self.shape = shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        rng = np.random.default_rng(index)
        return rng.standard_normal(self.shape, np.float32), np.int32(index)


def checksum_weights(count: int) -> np.ndarray:
    """The weight of each of a row's `count` 32-bit words: 1 to 1000, by position."""
    return np.arange(count, dtype=np.int64) % 1000 + 1


def checksum_on_host(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, sum((bits of x as uint32) * weight mod MODULUS) + y, as int64."""
    bits = x.view(np.uint32).reshape(x.shape[0], -1).astype(np.int64)
    return ((bits * checksum_weights(bits.shape[1])) % MODULUS).sum(axis=1) + y.astype(np.int64)


def expected_checksums(source: Images, ids) -> np.ndarray:
    """What `checksum_on_host` gives for the samples `ids` of `source`, one sample at a time."""
    return np.concatenate(
        [
            checksum_on_host(source[int(i)][0][None], np.asarray([i], np.int64))
            for i in np.asarray(ids).tolist()
        ]
    )
