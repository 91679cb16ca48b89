"""Writes a small JPEG image-folder dataset: one folder per class, learnable, reproducible.

    python examples/make_image_folder.py DIR [--classes 5] [--per-class 80] [--size 64] [--seed 0]

Each class is a shape (bars, circle, cross, ...) drawn in its own hue, at a random place, scale,
rotation and colour jitter, on a noisy background; widths and heights vary from 0.8x to 1.5x
`--size`, so decoding and a random resized crop have real work to do. The files are
DIR/<class>/<index>.jpg, labelled by the class folders' sorted order (as image-folder readers
such as DALI's `fn.readers.file` and Keras's `image_dataset_from_directory` label them). The
same seed writes the same bytes. Other scripts import `make_image_folder` from this file.
"""

from __future__ import annotations

import argparse
import colorsys
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("bars", "circle", "cross", "diamond", "ring", "square", "star", "triangle")
"""The class names, sorted, so a class's label is its index here."""
UPRIGHT = ("bars", "diamond", "square")
"""Shapes told apart by their orientation (a square turned 45 degrees is a diamond): these
turn by at most 15 degrees, the others by any angle."""


def _rectangle(center, half_length, half_width, angle):
    """The corners of a rectangle about `center`, its length along `angle` (radians)."""
    cx, cy = center
    along = (math.cos(angle), math.sin(angle))
    across = (-along[1], along[0])
    return [
        (
            cx + a * half_length * along[0] + b * half_width * across[0],
            cy + a * half_length * along[1] + b * half_width * across[1],
        )
        for a, b in ((-1, -1), (1, -1), (1, 1), (-1, 1))
    ]


def _polygon(center, angle, radii):
    """Corners at equal turns from `angle` (radians), corner k at distance `radii[k]`."""
    cx, cy = center
    turn = 2 * math.pi / len(radii)
    return [
        (cx + r * math.cos(angle + k * turn), cy + r * math.sin(angle + k * turn))
        for k, r in enumerate(radii)
    ]


def _draw_shape(draw, shape, center, radius, angle, colour):
    cx, cy = center
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=colour)
    elif shape == "ring":
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        draw.ellipse(box, outline=colour, width=max(2, round(radius / 3)))
    elif shape in ("square", "diamond"):
        turn = math.pi / 4 if shape == "diamond" else 0.0
        draw.polygon(_rectangle(center, 0.75 * radius, 0.75 * radius, angle + turn), fill=colour)
    elif shape == "triangle":
        draw.polygon(_polygon(center, angle, [radius] * 3), fill=colour)
    elif shape == "star":
        draw.polygon(_polygon(center, angle, [radius, 0.42 * radius] * 5), fill=colour)
    elif shape == "cross":
        for turn in (0.0, math.pi / 2):
            draw.polygon(_rectangle(center, radius, 0.28 * radius, angle + turn), fill=colour)
    elif shape == "bars":  # three parallel bars
        for offset in (-0.6, 0.0, 0.6):
            shift = (-offset * radius * math.sin(angle), offset * radius * math.cos(angle))
            bar = (cx + shift[0], cy + shift[1])
            draw.polygon(_rectangle(bar, radius, 0.17 * radius, angle), fill=colour)


def _image(label: int, classes: int, size: int, rng: np.random.Generator) -> Image.Image:
    width, height = (round(size * s) for s in rng.uniform(0.8, 1.5, 2))
    background = rng.uniform(30, 225) + rng.normal(0, 15, 3)
    pixels = np.broadcast_to(np.clip(background, 0, 255), (height, width, 3))
    image = Image.fromarray(pixels.astype(np.uint8))
    hue = (label / classes + rng.normal(0, 0.025)) % 1.0
    colour = tuple(round(255 * c) for c in colorsys.hsv_to_rgb(hue, *rng.uniform(0.6, 1.0, 2)))
    short = min(width, height)
    center = (
        width / 2 + rng.uniform(-0.15, 0.15) * short,
        height / 2 + rng.uniform(-0.15, 0.15) * short,
    )
    radius = rng.uniform(0.25, 0.4) * short
    shape = SHAPES[label]
    angle = rng.uniform(-0.26, 0.26) if shape in UPRIGHT else rng.uniform(0, 2 * math.pi)
    _draw_shape(ImageDraw.Draw(image), shape, center, radius, angle, colour)
    noisy = np.asarray(image, np.float32) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def make_image_folder(
    root: str | Path, classes: int = 5, per_class: int = 80, size: int = 64, seed: int = 0
) -> list[tuple[str, int]]:
    """Writes `classes` x `per_class` JPEGs to root/<class>/<index>.jpg; returns the sorted
    (path, label) pairs.

    Image `i` of class `c` is drawn from the generator seeded with (seed, c, i), so its bytes
    depend only on those numbers, `classes` (which sets the hues) and `size`.
    """
    if not 2 <= classes <= len(SHAPES):
        raise ValueError(f"`classes`={classes} must be between 2 and {len(SHAPES)} (the shapes).")
    if per_class < 1:
        raise ValueError(f"`per_class`={per_class} must be >= 1.")
    if size < 16:
        raise ValueError(f"`size`={size} must be >= 16 pixels for the shapes to be drawn.")
    files = []
    for label in range(classes):
        folder = Path(root) / SHAPES[label]
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            path = folder / f"{index:04d}.jpg"
            rng = np.random.default_rng([seed, label, index])
            _image(label, classes, size, rng).save(path, quality=90)
            files.append((str(path), label))
    return sorted(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", metavar="DIR", help="folder to write the class folders into")
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--per-class", type=int, default=80)
    parser.add_argument("--size", type=int, default=64, help="typical side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = make_image_folder(args.root, args.classes, args.per_class, args.size, args.seed)
    megabytes = sum(Path(path).stat().st_size for path, _ in files) / 1e6
    print(f"wrote {len(files)} JPEGs ({megabytes:.1f} MB) to {args.root}:")
    for label in range(args.classes):
        print(f"  {label}: {SHAPES[label]}/ {args.per_class} images")


if __name__ == "__main__":
    main()
