"""Keras's compiled train step on JAX, as the headspace measurement runs it.

On JAX, `model.train_function(state, iterator)` takes the training state (the weights, the
optimizer's and the metrics' variables, as arrays), reads its batches from the iterator inside,
and returns the next state. The headspace runs it on a copy of the state, passed from call to
call and then dropped: the model's own variables are never touched, so nothing is put back.
A copy, because the compiled step donates the state it is given.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from feedpipe._internals.keras import build_for_batch, jax_train_state, keras_jax_batches


class JaxSteps:
    """The train function of `model` on JAX (a `diagnostics._headspace.KerasSteps`)."""

    def __init__(self, model: Any):
        self.model = model

    def inputs(self, *data: Any, **options: Any) -> Iterator:
        """What `fit` hands the train function for `data`, epoch after epoch: Keras's own JAX
        iterator, placed as it places batches (over a `DataParallel` distribution's devices)."""
        return keras_jax_batches(*data, **options)

    def build(self, element: Any) -> None:
        build_for_batch(self.model, element)

    def take(self, iterator: Iterator, count: int) -> list:
        return list(itertools.islice(iterator, count))

    def feed(self, elements: list) -> Iterator:
        return iter(elements)

    def resident(self, element: Any) -> Iterator:
        """An iterator serving `element` forever, its host arrays placed once on the default
        device, as Keras's own iterator would place them (so that no step copies them)."""
        placed = jax.tree.map(
            lambda leaf: jax.device_put(leaf) if isinstance(leaf, np.ndarray) else leaf, element
        )
        return itertools.repeat(placed)

    def watch_reads(self) -> None:
        """None: the train function reads its batches itself, inside the call."""

    @contextlib.contextmanager
    def detached(self, function: Callable) -> Iterator[Callable[[Any], Any]]:
        """`function` to call on an input, run on a copy of the training state."""
        state = jax.tree.map(jnp.copy, jax_train_state(self.model))

        def run(iterator: Any) -> Any:
            nonlocal state
            logs, state = function(state, iterator)
            return logs, state

        yield run
