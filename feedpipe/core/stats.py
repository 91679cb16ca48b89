"""Stats: is the accelerator starved, and why.

The signal is read where the step takes its batch: the time it waited for a staged batch,
against the whole step. Its share of wall time is the *input-bound fraction*, judged with the
TensorFlow profiler's thresholds (under 5 %: not input-bound; 5-20 %: moderately; 20 % or
more: highly). The producer side says why: waiting for room means the step is the bottleneck.
"""

from __future__ import annotations

import dataclasses

from feedpipe.core import copy_engine
from feedpipe.core.services import is_ray
from feedpipe.core.skips import SkippedSample, named

MODERATE_FRACTION = 0.05
"""The TensorFlow profiler's threshold for a moderately input-bound step."""
HIGH_FRACTION = 0.20
"""The TensorFlow profiler's threshold for a highly input-bound step."""


NOTHING_MEASURED = "no steps measured yet"
"""What `FeedStats.verdict` says before any batch was taken: there is nothing to judge."""
STARTUP_STEPS = 10
"""The feeder's first timed steps, kept out of the steady-state figures as start-up: a jitted
step compiles in its first calls (twice in `examples/jax_custom_loop.py`, whose second call
takes the first's outputs, placed otherwise), Keras traces its step function on the first; 10
leaves room for those and is a sliver of any epoch worth measuring."""
STAGES = ("gather", *copy_engine.STAGES)
"""What the staging thread does for each batch, in order, as `FeedStats.stage_s` times it:
making the batch in host memory, then (on the copy engine's path) its stages; the framework's
own copy is timed as "copy issued" and "copy waited"."""
WAIT_NOT_MEASURED = "input wait not measured"
"""What `FeedStats.verdict` says where every step's batch was gathered in TensorFlow's own
threads (`as_dataset()` over arrays): the steps are counted, their waits cannot be timed."""


def verdict(input_bound_fraction: float) -> str:
    """The profiler's words for an input-bound fraction."""
    if input_bound_fraction < MODERATE_FRACTION:
        return "not input-bound"
    if input_bound_fraction < HIGH_FRACTION:
        return "moderately input-bound"
    return "highly input-bound"


@dataclasses.dataclass(frozen=True, slots=True)
class FeedStats:
    """A snapshot of how well the feeder keeps the step fed, since it was built.

    The first wait of every freshly started stream (filling the pipeline) is reported as
    `startup_wait_s` and left out of the waits and occupancy. The feeder's first
    `STARTUP_STEPS` timed steps, where a step compiles, stay in `samples_per_s`, which so rises
    epoch by epoch as the compile is diluted; the `steady_*` figures leave them out.
    """

    steps: int
    """Batches the consumer has taken."""
    samples: int
    """Real samples in those batches (padding not counted)."""
    wall_s: float
    """Consumer time across those steps: `consumer_wait_s` plus the time spent in the step."""
    consumer_wait_s: float
    """Time the step waited for its staged batch. Near 0: the input is hidden behind compute."""
    producer_wait_s: float
    """Time the producer waited for room (every staged slot full). High: the step is the
    bottleneck (compute-bound), so a faster input would not help."""
    slot_wait_s: float
    """Time the producer waited for a free host slot: the consumer, or TensorFlow's own
    prefetching behind `as_dataset`, still held every earlier batch. High: raise `depth`."""
    producer_busy_s: float
    """Time the producer spent reading, transforming, writing and staging batches (the first
    batch of each stream, which pays one-off set-up costs, is left out)."""
    produced_samples: int
    """Real samples in the batches timed by `producer_busy_s`."""
    service_wait_s: float
    """The part of `producer_busy_s` spent waiting for rows from tf.data service or Ray tasks
    (0 without `service`). Near `producer_busy_s`: the service's workers (the Ray cluster's
    CPUs) are the limit; add workers (nodes)."""
    startup_wait_s: float
    """Time spent waiting for the first batch of each freshly started stream."""
    mean_occupancy: float
    """Staged batches waiting on the devices when the step asked, averaged over steps,
    from 0 to `depth`. Near 0: the step is starved; near `depth`: the input is ahead."""
    depth: int
    """Batches the feeder keeps staged per device ahead of the step."""
    overflow_slots: int
    """One-off host slots made because the consumer kept batches it had taken (0 normally)."""
    slots_allocated: int
    """Host slots made so far, overflow included. It stops growing once the pipeline runs:
    `depth + 2` with one producer thread (`depth + 3` where in-memory arrays are gathered ahead
    in threads), `depth + 3` with workers over an indexed source, `depth + 1 + workers` with
    workers over a generator (per mode: loop or `as_dataset`)."""
    staged: int = 0
    """Batches staged and not yet taken at this snapshot (0 when no loop runs): the occupancy
    the next step will find."""
    copies: int = 0
    """Batches whose host-to-device copy was timed (0 where the framework layer copies
    nothing it can time, as on TensorFlow)."""
    copied_bytes: int = 0
    """Bytes those copies moved."""
    copy_s: float = 0.0
    """Time the staging thread waited for those copies to finish."""
    page_locked: bool | None = None
    """Whether the host slots copied to an accelerator are page-locked (the copy engine reads
    them directly, near the link's rate); None where no slot is copied to an accelerator."""
    page_lock_reason: str | None = None
    """Why the slots are not page-locked, where `page_locked` is False."""
    untimed_steps: int = 0
    """Steps among `steps` whose wait for their batch could not be timed: TensorFlow's own
    threads gathered their batches (`as_dataset()` over arrays in memory), and the consumer
    took them from a `prefetch` no Python sees. Their time is in `wall_s` and `untimed_s`,
    and the input-bound fraction leaves them out."""
    untimed_s: float = 0.0
    """Consumer time across the `untimed_steps`, from one taken batch to the next."""
    service_lag_wait_s: float = 0.0
    """The part of `service_wait_s` spent on batches whose rows a slow, stopped or lost tf.data
    service worker held while the others went on: the feeder keeps at most
    `feedpipe.service.client.HELD_BYTES` of their later rows, then asks a new job for the rows
    held back. Above 0: a service worker lags (a busy, stopped or dead machine)."""
    service: str | None = None
    """Where the per-sample work runs, as `describe().service` names it ("ray",
    "ray://host:port", "grpc://host:port"); None: on this host."""
    copy_path: str | None = None
    """How the timed copies crossed to the devices: "feedpipe streams" (a CUDA stream of
    feedpipe's own per device, beside the running step) or the framework's own copy
    ("jax.device_put", which waits for the steps queued before it); `describe()` says why."""
    device_blocks: int = 0
    """Device memory blocks (one replica's batch each) that feedpipe's own streams copy into,
    allocated now over every device. It stops growing once the pipeline runs: at most
    `depth + 3` per device and the spares that let one fence cover many batches
    (`feedpipe.core.copy_engine.block_limit`), plus one per batch the consumer keeps beyond
    those."""
    fence_wait_s: float = 0.0
    """Time the staging thread waited for the device to finish a step before reusing a device
    block: the consumer had queued more steps than the device had run. Above 0: the step sets
    the pace, not the input."""
    fences: float = 0.0
    """Fences enqueued per device (each a tiny computation that tells when the steps reading
    released device blocks have run); about one per ten batches in the steady state."""
    staged_batches: int = 0
    """Batches the staging thread made and staged."""
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """The staging thread's time in each of `STAGES` over the `staged_batches`: "gather"
    (making the batch in host memory, or waiting for workers to), "fence" (a device block
    acquired), "copy issued", "copy waited" (the copies to the devices), "import" (the
    framework taking the copied memory). `stage_ms` gives them per batch."""
    steady_steps: int = 0
    """Timed steps after the feeder's first `STARTUP_STEPS` (start-up, where a jitted step
    compiles): the steady state's steps."""
    steady_samples: int = 0
    """Real samples in those steps."""
    steady_s: float = 0.0
    """Consumer time across those steps, waits included (the part of `wall_s` after
    start-up, untimed steps aside)."""
    steady_wait_s: float = 0.0
    """The part of `steady_s` the step waited for its staged batch."""
    workers_picked: str | None = None
    """The setting `workers="auto"` has picked, "(still measuring)" while it tries settings in
    the first batches; `describe().workers_chosen` says why. None where workers were given."""
    skipped: tuple[SkippedSample, ...] = ()
    """The samples `errors="skip"` left out of the batches taken, in order, each with its
    epoch, index, step and the type and message of its error (since the feeder was built, or
    since the epoch of the state it was restored to began), the first `RECORDS_KEPT` of each
    epoch (`feedpipe.core.skips`). Empty with `errors="raise"`."""
    skipped_unlisted: int = 0
    """The samples `errors="skip"` left out of the batches taken past those `skipped` lists,
    known by count alone."""

    @property
    def skipped_samples(self) -> int:
        """How many samples `errors="skip"` left out of the batches taken."""
        return len(self.skipped) + self.skipped_unlisted

    @property
    def copy_gb_per_s(self) -> float:
        """Host-to-device copy rate, GB/s (1e9 bytes): compare with the link's (PCIe Gen5 x16
        reaches ~55 from page-locked memory, a third of that or less from pageable)."""
        return self.copied_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def fences_per_batch(self) -> float:
        """Fences enqueued per device per batch copied: at most about 0.1 in the steady state."""
        return self.fences / self.copies if self.copies else 0.0

    @property
    def stage_ms(self) -> dict[str, float]:
        """The staging thread's mean milliseconds per batch in each stage that ran (see
        `stage_s`): where a batch's time goes, without a separate probe."""
        if not self.staged_batches:
            return {}
        return {
            stage: seconds * 1e3 / self.staged_batches
            for stage, seconds in self.stage_s.items()
            if seconds > 0
        }

    @property
    def copy_s_per_step(self) -> float:
        """Mean wait for one batch's copy; hidden behind the step while it is shorter."""
        return self.copy_s / self.copies if self.copies else 0.0

    @property
    def timed_steps(self) -> int:
        """Steps whose wait for their batch was timed: the input-bound fraction's steps."""
        return self.steps - self.untimed_steps

    @property
    def input_bound_fraction(self) -> float:
        """Share of wall time the step waited for input, over the timed steps; the profiler's
        starvation signal."""
        timed_s = self.wall_s - self.untimed_s
        return self.consumer_wait_s / timed_s if timed_s > 0 else 0.0

    @property
    def verdict(self) -> str:
        """`not`, `moderately` or `highly input-bound`, by the profiler's thresholds, over the
        timed steps; `no steps measured yet` before any, `input wait not measured` where no
        step's wait could be timed (then `fp.StarvationMonitor` judges the fit)."""
        if self.steps == 0:
            return NOTHING_MEASURED
        if self.timed_steps == 0:
            return WAIT_NOT_MEASURED
        return verdict(self.input_bound_fraction)

    @property
    def samples_per_s(self) -> float:
        """Real samples delivered per second of consumer wall time, over every step: start-up
        (a compile) included, so it rises epoch by epoch; see `steady_samples_per_s`."""
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_samples_per_s(self) -> float:
        """Real samples delivered per second after start-up (the `steady_steps`); 0 until the
        feeder's first `STARTUP_STEPS` timed steps are over."""
        return self.steady_samples / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def startup_s(self) -> float:
        """Consumer time across the start-up steps, the feeder's first `STARTUP_STEPS` timed
        ones (each stream's first wait aside: `startup_wait_s`)."""
        return max(self.wall_s - self.untimed_s - self.steady_s, 0.0)

    @property
    def producer_samples_per_s(self) -> float:
        """What the producer alone could sustain: real samples per second of its busy time."""
        busy = self.producer_busy_s
        return self.produced_samples / busy if busy > 0 else 0.0

    @property
    def consumer_samples_per_s(self) -> float:
        """What the step alone could sustain: samples per second of time not spent waiting
        (where no wait was timed, the samples delivered per second), after start-up once the
        steady state began, as `producer_samples_per_s` leaves each stream's first batch out."""
        if self.steady_steps:
            busy = self.steady_s - self.steady_wait_s
            return self.steady_samples / busy if busy > 0 else 0.0
        busy = self.wall_s - self.consumer_wait_s
        return self.samples / busy if busy > 0 else 0.0

    def __str__(self) -> str:
        if self.steps == 0:
            return f"{NOTHING_MEASURED}: no batch has been taken from the feeder"
        if self.timed_steps == 0:
            return (
                f"{WAIT_NOT_MEASURED}: {self.steps} steps took {self.samples:,} samples, "
                f"{self.samples_per_s:,.0f} samples/s delivered, producer alone "
                f"{self.producer_samples_per_s:,.0f}/s; TensorFlow's own threads gathered "
                "these batches from the arrays (as_dataset), where no wait can be timed: "
                "fp.StarvationMonitor(feeder) in the fit's callbacks measures it"
            )
        untimed = ""
        if self.untimed_steps:
            untimed = f" ({self.untimed_steps} more gathered by TensorFlow, untimed)"
        service = ""
        if self.service_wait_s > 0 and self.producer_busy_s > 0:
            share = self.service_wait_s / self.producer_busy_s
            lag = self.service_lag_wait_s / self.producer_busy_s
            lagging = f", {lag:.0%} for a lagging tf.data service worker" if lag else ""
            engine = "Ray tasks" if is_ray(self.service) else "tf.data service"
            service = f" ({share:.0%} of it waiting for {engine}{lagging})"
        return (
            f"{self.verdict}: input-bound fraction {self.input_bound_fraction:.1%} over "
            f"{self.timed_steps} steps{untimed}; {self._delivered()}, producer alone "
            f"{self.producer_samples_per_s:,.0f}/s{service}, step alone "
            f"{self.consumer_samples_per_s:,.0f}/s; mean occupancy "
            f"{self.mean_occupancy:.2f} of {self.depth}{self._copies()}{self._skips()}"
            + (f'; workers="auto" picked {self.workers_picked}' if self.workers_picked else "")
        )

    def _delivered(self) -> str:
        if not self.steady_steps:
            return (
                f"{self.samples_per_s:,.0f} samples/s delivered, all in start-up (the first "
                f"{STARTUP_STEPS} steps, where a step compiles)"
            )
        return (
            f"{self.steady_samples_per_s:,.0f} samples/s delivered after start-up (the last "
            f"{self.steady_steps} steps), {self.samples_per_s:,.0f}/s over every step "
            f"(start-up: the first {STARTUP_STEPS} took {self.startup_s:.2f} s)"
        )

    def _skips(self) -> str:
        if not self.skipped:
            return ""
        listed = named(self.skipped, self.skipped_unlisted)
        return f"; skipped {self.skipped_samples} failing samples ({listed})"

    def _copies(self) -> str:
        if not self.copies:
            return ""
        memory = {True: "page-locked", False: f"pageable: {self.page_lock_reason}"}.get(
            self.page_locked, "host memory"
        )
        path = f", {self.copy_path}" if self.copy_path else ""
        stages = ", ".join(f"{stage} {ms:.3f}" for stage, ms in self.stage_ms.items())
        fences = f"; {self.fences_per_batch:.2f} fences a batch" if self.fences else ""
        return (
            f"; copies {self.copy_gb_per_s:.1f} GB/s, {self.copy_s_per_step * 1e3:.2f} ms a "
            f"step ({memory}{path}); staging ms a batch: {stages}{fences}"
        )
