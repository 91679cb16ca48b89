"""The JAX feeder: each replica's rows as a `jax.Array` on its own device, `depth` ahead.

`fp.Feeder(...)` is this class where `devices` are JAX devices or a `jax.sharding.Mesh`, or JAX
is the framework in use (see `feedpipe._frameworks`). Its state is a plain JSON-able dict:
save it with Orbax or `json` beside the model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from feedpipe import feeder as core
from feedpipe.jax.keras import keras_batches
from feedpipe.jax.layer import JaxLayer


class Feeder(core.Feeder):
    """A feeder whose batches are `jax.Array`s on JAX devices (see `feedpipe.Feeder`)."""

    def _layer(self, devices: Any, strategy: Any, global_batch_size: int) -> JaxLayer:
        return JaxLayer(devices, strategy, global_batch_size)

    def _keras_batches(self, reading: str | None, class_weight: dict | None) -> Iterator[Any]:
        """What Keras's JAX trainer reads from this feeder (`feedpipe.jax.keras`)."""
        return keras_batches(self, reading=reading, class_weight=class_weight)

    @property
    def sharding(self) -> Any:
        """The global batch's sharding: axis 0 over the feeder's devices (`batch.distributed()`)."""
        return self.layer.sharding
