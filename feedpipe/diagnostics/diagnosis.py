"""Diagnose: is the step starved of input, by how much, and what would help most.

`diagnose` runs the three measurements of `feedpipe.diagnostics.measure` (producer alone,
consumer alone, both together) on the user's own input and step, judges them in a
`feedpipe.diagnostics.verdict.Diagnosis`, and ranks the remedies of
`feedpipe.diagnostics.remedies`. `load_target` loads what `feedpipe diagnose TARGET` runs.
Writing the HTML report is `feedpipe.diagnostics.report`'s job, which reads a `Diagnosis`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from feedpipe.core.machine import cores
from feedpipe.diagnostics.measure import (
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    endless,
    is_keras_model,
    measure,
    memcpy_s,
    memory_bytes,
)
from feedpipe.diagnostics.remedies import rank_remedies
from feedpipe.diagnostics.verdict import SCHEMA_VERSION, Diagnosis, Remedy, StepTiming
from feedpipe.feeder import Feeder

__all__ = [
    "DEFAULT_STEPS",
    "DEFAULT_WARMUP",
    "SCHEMA_VERSION",
    "Diagnosis",
    "Remedy",
    "StepTiming",
    "TargetError",
    "diagnose",
    "load_target",
    "rank_remedies",
]


class TargetError(ValueError):
    """A diagnose target that cannot be loaded, or returns something other than (input, step)."""


def diagnose(
    source: Any,
    step: Any,
    *,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
) -> Diagnosis:
    """Measures the producer alone, the consumer alone and both together; ranks remedies.

    Args:
        source: the input: an `fp.Feeder` (which goes on afterwards from where it was), a
            `tf.data.Dataset`, a `keras.utils.PyDataset`, or any iterable of batches (a
            generator is read on, never restarted).
        step: a callable taking one batch (a `Batch` for a Feeder), or a compiled Keras model,
            which is trained as `model.fit` trains it; its variables are put back afterwards.
        steps: steps timed in each measurement.
        warmup: untimed steps before the first and the together measurement.
        progress: show a labelled progress line on stderr.

    The first remedy, where it is a setting of a Feeder input (its workers, their kind, its
    depth), is then tried: a feeder built with it makes `warmup` + `steps` batches alone, and
    `Remedy.tried_steps_per_s` holds the rate, beside the prediction.

    Returns:
        The `Diagnosis`; `print(diagnosis)` gives the verdict, the rates and the remedies, and
        `feedpipe.diagnostics.report.write_report(diagnosis, directory)` draws it as an HTML page.
    """
    measured = measure(source, step, steps=steps, warmup=warmup, progress=progress)
    diagnosis = measured.diagnosis
    remedies = rank_remedies(
        diagnosis,
        source,
        cores=cores(),
        memcpy_s=memcpy_s(diagnosis.batch_bytes),
        memory_bytes=memory_bytes(),
        image_like=measured.image_like,
    )
    if remedies and remedies[0].options is not None and isinstance(source, Feeder):
        tried = try_remedy(source, remedies[0].options, warmup=warmup, steps=steps)
        remedies = (dataclasses.replace(remedies[0], tried_steps_per_s=tried), *remedies[1:])
    return dataclasses.replace(diagnosis, remedies=remedies)


def try_remedy(feeder: Feeder, options: dict, *, warmup: int, steps: int) -> float:
    """Batches/s the input makes alone, built as `feeder` with `options`: the first remedy's
    prediction checked on the machine, as the producer-alone measurement runs (`warmup`
    batches untimed, then `steps`, epochs repeated as needed)."""
    with feeder.like(**options) as trial:
        batches = endless(trial)
        for _ in range(warmup):
            next(batches)
        began = time.perf_counter()
        for _ in range(steps):
            next(batches)
        return steps / (time.perf_counter() - began)


def load_target(target: str) -> tuple[Any, Any]:
    """Calls `module:function` or `path/to/file.py:function`; returns its (input, step)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise TargetError(
            f"TARGET {target!r} must be `module:function` or `path/to/file.py:function`."
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise TargetError(f"TARGET {target!r}: there is no file {where!r}.")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as error:
            raise TargetError(f"TARGET {target!r}: no module named {where!r}.") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise TargetError(f"TARGET {target!r}: {where!r} has no function {name!r}.")
    try:
        returned = function()
    except Exception as error:
        error.add_note(f"feedpipe diagnose: raised by TARGET {target!r}.")
        raise
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise TargetError(
            f"TARGET {target!r} returned {type(returned).__name__}; it must return "
            "(input, step): the input (an fp.Feeder, tf.data.Dataset, PyDataset or iterable "
            "of batches) and the step (a callable taking one batch, or a compiled Keras model)."
        )
    source, step = returned
    if not (callable(step) or is_keras_model(step)):
        raise TargetError(
            f"TARGET {target!r} returned a step of type {type(step).__name__}; the step must be "
            "a callable taking one batch or a compiled Keras model."
        )
    if not hasattr(source, "__iter__"):
        raise TargetError(
            f"TARGET {target!r} returned an input of type {type(source).__name__}, which cannot "
            "be iterated; return an fp.Feeder, tf.data.Dataset, PyDataset or iterable of batches."
        )
    return source, step
