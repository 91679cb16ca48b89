"""What the two image examples share: four logical CPU devices under MirroredStrategy, a small
CNN, `fp.train` on a feeder of the image folder, and the command line. Only the feeder differs:
`images_with_workers.py` decodes with Pillow in worker processes, `images_with_dali.py` with
DALI pipelines.
"""

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import keras
import tensorflow as tf
from make_image_folder import make_image_folder
from pillow_augment import SIZE

import feedpipe as fp

MakeFeeder = Callable[[str, tf.distribute.Strategy], fp.Feeder]
"""(image folder, strategy) -> the feeder of (image, label) batches."""


def image_files(root: str) -> list[tuple[str, int]]:
    """(path, label) of every JPEG under `root`, one folder per class, in label order."""
    classes = sorted(p for p in Path(root).iterdir() if p.is_dir())
    return [(str(f), c) for c, folder in enumerate(classes) for f in sorted(folder.glob("*.jpg"))]


def train(root: str, epochs: int, make_feeder: MakeFeeder) -> None:
    files = image_files(root)
    classes = len({label for _, label in files})
    print(f"{len(files)} JPEGs in {classes} classes under {root}")

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
                keras.layers.Dense(classes),
            ]
        )
        optimizer = keras.optimizers.Adam(3e-3)  # made in the scope, its variables are mirrored

    started = time.perf_counter()
    with make_feeder(root, strategy) as feeder:
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


def main(description: str, make_feeder: MakeFeeder) -> None:
    """The examples' command line: `[DIR] [--epochs 8]`, generating a folder without DIR."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("root", metavar="DIR", nargs="?", help="image folder (default: generate)")
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    if args.root is not None:
        train(args.root, args.epochs, make_feeder)
    else:
        with tempfile.TemporaryDirectory(prefix="feedpipe-images-") as root:
            make_image_folder(root)
            train(root, args.epochs, make_feeder)
