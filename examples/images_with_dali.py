"""A small CNN trained on a JPEG image folder that DALI pipelines decode and augment on the CPU.

    python examples/images_with_dali.py [DIR] [--epochs 8]

DIR holds one folder per class (as `make_image_folder.py` writes); without it, 5 classes x 80
images are generated into a temporary folder. `feedpipe.dali.DaliSource` builds one CPU-only
DALI pipeline per replica (its shard of the files): `fn.readers.file`, `fn.decoders.image`,
`fn.random_resized_crop` to 64 x 64, a random horizontal flip and ImageNet normalisation in
`fn.crop_mirror_normalize`, the same steps as `images_with_workers.py` runs in Pillow. DALI's
own threads run them; the feeder copies each pipeline's outputs once into its replica's part of
a host slot and stages it on four logical CPU devices under MirroredStrategy, and `fp.train`
trains on the staged batches.

The reader shuffles (`random_shuffle=True`) and pads each shard's last batch
(`pad_last_batch=True`, which `DaliSource` requires): the feeder masks the padded rows, so every
file counts once per epoch. Needs `pip install feedpipe[dali]`.
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
from nvidia.dali import fn, pipeline_def, types

import feedpipe as fp
from feedpipe.dali import DaliSource

SIZE = 64
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]  # ImageNet's, as in images_with_workers.py
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def image_pipeline(root):
    """A DALI pipeline definition over the image folder `root`, for `DaliSource`: the feeder
    calls it once per replica with that replica's `shard_id` and `num_shards`."""

    @pipeline_def
    def images(shard_id, num_shards):
        jpegs, labels = fn.readers.file(
            file_root=root,
            shard_id=shard_id,
            num_shards=num_shards,
            random_shuffle=True,
            pad_last_batch=True,
            name="reader",
        )
        decoded = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        crops = fn.random_resized_crop(
            decoded, size=SIZE, random_area=[0.25, 1.0], random_aspect_ratio=[0.75, 1.333]
        )
        pixels = fn.crop_mirror_normalize(
            crops,
            mirror=fn.random.coin_flip(),
            mean=MEAN,
            std=STD,
            dtype=types.FLOAT,
            output_layout="HWC",
        )
        return pixels, fn.cast(labels, dtype=types.INT32)

    return images


def main(root, epochs):
    classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    print(
        f"{sum(1 for _ in Path(root).glob('*/*.jpg'))} JPEGs in {len(classes)} classes under {root}"
    )

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
    source = DaliSource(image_pipeline(root), num_threads=2, seed=0)
    with fp.Feeder(source, 64, strategy=strategy) as feeder:
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
