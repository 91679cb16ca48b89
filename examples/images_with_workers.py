"""A small CNN trained on a JPEG image folder that feedpipe's worker processes decode and augment.

    python examples/images_with_workers.py [DIR] [--epochs 8]

DIR holds one folder per class (as `make_image_folder.py` writes); without it, 5 classes x 80
images are generated into a temporary folder. Two worker processes run `augment` on each file:
Pillow decode, random resized crop, random horizontal flip, normalise, the same steps as a DALI
pipeline's `fn.decoders.image`, `fn.random_resized_crop` and `fn.crop_mirror_normalize`. They
write straight into the host buffers the feeder splits and stages on four logical CPU devices
under MirroredStrategy, and `fp.train` trains on the staged batches (the model, loop and
command line are `image_cnn.py`'s, shared with the DALI example).

Workers never import TensorFlow: the source is a plain list of (path, label), and `augment`
lives in `pillow_augment.py`, which imports only Pillow and numpy; the workers import it from
there (they get this process's `sys.path`). `kernels_bench/images.py` times the same function.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from image_cnn import image_files, main
from pillow_augment import augment

import feedpipe as fp


def workers_feeder(root, strategy):
    """(path, label) pairs, decoded and augmented by `augment` in two worker processes."""
    return fp.Feeder(
        image_files(root), 64, strategy=strategy, workers=2, shuffle=True, transform=augment
    )


if __name__ == "__main__":
    main(__doc__.splitlines()[0], workers_feeder)
