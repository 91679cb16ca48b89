"""feedpipe keeps every accelerator fed.

The pipeline, left to right, one module per box:

    source ──► sampler ──► producers ──► split ──► stage ──► feeder (the consumer's end)
    what the   which       who makes     which     onto      iterator, as_dataset(),
    samples    indices,    the samples   rows go   each      state, checkpoints
    are        what order  (a thread,    where     device
                           or workers)
                                 stats observe every hop

`feedpipe.training` is the consumer's training loop (`fp.train`, `fp.Trainer`, `fp.TowerStep`);
`feedpipe.monitor` holds `fp.StarvationMonitor`; `feedpipe.diagnosis` answers "is the step
starved, and what would help" (`fp.diagnose`, the command `feedpipe diagnose`), and
`feedpipe.report` draws its HTML report. `feedpipe.workers` holds the worker pools (processes
or threads), `feedpipe._worker` the code that runs inside a worker, `feedpipe._shm` the memory
shared with worker processes. Those three and `feedpipe.source`, `feedpipe.sampler`,
`feedpipe.producers` and `feedpipe.split` never import
TensorFlow; the public names below load lazily, so `import feedpipe` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Batch": "feedpipe.batch",
    "Diagnosis": "feedpipe.diagnosis",
    "FeedOptions": "feedpipe.feeder",
    "FeedStats": "feedpipe.stats",
    "Feeder": "feedpipe.feeder",
    "StarvationMonitor": "feedpipe.monitor",
    "TowerStep": "feedpipe.training",
    "Trainer": "feedpipe.training",
    "WarmupLinearScaling": "feedpipe.training",
    "WorkerError": "feedpipe.workers",
    "diagnose": "feedpipe.diagnosis",
    "from_generator": "feedpipe.source",
    "train": "feedpipe.training",
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
    from feedpipe.batch import Batch
    from feedpipe.diagnosis import Diagnosis, diagnose
    from feedpipe.feeder import Feeder, FeedOptions
    from feedpipe.monitor import StarvationMonitor
    from feedpipe.source import from_generator
    from feedpipe.stats import FeedStats
    from feedpipe.training import TowerStep, Trainer, WarmupLinearScaling, train
    from feedpipe.workers import WorkerError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'feedpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
