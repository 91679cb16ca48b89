"""The Pillow transform of `images_with_workers.py`: decode, random resized crop, flip, normalise.

It imports only Pillow and numpy, never TensorFlow: feedpipe's worker processes are fresh
interpreters that import `augment` by reference from this module (they get the parent's
`sys.path`), so they stay free of TensorFlow. `kernels_bench/images.py` times the same function.
The steps match a DALI pipeline's `fn.decoders.image`, `fn.random_resized_crop` and
`fn.crop_mirror_normalize` (see `images_with_dali.py`).
"""

import math

import numpy as np
from PIL import Image

SIZE = 64
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255  # ImageNet's, as DALI examples use
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


def crop_box(width, height, rng, area=(0.25, 1.0), ratio=(3 / 4, 4 / 3)):
    """A random crop of `area` of the image with aspect `ratio` (log-uniform), as
    `fn.random_resized_crop` picks it (its default area starts at 0.08; 0.25 keeps the shape
    in view), or the whole image when 10 tries do not fit."""
    for _ in range(10):
        target = rng.uniform(*area) * width * height
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.integers(width - w + 1), rng.integers(height - h + 1)
            return left, top, left + w, top + h
    return 0, 0, width, height


def augment(sample, rng):
    """(path, label) -> (normalised float32 SIZE x SIZE x 3 crop, label), random by `rng`."""
    path, label = sample
    with Image.open(path) as image:
        image = image.convert("RGB")
    crop = image.resize((SIZE, SIZE), Image.BILINEAR, box=crop_box(*image.size, rng))
    pixels = np.asarray(crop, np.float32)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return (pixels - MEAN) / STD, np.int32(label)
