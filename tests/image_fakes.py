"""A JPEG-file source and a Pillow transform for worker processes: Pillow and numpy only.

Worker processes unpickle these by module reference, so this module must not import
TensorFlow (`tests.fakes` does). Pillow comes with the test extras (matplotlib needs it).
"""

from __future__ import annotations

import numpy as np
from PIL import Image


class IndexedFiles:
    """Map-style over (path, label) pairs: sample `i` is (path, label, i), so a batch names
    the files it holds."""

    def __init__(self, files: list[tuple[str, int]]):
        self.files = list(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[str, int, int]:
        path, label = self.files[index]
        return path, label, index


class DecodeCropFlip:
    """(path, label, index) -> (size x size x 3 float32 in [-0.5, 0.5], label, index): Pillow
    decode, a random crop of at least half of each side resized to `size`, a random flip."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, sample, rng):
        path, label, index = sample
        with Image.open(path) as image:
            image = image.convert("RGB")
        width, height = image.size
        w, h = rng.integers(width // 2, width + 1), rng.integers(height // 2, height + 1)
        left, top = rng.integers(width - w + 1), rng.integers(height - h + 1)
        box = (left, top, left + w, top + h)
        pixels = np.asarray(image.resize((self.size,) * 2, Image.BILINEAR, box=box), np.float32)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        return pixels / 255 - 0.5, np.int32(label), np.int64(index)
