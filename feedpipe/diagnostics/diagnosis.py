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
from pathlib import Path
from typing import Any

from feedpipe.diagnostics.measure import (
    DEFAULT_STEPS,
    DEFAULT_WARMUP,
    cores,
    is_keras_model,
    measure,
    memcpy_s,
    memory_bytes,
)
from feedpipe.diagnostics.remedies import rank_remedies
from feedpipe.diagnostics.verdict import SCHEMA_VERSION, Diagnosis, Remedy, StepTiming

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

    Returns:
        The `Diagnosis`; `print(diagnosis)` gives the verdict, the rates and the remedies, and
        `feedpipe.diagnostics.report.write_report(diagnosis, directory)` draws it as an HTML page.
    """
    measured = measure(source, step, steps=steps, warmup=warmup, progress=progress)
    diagnosis = measured.diagnosis
    return dataclasses.replace(
        diagnosis,
        remedies=rank_remedies(
            diagnosis,
            source,
            cores=cores(),
            memcpy_s=memcpy_s(diagnosis.batch_bytes),
            memory_bytes=memory_bytes(),
            image_like=measured.image_like,
        ),
    )


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
