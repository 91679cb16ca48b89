"""Every call feedpipe makes into Keras 3's private APIs (`keras.src`, a model's private
fields), and what it reads of the frames of Keras's backend trainers (`fit`'s locals).

Each is here because no public API does the job (the reason is beside it), so a new release of
Keras is checked against this file alone. Keras is imported inside the functions: importing
this module imports no framework.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any


def keras_torch_device() -> Any:
    """The device Keras's torch backend trains on (`keras.src.backend.torch.core.get_device`;
    Keras exports no getter for it)."""
    import torch
    from keras.src.backend.torch.core import get_device

    return torch.device(get_device())


def keras_dataset(*data: Any, **options: Any) -> Any:
    """The `tf.data.Dataset` Keras's `fit` would make of `data` (a generator, a PyDataset, or
    `x, y` arrays with `batch_size=`): Keras's own adapter, so the input is read exactly as
    `fit` reads it."""
    from keras.src.trainers.data_adapters import get_data_adapter

    adapter = get_data_adapter(*data, **options)
    adapter.on_epoch_begin()
    return adapter.get_tf_dataset()


def build_for_batch(model: Any, batch: Any) -> None:
    """Builds `model`, its loss, metrics and optimizer from `batch`, as `fit` does before its
    first step (a batch of per-replica values goes through Keras's distributed path)."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and any(
        isinstance(v, tf.distribute.DistributedValues) for v in tf.nest.flatten(batch)
    ):
        model._maybe_symbolic_build(iterator=[(0, 0, iter([batch]))])
    else:
        model._symbolic_build(data_batch=batch)


_KERAS_TRAINER = re.compile(r"keras[/\\]src[/\\]backend[/\\]\w+[/\\]trainer\.py$")

KERAS_BELOW = "3.16"
"""The first Keras release feedpipe is not tested on: `pyproject.toml` requires Keras below it
(a test keeps the two equal; docs/layout.md says how to move it)."""
TRAINER_LOCALS = {
    "fit": (
        *("self", "x", "y", "sample_weight", "class_weight", "callbacks", "epoch_iterator"),
        *("validation_data", "validation_batch_size", "validation_steps"),
        *("val_x", "val_y", "val_sample_weight"),
    ),
    "evaluate": ("x", "y", "sample_weight"),
    "predict": ("x",),
}
"""The locals feedpipe reads in the frames of Keras's backend trainer methods, by method, as
the TensorFlow, JAX and torch trainers of Keras 3.15 name them. A release that
renames one would make a reader see nothing there (a `fit` taken for its own validation, a
fit's input not wrapped), so a frame without one is refused (`missing_trainer_locals`)."""


def keras_reading(adapter: Any) -> str | None:
    """Which of Keras's `fit`, `evaluate` or `predict` is reading `adapter` now (a `fit`'s
    validation is "evaluate"), or None outside them (see `keras_call`)."""
    call = keras_call(adapter)
    return None if call is None else call[0]


def keras_call(adapter: Any) -> tuple[str, dict[str, Any]] | None:
    """Which of Keras's `fit`, `evaluate` or `predict` is reading `adapter` now (a `fit`'s
    validation is "evaluate"), with the arguments it was called with; None outside them.

    Keras tells a data adapter nothing of what it is read for, yet `predict` must not see the
    padding rows `fit` trains on, and a custom adapter gets none of the call's `y`,
    `sample_weight` or `class_weight` (`get_data_adapter` returns it before it looks at them);
    the nearest of its backend trainer's methods on the calling stack says (the adapter is
    asked for its batches from inside the method). A validation's arguments are the fit's
    `validation_*` ones, which Keras has already unpacked: none are given for it.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit", "evaluate", "predict")):
        given, method = frame.f_locals, frame.f_code.co_name
        if method == "fit" and given.get("x") is not adapter:
            return "evaluate", {}  # the validation data of the fit
        names = ("y", "sample_weight", "class_weight")
        return method, {name: given[name] for name in names if name in given}
    return None


def keras_restored_epoch(model: Any) -> int | None:
    """The epoch `keras.callbacks.BackupAndRestore` restored `model` to begin its fits at, or
    None: it sets the model's `_initial_epoch`, which `fit` reads before its own
    `initial_epoch`, and no public name gives it."""
    return getattr(model, "_initial_epoch", None)


def keras_fit_input() -> Any:
    """The `x` of the Keras `fit` running on this thread (what it trains on), or None outside
    one: a callback is told nothing of it (see `keras_call`)."""
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        return frame.f_locals.get("x")
    return None


def _keras_trainer_frames(frame: Any, methods: tuple[str, ...]) -> Iterator[Any]:
    """The frames of Keras's backend trainer methods named `methods` on the calling stack of
    `frame`, nearest first: where Keras keeps what it tells neither a data adapter nor a
    callback (what `fit` was given, its epoch iterator, its callbacks)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in methods and _KERAS_TRAINER.search(code.co_filename):
            missing = missing_trainer_locals(code)
            if missing:
                raise RuntimeError(_renamed(code, missing))
            yield frame
        frame = frame.f_back


def missing_trainer_locals(code: Any) -> list[str]:
    """The locals of `TRAINER_LOCALS` that the code of a Keras trainer method (`fit`,
    `evaluate` or `predict`) does not have."""
    names = {*code.co_varnames, *code.co_cellvars}
    return [name for name in TRAINER_LOCALS[code.co_name] if name not in names]


def _renamed(code: Any, missing: list[str]) -> str:
    """The refusal of a trainer method whose code has none of the locals `missing`."""
    try:
        version = f"Keras {importlib.metadata.version('keras')}"
    except importlib.metadata.PackageNotFoundError:
        version = "This Keras"
    where = code.co_filename[_KERAS_TRAINER.search(code.co_filename).start() :]
    names = ", ".join(f"`{name}`" for name in missing)
    return (
        f"{version} changed `{code.co_qualname}` ({where}): it has no local {names}, which "
        "feedpipe reads in its frame to learn what the call was given (Keras tells a data "
        f"adapter and a callback nothing of it). feedpipe is tested with keras<{KERAS_BELOW}: "
        f"install one (pip install 'keras<{KERAS_BELOW}'), or a feedpipe that supports "
        f"{version}."
    )


def keras_jax_batches(*data: Any, **options: Any) -> Iterator[Any]:
    """The batches Keras's JAX `fit` hands its train function for `data`, epoch after epoch
    until one is empty: its own epoch iterator, which places each batch as `fit` does (over a
    `DataParallel` distribution's devices)."""
    from keras.src.backend.jax.trainer import JAXEpochIterator

    epochs = JAXEpochIterator(*data, **options)
    while True:
        taken = 0
        for _, _, iterator in epochs:
            try:
                yield next(iterator)
            except StopIteration:
                break
            taken += 1
        if not taken:
            return
        epochs.reset()


def keras_torch_batches(*data: Any, **options: Any) -> Iterator[Any]:
    """The batches Keras's torch `fit` hands its train function for `data`, epoch after epoch
    until one is empty: its own epoch iterator (`TorchEpochIterator`), which reads each batch
    from the data adapter's `get_torch_dataloader()` as `fit` does."""
    from keras.src.backend.torch.trainer import TorchEpochIterator

    epochs = TorchEpochIterator(*data, **options)
    while True:
        taken = 0
        for _, _, batches in epochs:
            yield from batches
            taken += 1
        if not taken:
            return
        epochs.reset()


def read_keras_fit_input_through(wrap: Callable[[Iterator], Iterator]) -> bool:
    """Makes the Keras `fit` running on this thread read its input through `wrap(iterator)`
    from its next epoch on; whether such a fit was found (call it from `on_train_begin`).

    Keras's torch `fit` reads each batch in its epoch iterator, before it calls the train
    function, so a callback cannot see the read (on TensorFlow and JAX the train function reads
    it). No public API reaches that iterator: it is `fit`'s local `epoch_iterator`, found on
    the calling stack as `keras_reading` finds the trainer, which makes each epoch's iterator
    with its `_get_iterator()`. The epoch iterator ends with the fit, and the wrapping with it.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        epochs = frame.f_locals.get("epoch_iterator")
        if epochs is None or not hasattr(epochs, "_get_iterator"):
            return False
        epochs._get_iterator = lambda make=epochs._get_iterator: wrap(iter(make()))
        return True
    return False


def keras_global_seed_generator() -> Any:
    """The seed generator Keras's random ops draw from when given no seed (`keras.random.normal`
    in a layer's `call`), or None before one has: `keras.random` makes it in Keras's global
    state on first use, and no public name gives it."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    return global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)


def drop_keras_global_seed_generator() -> None:
    """Forgets Keras's global seed generator (see `keras_global_seed_generator`), as before
    its first use."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)


def jax_train_state(model: Any) -> tuple:
    """The state Keras's JAX train function takes and returns: the trainable, non-trainable,
    optimizer and metrics variables' arrays (the JAX trainer's own helper builds it; inside a
    fit the variables hold it at each epoch's end)."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )


def give_back_jax_train_state(model: Any, state: tuple) -> None:
    """Makes `state` (as `jax_train_state` gives it) the one Keras's JAX `fit` puts back into
    the model's variables when it ends (its `jax_state_sync`), also when it raises.

    Keras takes the state out of the variables as an epoch's first step begins (it empties
    them) and keeps the state each step returns in `_jax_state`, until the epoch's end; a step
    that raised before its batch was handed over donated nothing, but in a model's first fit
    there is no earlier state to put back, and the emptied variables would stay empty.
    """
    names = ("trainable", "non_trainable", "optimizer", "metrics")
    model._jax_state = {f"{name}_variables": part for name, part in zip(names, state, strict=True)}
    model._jax_state_synced = False


def in_keras_fit_with(callback: Any, frame: Any) -> bool:
    """Whether a Keras `fit` with `callback` among its callbacks is on the calling stack of
    `frame` (it has not returned or raised): no public API says which fit is running."""
    for fit in _keras_trainer_frames(frame, ("fit",)):
        callbacks = fit.f_locals.get("callbacks")
        if any(c is callback for c in getattr(callbacks, "callbacks", ())):
            return True
    return False


def keras_loss(loss: Any, y_true: Any, y_pred: Any) -> Any:
    """The Keras loss object `compile(loss=...)` would build from `loss` (a name, a class or a
    function), for these targets and predictions."""
    from keras.src.trainers import compile_utils

    return compile_utils.get_loss(loss, y_true, y_pred)


def keras_metric(metric: Any, y_true: Any, y_pred: Any) -> Any:
    """The Keras metric object `compile(metrics=[...])` would build from `metric`."""
    from keras.src.trainers import compile_utils

    return compile_utils.get_metric(metric, y_true, y_pred)


def unweighted_metrics(model: Any) -> list | None:
    """The metrics given to `model.compile(metrics=...)`, which ignore sample weights (no
    public attribute lists them apart from `weighted_metrics`)."""
    return getattr(getattr(model, "_compile_metrics", None), "_user_metrics", None)


def keras_validation_input(model: Any) -> Any:
    """What the validation of the running `fit` reads: the dataset its data adapter wraps, or
    the adapter itself (a feeder). Keras keeps the validation's epoch iterator on the model
    during `fit` (`_eval_epoch_iterator`); no public name gives it. None outside a fit."""
    adapter = getattr(getattr(model, "_eval_epoch_iterator", None), "data_adapter", None)
    return getattr(adapter, "_dataset", adapter)


def batch_keras_validation_arrays(adapter: Any, batch_size: int) -> None:
    """Makes the Keras `fit` that trains on `adapter` batch its validation arrays by
    `batch_size` where it was given no `validation_batch_size`, as `fit(x, y,
    batch_size=batch_size)` batches them.

    Keras batches them by `validation_batch_size or batch_size`, `fit`'s locals alone, and a fit
    on a data adapter has no `batch_size`, so 32 would apply. `fit` makes the validation's
    epoch iterator at its first validation unless the model holds one already
    (`_eval_epoch_iterator`, emptied as each fit begins); no public name sets either. It is
    made here, before that, as `fit` makes it, with `batch_size`.
    """
    for frame in _keras_trainer_frames(sys._getframe(1), ("fit",)):
        given = frame.f_locals
        model = given.get("self")
        if (
            given.get("x") is not adapter
            or given.get("validation_data") is None
            or given.get("validation_batch_size") is not None
            or getattr(model, "_eval_epoch_iterator", None) is not None
        ):
            return
        from keras import backend
        from keras.src.trainers.data_adapters.array_data_adapter import can_convert_arrays

        data = {name: given.get(f"val_{name}") for name in ("x", "y", "sample_weight")}
        if not can_convert_arrays(tuple(data.values())):
            return  # a dataset, a generator or a feeder: Keras reads its own batches
        options = {}
        if backend.backend() == "tensorflow":
            from keras.src.backend.tensorflow.trainer import TFEpochIterator as EpochIterator

            options["distribute_strategy"] = model.distribute_strategy
        elif backend.backend() == "jax":
            from keras.src.backend.jax.trainer import JAXEpochIterator as EpochIterator
        else:
            from keras.src.backend.torch.trainer import TorchEpochIterator as EpochIterator
        model._eval_epoch_iterator = EpochIterator(
            **data,
            batch_size=batch_size,
            steps_per_execution=model.steps_per_execution,
            steps_per_epoch=given.get("validation_steps"),
            shuffle=False,
            **options,
        )
        return


def keras_data_adapter() -> type:
    """Keras 3's `DataAdapter` base class: `model.fit` takes an instance of it as it is (its
    `get_data_adapter` returns "a custom data adapter" unchanged). No public name exports it."""
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    return DataAdapter
