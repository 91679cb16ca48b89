"""feedpipe keeps every accelerator fed.

The pipeline, left to right, one module per box (docs/layout.md lists them all):

    source ──► sampler ──► producers ──► writer ──► split/slots ──► stage ──► consumer
    what the   which       who makes     per-sample  which rows go   onto      its position:
    samples    indices,    each batch,   work: read, where, in host  each      passes, epoch
    are        what order  when (a       transform,  memory laid     device    ends, state
               (remainder  thread, or    check,      out per
               .py: the    workers)      write       replica
               last batch)
                                 stats observe every hop

In layers: `core/` knows no framework (the boxes up to the host stager, the position and
state, page-locked slots, the copy engine); `plan.py` plans the pipeline from the options
(`options.py`) and `assembly.py` runs it, `consumer.py` keeps the consumer's position, and
`feeder.py` is the facade over them, which builds the subclass of the framework that
`devices` or `strategy` name (`_frameworks`). `tf/` stages on
TensorFlow devices (`as_dataset`, checkpoints, `fp.train`); `jax/` on JAX devices and meshes;
`keras/` makes a feeder Keras's data adapter (`model.fit(feeder)`) and keeps the ledger of
what a fit trained on;
`service/` is tf.data service; `diagnostics/` answers "is the step starved, and what would
help" (`fp.StarvationMonitor`, `fp.diagnose`, the report); `cli` and `demo` are the
`feedpipe` command; `dali` reads DALI pipelines; `_internals` wraps every call into a
framework's private APIs, one module per framework.

`import feedpipe` imports no framework: the public names below load lazily, and worker
processes import `core/` alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from feedpipe._version import __version__ as __version__  # written once there

_EXPORTS = {
    "Batch": "feedpipe.core.batch",
    "Diagnosis": "feedpipe.diagnostics.diagnosis",
    "FeedOptions": "feedpipe.options",
    "FeedStats": "feedpipe.core.stats",
    "Feeder": "feedpipe.feeder",
    "FeederDescription": "feedpipe.core.description",
    "StarvationMonitor": "feedpipe.diagnostics.monitor",
    "TowerStep": "feedpipe.tf.training",
    "Trainer": "feedpipe.tf.training",
    "WarmupLinearScaling": "feedpipe.tf.training",
    "WorkerError": "feedpipe.core.workers",
    "diagnose": "feedpipe.diagnostics.diagnosis",
    "from_generator": "feedpipe.core.sources",
    "release": "feedpipe.core.warm",
    "train": "feedpipe.tf.training",
    "warm_workers": "feedpipe.core.warm",
}

__all__ = [
    "Batch",
    "Diagnosis",
    "FeedOptions",
    "FeedStats",
    "Feeder",
    "FeederDescription",
    "StarvationMonitor",
    "TowerStep",
    "Trainer",
    "WarmupLinearScaling",
    "WorkerError",
    "diagnose",
    "from_generator",
    "release",
    "train",
    "warm_workers",
]

if TYPE_CHECKING:
    from feedpipe.core.batch import Batch
    from feedpipe.core.description import FeederDescription
    from feedpipe.core.sources import from_generator
    from feedpipe.core.stats import FeedStats
    from feedpipe.core.warm import release, warm_workers
    from feedpipe.core.workers import WorkerError
    from feedpipe.diagnostics.diagnosis import Diagnosis, diagnose
    from feedpipe.diagnostics.monitor import StarvationMonitor
    from feedpipe.feeder import Feeder
    from feedpipe.options import FeedOptions
    from feedpipe.tf.training import TowerStep, Trainer, WarmupLinearScaling, train


_TENSORFLOW_TRAINING = "feedpipe.tf.training"
"""The module of the names that train on TensorFlow alone, with Keras on TensorFlow."""


def _without_tensorflow(name: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """What `fp.<name>`, one of TensorFlow's training names, raises where `error` says that
    TensorFlow (or Keras on it) cannot be imported: what a JAX or PyTorch install uses."""
    names = ", ".join(f"fp.{n}" for n, module in _EXPORTS.items() if module == _TENSORFLOW_TRAINING)
    return ModuleNotFoundError(
        f"fp.{name} trains with Keras on TensorFlow, which is not installed here ({error}); "
        f"{names} are TensorFlow's. On JAX: model.fit(feeder) with Keras on JAX "
        "(KERAS_BACKEND=jax), or a loop of your own, for batch in feeder: inputs, mask = "
        "batch.distributed() (global jax.Arrays sharded over the feeder's devices). On "
        "PyTorch: model.fit(feeder) with Keras on PyTorch (KERAS_BACKEND=torch), or a plain "
        "loop, for batch in feeder: inputs, mask = batch.distributed(). For TensorFlow's "
        'training, install it: pip install "feedpipe[tensorflow]".',
        name="tensorflow",
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'feedpipe' has no attribute {name!r}")
    try:
        module = importlib.import_module(_EXPORTS[name])
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if _EXPORTS[name] == _TENSORFLOW_TRAINING and missing in ("tensorflow", "keras"):
            raise _without_tensorflow(name, error) from error
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
