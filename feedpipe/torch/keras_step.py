"""Keras's train step on PyTorch, as the headspace measurement runs it.

On PyTorch, `fit` reads each batch from its epoch iterator and then calls
`model.train_function([batch])`, which runs the step eagerly and changes the variables in
place. The headspace reads its batch the same way, from an iterator, just before each call
(serving one batch again and again from memory), and puts back everything the steps changed:
every variable's value, the gradients they left, each module's training mode and the random
generators' states. Because the read happens before the call, the monitor times each call from
where the running fit's input begins to read its batch (`watch_reads`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import optree
import torch

from feedpipe._internals.keras import (
    build_for_batch,
    drop_keras_global_seed_generator,
    keras_global_seed_generator,
    keras_torch_batches,
    keras_torch_device,
    read_keras_fit_input_through,
)


class TorchSteps:
    """The train function of `model` on PyTorch (a `diagnostics._headspace.KerasSteps`)."""

    def __init__(self, model: keras.Model):
        self.model = model

    def inputs(self, *data: Any, **options: Any) -> Iterator:
        """What `fit` hands the train function for `data`, epoch after epoch: the batches of
        Keras's own torch epoch iterator (a feeder's: its tensors on Keras's device)."""
        return keras_torch_batches(*data, **options)

    def build(self, element: Any) -> None:
        build_for_batch(self.model, element)

    def take(self, batches: list, count: int) -> list:
        """Up to `count` of the batches `fit` handed the train function: a list, read before
        the call."""
        return list(batches[:count])

    def feed(self, elements: list) -> list:
        """`elements` as `fit` hands them to the train function: a list of batches."""
        return elements

    def resident(self, element: Any) -> Iterator:
        """An iterator serving `element` forever, a copy of its tensors placed once on the
        device Keras trains on (a host batch would be copied there in every step). A copy: a
        feeder's tensors on the CPU are its slot's memory, which would be kept from the pool."""
        device = keras_torch_device()
        placed = optree.tree_map(
            lambda leaf: leaf.to(device, copy=True) if isinstance(leaf, torch.Tensor) else leaf,
            element,
        )
        return itertools.repeat(placed)

    def watch_reads(self) -> Callable[[], float]:
        """Has the running `fit` note when each read of its input begins; returns the function
        telling when the latest began (`time.perf_counter()`): the call's batch was read then."""
        clock = _ReadClock()
        if not read_keras_fit_input_through(clock.wrap):
            raise RuntimeError(
                "StarvationMonitor found no running Keras fit to time the input reads of; use "
                "it as a callback of model.fit."
            )
        return clock.latest

    @contextlib.contextmanager
    def detached(self, function: Callable) -> Iterator[Callable[[Any], Any]]:
        """`function` to call on an input (an iterator: each call reads its batch there, as
        `fit` does), in training mode, with everything it changes put back afterwards."""
        restore = save_state(self.model)

        def run(batches: Iterator) -> Any:
            return function([next(batches)])

        try:
            self.model.train()  # as `fit` runs its steps (a validation leaves it in eval mode)
            yield run
        finally:
            restore()


class _ReadClock:
    """When the latest read of an input began."""

    def __init__(self):
        self.began = time.perf_counter()

    def latest(self) -> float:
        return self.began

    def wrap(self, iterator: Iterator) -> Iterator:
        return _TimedReads(iterator, self)


class _TimedReads:
    """`iterator`, noting on `clock` when each of its reads begins."""

    __slots__ = ("clock", "iterator")

    def __init__(self, iterator: Iterator, clock: _ReadClock):
        self.iterator = iterator
        self.clock = clock

    def __iter__(self) -> _TimedReads:
        return self

    def __next__(self) -> Any:
        self.clock.began = time.perf_counter()
        return next(self.iterator)


def save_state(model: keras.Model) -> Callable[[], None]:
    """Copies every variable a training step may change to host memory, and keeps the
    gradients the variables hold, each module's training mode and PyTorch's random number
    generators' states; returns the function that puts them back.

    The generators, because an unseeded `Dropout` on torch draws from PyTorch's global
    generator; Keras's seed states are variables, its global seed generator's too (one the
    steps made is dropped again)."""
    global_seeds = keras_global_seed_generator()
    variables = _state_variables(model)
    if global_seeds is not None:
        variables.append(global_seeds.state)
    saved = [variable.value.detach().to("cpu", copy=True) for variable in variables]
    gradients = [variable.value.grad for variable in variables]
    modes = [(module, module.training) for module in model.modules()]
    cpu_generator = torch.get_rng_state()
    cuda_generators = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore() -> None:
        for variable, value, gradient in zip(variables, saved, gradients, strict=True):
            variable.assign(value)
            # A step replaces the gradients (zero_grad sets them to None first): the old
            # tensors are as they were.
            variable.value.grad = gradient
        for module, training in modes:
            module.training = training
        torch.set_rng_state(cpu_generator)
        if cuda_generators is not None:
            torch.cuda.set_rng_state_all(cuda_generators)
        if global_seeds is None:
            drop_keras_global_seed_generator()

    return restore


def _state_variables(model: keras.Model) -> list[keras.Variable]:
    """Every variable a training step may change (weights, seed states, optimizer slots and
    counters, metrics), each once."""
    optimizer = model.optimizer
    found = [
        *model.variables,
        *(optimizer.variables if optimizer is not None else ()),
        *model.metrics_variables,
    ]
    seen: set[int] = set()
    unique = []
    for variable in found:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return unique
