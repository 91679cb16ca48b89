"""A small CNN trained on a JPEG image folder that feedpipe's worker processes decode and augment.

    python examples/images_with_workers.py [DIR] [--epochs 8]

DIR holds one folder per class (as `make_image_folder.py` writes); without it, 5 classes x 80
images are generated into a temporary folder. Two worker processes run `augment` on each file:
Pillow decode, random resized crop, random horizontal flip, normalise, the same steps as a DALI
pipeline's `fn.decoders.image`, `fn.random_resized_crop` and `fn.crop_mirror_normalize`. They
write straight into the host buffers the feeder splits and stages on four logical CPU devices
under MirroredStrategy, and `fp.train` trains on the staged batches.

Workers never import TensorFlow: the source (a plain list of (path, label)) and `augment` use
only Pillow and numpy; defined in a script, they travel to the workers by value (cloudpickle).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import math
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from make_image_folder import make_image_folder
from PIL import Image

import feedpipe as fp

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


def main(root, epochs):
    classes = sorted(p for p in Path(root).iterdir() if p.is_dir())
    files = [(str(f), c) for c, folder in enumerate(classes) for f in sorted(folder.glob("*.jpg"))]
    print(f"{len(files)} JPEGs in {len(classes)} classes under {root}")

    cpu = tf.config.list_physical_devices("CPU")[0]  # four logical CPU devices stand in for GPUs
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((SIZE, SIZE, 3)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(len(classes)),
            ]
        )
        optimizer = keras.optimizers.Adam(3e-3)  # made in the scope, its variables are mirrored

    started = time.perf_counter()
    with fp.Feeder(
        files, 64, strategy=strategy, workers=2, shuffle=True, transform=augment
    ) as feeder:
        print(feeder)
        fp.train(
            model,
            feeder,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=optimizer,
            metrics=["accuracy"],
            epochs=epochs,
            verbose=2,
        )
        stats = feeder.stats()
    print(f"{stats}\n{epochs} epochs in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", metavar="DIR", nargs="?", help="image folder (default: generate)")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    if args.root is not None:
        main(args.root, args.epochs)
    else:
        with tempfile.TemporaryDirectory(prefix="feedpipe-images-") as root:
            make_image_folder(root)
            main(root, args.epochs)
