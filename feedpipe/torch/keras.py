"""What Keras's torch trainer reads from a feeder: batches already on its device.

Keras on torch trains on one device (`keras.src.backend.torch.core.get_device()`, the GPU where
there is one) and moves each input there only when it is elsewhere, so the feeder's tensors,
staged on that device, go over as they are; padding rows are weighted zero there too.

They go over as a DataLoader would hand them: `fit(x, y)` reads a `torch.utils.data.DataLoader`
each epoch, and every iterator of one draws a number from torch's global generator, the one an
unseeded Dropout draws its masks from. The feeder's iterators draw the same numbers at the same
points, so such a model trains the weights `fit(x, y)` trains, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from feedpipe._internals.keras import keras_torch_device
from feedpipe.core.weights import broadcastable
from feedpipe.keras.batches import keras_batches as batches_of
from feedpipe.torch.devices import resolve_devices


def _check_device(feeder: Any) -> None:
    """Refuses a feeder whose devices are not the one Keras's step runs on."""
    keras_device = keras_torch_device()
    if keras_device.type == "cuda" and keras_device.index is None:
        keras_device = torch.device("cuda", torch.cuda.current_device())
    if list(feeder.devices) != [keras_device]:
        default = resolve_devices(None) == (keras_device,)
        raise ValueError(
            f"Keras's torch backend trains on {keras_device}, but the feeder stages on "
            f"{list(feeder.devices)}; build it with devices=[torch.device('{keras_device}')]"
            + (" (or none: this process's device)." if default else ".")
        )


class _TorchRows:
    """The rows of a batch's tensors (see `feedpipe.keras.batches.DeviceRows`)."""

    def uneven(self, count: int | None) -> None:
        """Never: Keras on torch trains on one device, which takes a batch of any size."""
        return None

    def real(self, batch: Any, mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).flatten()

    def weights(self, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.where(mask, scale, 0.0).to(torch.float32)

    def added(self, labels: Any, rows: torch.Tensor) -> Any:
        return optree.tree_map(lambda y: broadcastable(rows, y.ndim).clone(), labels)

    def scaled(self, given: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        scaled = given.to(torch.float32) * broadcastable(rows, given.ndim)
        return scaled.to(given.dtype)


def keras_batches(
    feeder: Any, *, reading: str | None, class_weight: dict | None = None
) -> KerasLoader:
    """The feeder's batches as Keras's torch trainer takes them (`feedpipe.keras.batches`),
    once the feeder's device is found to be the step's."""

    def batches() -> Iterator[Any]:
        _check_device(feeder)
        yield from batches_of(feeder, _TorchRows(), reading=reading, class_weight=class_weight)

    return KerasLoader(batches)


class KerasLoader:
    """What Keras reads in place of a DataLoader: each iterator made of it draws from torch's
    global generator what a DataLoader's does (`_BaseDataLoaderIter.__init__`: one int64, its
    `_base_seed`).

    Keras makes an iterator at each epoch's start, and where it knows the epoch's length it
    makes the next one as soon as the epoch's last step is done. Where it does not (a source of
    unknown length, or a first epoch that ends early with the feeder's), it asks past the end
    instead: the iterator then draws what that next one would have drawn, as Keras over arrays
    would have.
    """

    def __init__(self, batches: Callable[[], Iterator[Any]]):
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        _draw_as_a_dataloader_iterator()
        return self._read()

    def _read(self) -> Iterator[Any]:
        yield from self.batches()
        _draw_as_a_dataloader_iterator()  # asked past the epoch's end: Keras made no next one


def _draw_as_a_dataloader_iterator() -> None:
    torch.empty((), dtype=torch.int64).random_()
