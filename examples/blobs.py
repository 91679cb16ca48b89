"""The map-style dataset of `torch_loop.py` and `torch_ddp.py`: noisy points around 4 centres.

Any object with `__len__` and `__getitem__` is a map-style dataset, for feedpipe as for
`DataLoader`, and a `torch.utils.data.Dataset` subclass is one too. This one imports only numpy:
feedpipe's worker processes are fresh interpreters that import `Blobs` by reference from this
module (they get the parent's `sys.path`), so they start without importing torch, which takes
seconds in each.
"""

import numpy as np

CLASSES, FEATURES = 4, 16


class Blobs:
    """Sample i: a point around the centre of class i % 4, made when it is read (the per-sample
    work a `DataLoader`'s workers would do); the same point every time it is read."""

    def __init__(self, length: int = 1000, seed: int = 0):
        self.length = length
        rng = np.random.default_rng(seed)
        self.centres = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        label = index % CLASSES
        noise = np.random.default_rng(index).normal(size=FEATURES).astype(np.float32)
        return self.centres[label] + noise, np.int64(label)
