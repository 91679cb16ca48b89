"""The feeder as Keras's own data adapter, so that `model.fit(feeder)` works on every backend.

Keras 3 takes any `DataAdapter` as it is ("Allow passing a custom data adapter" in
`get_data_adapter`). A feeder built once Keras is imported is one (`with_keras`), and hands each
backend what suits it: TensorFlow gets a `tf.data.Dataset` of the feeder's batches; JAX gets
the global batch as `jax.Array`s already sharded over the feeder's devices (Keras's
`DataParallel` takes them as they are); PyTorch gets `torch.Tensor`s on the one device it
trains on. On every backend a padded batch goes over as its real rows alone, as `fit(x, y)`'s
last batch does, `class_weight` weighs rows as Keras weighs arrays, and `predict` and
`evaluate` read a whole epoch aside, leaving the feeder's state as it was
(`feedpipe.keras.batches`, `feedpipe.keras.arguments`). As with `as_dataset()`, pass
`callbacks=[feeder.fit_callback()]` so that the feeder's state is what the step trained on.

The base class is Keras's private `DataAdapter` (`feedpipe._internals.keras.keras_data_adapter`):
the one place a Keras release can break this, and the price of `model.fit(feeder)`.
"""

from __future__ import annotations

import functools
from typing import Any

from feedpipe._internals.keras import keras_data_adapter
from feedpipe.keras.arguments import keras_arguments


class KerasInput:
    """What Keras asks of a data adapter, answered from the feeder's own state (a mixin)."""

    @property
    def num_batches(self) -> int | None:
        """Batches Keras takes per epoch: a whole epoch's (None: length unknown).

        Keras reads it first in every `fit`, before any callback: a fit that raised (an error,
        Ctrl-C) ends here, so the next one goes on from what that one trained on. Each pass
        Keras reads is the rest of the feeder's current epoch: from mid-epoch (a fit
        interrupted and run again, a restore) the first Keras epoch ends early with the
        feeder's, as an input that ran out does, and Keras's later epochs are whole ones, so
        `model.fit(feeder, epochs=n)` run again finishes the epoch, then trains whole epochs.
        """
        self._consumer.fits.end_interrupted()
        plan = self._assembly.plan
        return None if plan is None else len(plan)

    @property
    def batch_size(self) -> int:
        return self.options.global_batch_size

    @property
    def has_partial_batch(self) -> bool:
        """Never: the last batch is padded to full size (masked) or dropped."""
        return False

    @property
    def partial_batch_size(self) -> None:
        return None

    def get_tf_dataset(self) -> Any:
        if self.layer.name != "tensorflow":
            raise TypeError(
                f"This feeder stages for {self.layer.name}, but Keras's backend asks for a "
                "tf.data.Dataset; build the feeder with TensorFlow devices (or none) under "
                "KERAS_BACKEND=tensorflow."
            )
        return self._keras_batches(*keras_arguments(self))

    def get_jax_iterator(self) -> Any:
        if self.layer.name != "jax":
            raise TypeError(
                f"This feeder stages for {self.layer.name}, but Keras's backend is JAX; build "
                "it with devices=jax.devices() (or under KERAS_BACKEND=jax, with none)."
            )
        return self._keras_batches(*keras_arguments(self))

    def get_torch_dataloader(self) -> Any:
        if self.layer.name != "torch":
            raise TypeError(
                f"This feeder stages for {self.layer.name}, but Keras's backend is PyTorch; "
                "build it with torch devices (devices=[torch.device('cuda:0')]), "
                "framework='torch', or under KERAS_BACKEND=torch with none."
            )
        return self._keras_batches(*keras_arguments(self))

    def get_numpy_iterator(self) -> Any:
        raise TypeError(
            "fp.Feeder stages batches on TensorFlow, JAX or PyTorch devices; for Keras's "
            f"{_backend()} backend pass host arrays or a keras.utils.PyDataset instead."
        )

    def on_epoch_begin(self) -> None:
        """Each pass is the feeder's next epoch (or the rest of the current one)."""

    def on_epoch_end(self) -> None:
        """The pass's end is the feeder's own (its last batch carries the epoch's end)."""


def _backend() -> str:
    import keras

    return keras.backend.backend()


@functools.cache
def with_keras(feeder_class: type) -> type:
    """`feeder_class` that is also a Keras data adapter (made once per class)."""
    return type(
        feeder_class.__name__,
        (feeder_class, KerasInput, keras_data_adapter()),
        {"__module__": feeder_class.__module__, "__doc__": feeder_class.__doc__},
    )
