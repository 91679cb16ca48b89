"""A small CNN trained on a JPEG image folder that DALI pipelines decode and augment on the CPU.

    python examples/images_with_dali.py [DIR] [--epochs 8]

DIR holds one folder per class (as `make_image_folder.py` writes); without it, 5 classes x 80
images are generated into a temporary folder. `feedpipe.dali.DaliSource` builds one CPU-only
DALI pipeline per replica (its shard of the files): `fn.readers.file`, `fn.decoders.image`,
`fn.random_resized_crop` to 64 x 64, a random horizontal flip and ImageNet normalisation in
`fn.crop_mirror_normalize`, the same steps as `images_with_workers.py` runs in Pillow. DALI's
own threads run them; the feeder hands each pipeline's outputs to TensorFlow where DALI left
them (no copy) on four logical CPU devices under MirroredStrategy, and `fp.train` trains on the
staged batches (the model, loop and command line are `image_cnn.py`'s, shared with the workers
example).

The reader shuffles (`random_shuffle=True`) and pads each shard's last batch
(`pad_last_batch=True`, which `DaliSource` requires): the feeder masks the padded rows, so every
file counts once per epoch. Needs `pip install feedpipe[dali]`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from image_cnn import main
from nvidia.dali import fn, pipeline_def, types
from pillow_augment import MEAN, SIZE, STD

import feedpipe as fp
from feedpipe.dali import DaliSource


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
            mean=MEAN.tolist(),
            std=STD.tolist(),
            dtype=types.FLOAT,
            output_layout="HWC",
        )
        return pixels, fn.cast(labels, dtype=types.INT32)

    return images


def dali_feeder(root, strategy):
    """One CPU-only DALI pipeline per replica, each reading its shard of the folder."""
    return fp.Feeder(DaliSource(image_pipeline(root), num_threads=2, seed=0), 64, strategy=strategy)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], dali_feeder)
