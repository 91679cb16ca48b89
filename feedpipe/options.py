"""Options: how a feeder batches, orders and stages samples, as one frozen, validated value."""

from __future__ import annotations

import dataclasses
from typing import Any

from feedpipe.core.checks import check_int
from feedpipe.core.remainder import check_remainder
from feedpipe.core.services import is_ray
from feedpipe.core.skips import ErrorPolicy, check_error_policy

WORKER_MODES = ("process", "thread")
AUTO = "auto"
"""`workers="auto"`: the feeder measures what a sample costs and picks the workers itself."""

SEED_LIMIT = 2**63
"""Seeds stay below it: a `transform(sample, seed)` gets the seed in an int64 array, as
TensorFlow's stateless random ops take it."""


def check_seed(seed: Any) -> int:
    """`seed` as an `int`, if it is an integer in [0, 2**63); otherwise refused, naming it."""
    value = check_int("seed", seed, "pass seed=0 or any larger integer", minimum=0)
    if value >= SEED_LIMIT:
        raise ValueError(
            f"`seed`={value} must be below 2**63: a transform taking `seed` gets it as an "
            f"int64; pass seed % 2**63 ({value % SEED_LIMIT}) or any smaller integer."
        )
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class FeedOptions:
    """How a `Feeder` batches, orders and stages samples; validated on creation.

    `global_batch_size`, the one required field, may come first by position, as it does in
    `fp.Feeder(source, 256)`: `FeedOptions(128, shuffle=True)`. Every other field is keyword-only,
    so a call names what it sets and a field added later cannot change what an old call means.
    """

    global_batch_size: int
    """Samples per step across all replicas; must divide evenly among them."""
    _: dataclasses.KW_ONLY
    remainder: str = "pad"
    """The last partial batch: "pad" (repeat real samples, masked), "drop", or "error".
    Default "pad": every sample is seen and every replica runs the same steps."""
    shuffle: bool = False
    """Shuffle each epoch's order from (seed, epoch). Default off: the order users expect."""
    seed: int = 0
    """Seeds the order and each sample's `transform` rng, so runs are reproducible."""
    workers: int | str = 0
    """0 produces in one background thread; N > 0 in N workers; "auto" measures what a sample
    costs when the feeder is built and picks the kind and count of workers (see
    `feedpipe.core.cost`; `Feeder.describe().workers_chosen` says what and why). Default 0:
    arrays without a `transform` are gathered fastest by `np.take` over row ranges in threads of
    its own, sized from the cores and the batch (`describe().gather_threads`)."""
    depth: int = 2
    """Batches staged per device ahead of the step. Default 2 hides one transfer behind one
    step while the next is being made."""
    worker_mode: str = "process"
    """"process" (each worker its own interpreter and GIL) or "thread" (shares this process's
    GIL; for code that releases it). Default "process": per-sample Python holds the GIL, and
    only processes scale it (see kernels_bench/workers.py)."""
    timeout_s: float | None = None
    """Longest a worker may spend on one sample before `TimeoutError`; None waits forever
    (`close()` still ends a hung worker). On Ray, how long a task may go unanswered before it
    is asked for again, and how long joining the cluster may take."""

    errors: str = "raise"
    """A sample whose reading or `transform` raises: "raise" (the error reaches the loop, the
    feeder closes) or "skip" (its row becomes a padding row of its batch: masked, weight 0,
    named in `stats()` and the state; see docs/errors.md). Default "raise": nothing is left
    out of training unless asked for."""
    max_skipped: int | float | None = None
    """With errors="skip", the samples an epoch may skip before the error is raised: a count
    (int >= 0) or a fraction of the epoch's samples (float in (0, 1], at least 1 sample).
    Default None: 0.01 of the epoch, room for a few corrupt files while a transform broken
    for every sample stops in its first batches."""

    service: str | None = None
    """Where the per-sample work runs instead: a tf.data service dispatcher
    ("grpc://host:port") or a Ray cluster ("ray", "ray://host:port"); None: on this host."""

    @property
    def error_policy(self) -> ErrorPolicy:
        """`errors` and `max_skipped`, as the pipeline applies them."""
        return ErrorPolicy(self.errors, self.max_skipped)

    def __post_init__(self):
        # Counts are kept as Python ints, whatever integer type was given: a numpy integer
        # would reach the state, which JSON, torch.load(weights_only=True) and
        # tf.train.Checkpoint then refuse.
        keep = object.__setattr__
        size = check_int("global_batch_size", self.global_batch_size, "pass the samples per step")
        keep(self, "global_batch_size", size)
        check_remainder(self.remainder)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"`shuffle`={self.shuffle!r} must be True or False.")
        keep(self, "seed", check_seed(self.seed))
        if not (isinstance(self.workers, str) and self.workers == AUTO):
            workers = check_int(
                "workers",
                self.workers,
                "use 0 for one background thread, the number of workers (for example "
                'os.cpu_count()), or "auto" to let the feeder measure and pick',
                minimum=0,
            )
            keep(self, "workers", workers)
        depth = check_int("depth", self.depth, "use depth=2 to hide one step's transfer")
        keep(self, "depth", depth)
        check_error_policy(self.errors, self.max_skipped)
        if self.worker_mode not in WORKER_MODES:
            raise ValueError(f'`worker_mode`={self.worker_mode!r} must be "process" or "thread".')
        if self.timeout_s is not None:
            if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
                raise TypeError(f"`timeout_s`={self.timeout_s!r} must be a number of seconds.")
            if not self.timeout_s > 0:
                raise ValueError(f"`timeout_s`={self.timeout_s!r} must be > 0 seconds or None.")
            if self.workers == 0 and not is_ray(self.service):
                raise ValueError(
                    f"`timeout_s`={self.timeout_s!r} watches workers, but `workers`=0; use "
                    "workers >= 1 or timeout_s=None."
                )
