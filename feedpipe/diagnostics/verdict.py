"""Judging: what a diagnosis measured, and what it concludes from it.

A `Diagnosis` holds the three measurements of `feedpipe.diagnostics.measure` (producer alone,
consumer alone, both together) and the remedies of `feedpipe.diagnostics.remedies`, and judges:
the input-bound fraction and its bound, the verdict by the TensorFlow profiler's thresholds
("cannot tell" where the bound spans two of them), the overlap efficiency and real over
synthetic. `str()` is the printed report, `to_dict()` the JSON of `feedpipe diagnose --json`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from feedpipe.core.cost import SampleCost
from feedpipe.core.description import FeederDescription
from feedpipe.core.stats import verdict
from feedpipe.diagnostics._headspace import CANNOT_TELL, bounded_verdict

SCHEMA_VERSION = 4
"""The version of `Diagnosis.to_dict()`'s layout (and so of `feedpipe diagnose --json`): 2
added the step alone's bound, the measurement's time and this number; 3 added `feeder`, what
`Feeder.describe()` says of a Feeder input; 4 added `sample_cost`, `producer_cpu_share` and
each remedy's `options` and `tried_steps_per_s`."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepTiming:
    """One step of the together measurement."""

    wait_s: float
    """Time the step waited for its batch."""
    compute_s: float
    """Time the step itself took."""
    staged: int | None
    """Batches already staged on the devices when the step asked (a `Feeder` input only,
    whatever the step)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Remedy:
    """One change that would feed the step better, with the rate it could reach."""

    action: str
    """What to change."""
    why: str
    """The measurement behind it."""
    expected_steps_per_s: float
    """The rate the change could reach: an estimate from the three measurements."""
    gain: float
    """`expected_steps_per_s` over the rate measured together."""
    options: dict | None = None
    """The `fp.Feeder` arguments that make the change, where it is one of the feeder's
    settings (so that it can be tried)."""
    tried_steps_per_s: float | None = None
    """Batches/s the input made alone with `options`, tried briefly after ranking (the first
    remedy only; None where it was not tried)."""
    elsewhere: bool = False
    """Whether the change needs more than this machine (Ray's or tf.data service's workers):
    it then ranks below every change that works here."""


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What `diagnose` measured and concluded; `str()` is the printed report."""

    input_kind: str
    step_kind: str
    batch_bytes: int
    producer_batch_s: tuple[float, ...]
    """Seconds to take each batch, producer alone."""
    consumer_step_s: tuple[float, ...]
    """Seconds of each step on a batch already on the devices, consumer alone (for a Keras
    model: timed before the together measurement and again after it)."""
    together: tuple[StepTiming, ...]
    """The together measurement, step by step. Derived waits are each step's time beyond the
    consumer-alone time, at least zero: for the timeline; the fraction comes from the means."""
    waits_derived: bool
    """True when the waits are derived (step time less the consumer-alone time), because the
    input is read inside a compiled step; False when they were timed directly."""
    remedies: tuple[Remedy, ...] = ()
    step_alone_range_s: tuple[float, float] | None = None
    """The least and most seconds the step alone may have taken per step while together ran:
    the consumer-alone measurements before and after it, each widened by twice its noise and by
    the delay other load caused the together measurement beyond its own (see
    `feedpipe.diagnostics._headspace.bracket`). Derived waits only; None where waits were timed
    directly."""
    measured_at: str = ""
    """When the measurement began, as an ISO 8601 time with its UTC offset."""
    keras_arrays_step_s: tuple[float, ...] = ()
    """Seconds of each step of the same model fed by Keras's own array input, as
    `model.fit(x, y)` feeds it, on the feeder's arrays: timed last, step by step in turn with
    `feeder_beside_step_s`, where the input is a Feeder over small numpy arrays onto CPUs and
    the step a Keras model; empty otherwise."""
    feeder_beside_step_s: tuple[float, ...] = ()
    """Seconds of each step fed by the feeder, taken in turn with `keras_arrays_step_s` so that
    both see the same load (the feeder gains time to stage while the other runs: an upper
    bound on its rate, so the comparison favours it)."""
    feeder: FeederDescription | None = None
    """What the input is, where it is a Feeder (`Feeder.describe()`); None otherwise."""
    sample_cost: SampleCost | None = None
    """What one sample costs to make, probed on a Feeder's own indexed source (see
    `feedpipe.core.cost`): waiting, GIL-bound or GIL-free; None for other inputs."""
    producer_cpu_share: float | None = None
    """This process's CPU time over the wall time of the producer-alone measurement (2.0:
    two cores busy): near 0, the input waits rather than computes here (its worker
    processes' CPU is not counted)."""

    @property
    def producer_steps_per_s(self) -> float:
        """Batches per second the input makes on its own."""
        return rate(self.producer_batch_s)

    @property
    def consumer_steps_per_s(self) -> float:
        """Steps per second the step runs on batches already on its devices."""
        return rate(self.consumer_step_s)

    @property
    def together_steps_per_s(self) -> float:
        """Steps per second of real training: input and step together."""
        return rate([s.wait_s + s.compute_s for s in self.together])

    @property
    def input_bound_fraction(self) -> float:
        """Share of the together time the step waited for its batch. With derived waits, one
        less the consumer-alone time over the mean step: from means, because clipping each
        step's noise at zero would count noise as wait."""
        took = [s.wait_s + s.compute_s for s in self.together]
        if self.step_alone_range_s is not None:
            return _waited(took, statistics.fmean(self.consumer_step_s))
        total = math.fsum(took)
        return math.fsum(s.wait_s for s in self.together) / total if total > 0 else 0.0

    @property
    def input_bound_range(self) -> tuple[float, float]:
        """The least and most the input-bound fraction may be: with derived waits, as the step
        alone ranges over `step_alone_range_s`; timed directly, the fraction itself."""
        if self.step_alone_range_s is None:
            return (self.input_bound_fraction, self.input_bound_fraction)
        low_s, high_s = self.step_alone_range_s
        took = [s.wait_s + s.compute_s for s in self.together]
        return (_waited(took, high_s), _waited(took, low_s))

    @property
    def verdict(self) -> str:
        """`not`, `moderately` or `highly input-bound` by the profiler's thresholds, or
        `cannot tell` when `input_bound_range` spans more than one of them."""
        return bounded_verdict(*self.input_bound_range)

    @property
    def overlap_efficiency(self) -> float:
        """Together ÷ the slower side alone: 1.0 when input and step fully overlap."""
        bound = min(self.producer_steps_per_s, self.consumer_steps_per_s)
        return self.together_steps_per_s / bound if bound > 0 else 0.0

    @property
    def real_over_synthetic(self) -> float:
        """Together ÷ consumer alone: near 1.0, the input costs the step nothing."""
        consumer = self.consumer_steps_per_s
        return self.together_steps_per_s / consumer if consumer > 0 else 0.0

    def to_dict(self) -> dict:
        """Every figure, the per-step timings and the remedies, JSON-serialisable."""
        low, high = self.input_bound_range
        return {
            "schema_version": SCHEMA_VERSION,
            "measured_at": self.measured_at,
            "verdict": self.verdict,
            "input_bound_fraction": self.input_bound_fraction,
            "input_bound_fraction_low": low,
            "input_bound_fraction_high": high,
            "producer_steps_per_s": self.producer_steps_per_s,
            "consumer_steps_per_s": self.consumer_steps_per_s,
            "together_steps_per_s": self.together_steps_per_s,
            "overlap_efficiency": self.overlap_efficiency,
            "real_over_synthetic": self.real_over_synthetic,
            "input_kind": self.input_kind,
            "step_kind": self.step_kind,
            "batch_bytes": self.batch_bytes,
            "waits_derived": self.waits_derived,
            "step_alone_range_s": (
                None if self.step_alone_range_s is None else list(self.step_alone_range_s)
            ),
            "remedies": [dataclasses.asdict(r) for r in self.remedies],
            "producer_batch_s": list(self.producer_batch_s),
            "consumer_step_s": list(self.consumer_step_s),
            "together": [dataclasses.asdict(s) for s in self.together],
            "keras_arrays_step_s": list(self.keras_arrays_step_s),
            "feeder_beside_step_s": list(self.feeder_beside_step_s),
            "feeder": None if self.feeder is None else self.feeder.to_dict(),
            "sample_cost": None
            if self.sample_cost is None
            else {
                **dataclasses.asdict(self.sample_cost),
                "waiting": self.sample_cost.waiting,
                "kind": self.sample_cost.kind,
            },
            "producer_cpu_share": self.producer_cpu_share,
        }

    def __str__(self) -> str:
        low, high = self.input_bound_range
        if self.verdict == CANNOT_TELL:
            judged = (
                f"{CANNOT_TELL}: the step waited for input {low:.1%} to {high:.1%} of the time "
                f"({verdict(low)} to {verdict(high)})"
            )
        elif high > low:
            judged = (
                f"{self.verdict}: the step waited for input {self.input_bound_fraction:.1%} of "
                f"the time (bound {low:.1%} to {high:.1%})"
            )
        else:
            judged = (
                f"{self.verdict}: the step waited for input {self.input_bound_fraction:.1%} of "
                "the time"
            )
        lines = [
            f"{judged} ({len(self.together)} steps; {self.step_kind} fed by {self.input_kind})",
            f"  producer alone   {self.producer_steps_per_s:10.1f} steps/s",
            f"  consumer alone   {self.consumer_steps_per_s:10.1f} steps/s  (batch already on "
            "the devices: the synthetic upper bound)",
            f"  together         {self.together_steps_per_s:10.1f} steps/s  "
            f"(overlap efficiency {self.overlap_efficiency:.2f}, real/synthetic "
            f"{self.real_over_synthetic:.2f})",
        ]
        if self.sample_cost is not None:
            lines.append(f"  the source       {self.sample_cost.describe()}")
        elif self.producer_cpu_share is not None:
            lines.append(
                f"  producer CPU     {self.producer_cpu_share:10.2f} cores of this process while "
                "it ran alone"
            )
        if self.keras_arrays_step_s:
            lines.append(
                f"  model.fit(x, y)  {rate(self.keras_arrays_step_s):10.1f} steps/s  (Keras's "
                f"own array input, step by step in turn with the feeder's "
                f"{rate(self.feeder_beside_step_s):,.1f})"
            )
        if self.step_alone_range_s is not None:
            low_s, high_s = self.step_alone_range_s
            lines.append(
                "  (the input is read inside the compiled step: waits are each step's time "
                f"less the consumer-alone time, {low_s * 1e3:.2f} to {high_s * 1e3:.2f} ms "
                "measured before and after together)"
            )
        lines.append("remedies, by the rate each could reach:")
        for rank, remedy in enumerate(self.remedies, 1):
            tried = ""
            if remedy.tried_steps_per_s is not None:
                tried = (
                    f"\n     tried here: the input alone then made "
                    f"{remedy.tried_steps_per_s:,.1f} batches/s"
                )
            lines.append(
                f"  {rank}. {remedy.action}: up to {remedy.expected_steps_per_s:,.1f} steps/s "
                f"({remedy.gain:.2f}x)\n     {remedy.why}{tried}"
            )
        return "\n".join(lines)


def _waited(took: list[float], alone_s: float) -> float:
    """The share of the mean step in `took` beyond `alone_s`: the wait, were the step alone
    `alone_s`."""
    return max(0.0, 1.0 - alone_s / statistics.fmean(took)) if took else 0.0


def rate(durations) -> float:
    """Steps per second over `durations`, one per step."""
    total = math.fsum(durations)
    return len(durations) / total if total > 0 else 0.0
