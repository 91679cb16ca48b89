"""The image-folder dataset of the examples: the generator writes readable JPEGs per class,
the same bytes for the same seed, and worker processes decoding them with Pillow deliver
every file exactly once per epoch, on each replica's device."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import tensorflow as tf
from PIL import Image

import feedpipe as fp
from tests.fakes import load_example
from tests.image_fakes import DecodeCropFlip, IndexedFiles

generator = load_example("make_image_folder")


def test_generator_writes_readable_jpegs_per_class(tmp_path):
    files = generator.make_image_folder(tmp_path, classes=3, per_class=4, size=32, seed=1)
    assert files == sorted(files)
    assert collections.Counter(label for _, label in files) == {0: 4, 1: 4, 2: 4}
    assert {str(p) for p in tmp_path.rglob("*") if p.is_file()} == {p for p, _ in files}
    sizes = set()
    for path, label in files:
        assert Path(path).parent.name == generator.SHAPES[label]
        with Image.open(path) as image:
            assert (image.format, image.mode) == ("JPEG", "RGB")
            image.load()
            sizes.add(image.size)
        assert all(0.8 * 32 - 1 <= side <= 1.5 * 32 + 1 for side in image.size)
    assert len(sizes) > 1  # sizes vary, so each crop is resized differently


def test_same_seed_writes_the_same_bytes(tmp_path):
    options = {"classes": 2, "per_class": 3, "size": 24}
    first = generator.make_image_folder(tmp_path / "a", seed=3, **options)
    again = generator.make_image_folder(tmp_path / "b", seed=3, **options)
    other = generator.make_image_folder(tmp_path / "c", seed=4, **options)

    def contents(files):
        return [Path(path).read_bytes() for path, _ in files]

    assert contents(first) == contents(again)
    assert all(a != b for a, b in zip(contents(first), contents(other), strict=True))


def test_workers_deliver_every_file_once_per_epoch(tmp_path, strategy, devices):
    files = generator.make_image_folder(tmp_path, classes=3, per_class=7, size=24)
    size, global_batch = 16, 8  # 21 files: the last batch of each epoch has 3 padded rows
    orders = []
    with fp.Feeder(
        IndexedFiles(files),
        global_batch,
        strategy=strategy,
        workers=2,
        shuffle=True,
        transform=DecodeCropFlip(size),
    ) as feeder:
        for _ in range(2):
            delivered = []
            for batch in feeder:
                for device, (images, labels, indices), mask in zip(
                    devices, batch.replicas, batch.masks, strict=True
                ):
                    for tensor in (images, labels, indices):
                        assert tensor.device.endswith(device.replace("/cpu", "device:CPU"))
                    real = mask.numpy()
                    for label, index in zip(
                        labels.numpy()[real], indices.numpy()[real], strict=True
                    ):
                        assert label == files[index][1]
                        delivered.append(int(index))
                images = tf.concat([replica[0] for replica in batch.replicas], axis=0)
                assert images.shape == (global_batch, size, size, 3)
                assert images.dtype == tf.float32
                assert np.ptp(images.numpy()) > 0.1  # decoded pixels, not an empty buffer
            assert sorted(delivered) == list(range(len(files)))
            orders.append(delivered)
    assert orders[0] != orders[1]  # each epoch is shuffled anew
