"""A small CNN trained on a JPEG image folder that feedpipe's worker processes decode and augment.

    python examples/images_with_workers.py [DIR] [--epochs 8]

DIR holds one folder per class (as `make_image_folder.py` writes); without it, 5 classes x 80
images are generated into a temporary folder. Two worker processes run `augment` on each file:
Pillow decode, random resized crop, random horizontal flip, normalise, the same steps as a DALI
pipeline's `fn.decoders.image`, `fn.random_resized_crop` and `fn.crop_mirror_normalize`. They
write straight into the host buffers the feeder splits and stages on four logical CPU devices
under MirroredStrategy, and `fp.train` trains on the staged batches.

Workers never import TensorFlow: the source is a plain list of (path, label), and `augment`
lives in `pillow_augment.py`, which imports only Pillow and numpy; the workers import it from
there (they get this process's `sys.path`). `kernels_bench/images.py` times the same function.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import tempfile
import time
from pathlib import Path

import keras
import tensorflow as tf
from make_image_folder import make_image_folder
from pillow_augment import SIZE, augment

import feedpipe as fp


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
