"""feedpipe keeps every accelerator fed.

The pipeline, left to right, one module per box:

    source ──► sampler ──► producers ──► writer ──► split/slots ──► stage ──► feeder
    what the   which       who makes     per-sample  which rows go   onto      the consumer's
    samples    indices,    each batch,   work: read, where, in host  each      end: iterator,
    are        what order  when (a       transform,  memory laid     device    as_dataset(),
               (remainder  thread, or    check,      out per                   state, checkpoints
               .py: the    workers)      write       replica                   (batch.py: what
               last batch)                                                     the step takes)
                                 stats observe every hop

Plumbing: `_pipeline` runs the background thread and its hand-off; `_sync` is the one
stop/timeout/join pattern every thread and pool follows; `workers` holds the worker pools
(processes or threads), `_worker` what runs inside a worker, `_shm` the memory shared with
worker processes; `devices` names the replicas' devices; `_internals` wraps every call into
TensorFlow's and Keras's private APIs.

Consumers and diagnostics: `training` (`fp.train`, `fp.Trainer`, `fp.TowerStep`), `monitor`
(`fp.StarvationMonitor`), `diagnosis` ("is the step starved, and what would help":
`fp.diagnose`), `report` (its HTML page), `cli` (`feedpipe demo`, `feedpipe diagnose`), `dali`
(DALI pipelines as a source; DALI is imported there alone).

`source`, `sampler`, `remainder`, `producers`, `writer`, `split`, `slots`, `workers`, `_worker`,
`_shm` and `_sync` never import TensorFlow; the public names below load lazily, so
`import feedpipe` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Batch": "feedpipe.tf.batch",
    "Diagnosis": "feedpipe.diagnostics.diagnosis",
    "FeedOptions": "feedpipe.feeder",
    "FeedStats": "feedpipe.core.stats",
    "Feeder": "feedpipe.feeder",
    "StarvationMonitor": "feedpipe.diagnostics.monitor",
    "TowerStep": "feedpipe.tf.training",
    "Trainer": "feedpipe.tf.training",
    "WarmupLinearScaling": "feedpipe.tf.training",
    "WorkerError": "feedpipe.core.workers",
    "diagnose": "feedpipe.diagnostics.diagnosis",
    "from_generator": "feedpipe.core.source",
    "train": "feedpipe.tf.training",
}

__all__ = [
    "Batch",
    "Diagnosis",
    "FeedOptions",
    "FeedStats",
    "Feeder",
    "StarvationMonitor",
    "TowerStep",
    "Trainer",
    "WarmupLinearScaling",
    "WorkerError",
    "diagnose",
    "from_generator",
    "train",
]

if TYPE_CHECKING:
    from feedpipe.core.source import from_generator
    from feedpipe.core.stats import FeedStats
    from feedpipe.core.workers import WorkerError
    from feedpipe.diagnostics.diagnosis import Diagnosis, diagnose
    from feedpipe.diagnostics.monitor import StarvationMonitor
    from feedpipe.feeder import Feeder, FeedOptions
    from feedpipe.tf.batch import Batch
    from feedpipe.tf.training import TowerStep, Trainer, WarmupLinearScaling, train


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'feedpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
