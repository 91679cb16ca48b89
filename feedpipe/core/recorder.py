"""Counts what the pipeline's threads measure, each side only its own counters, and snapshots
the counts as `fp.FeedStats` (`feedpipe.core.stats`)."""

from __future__ import annotations

import time

from feedpipe.core.stats import STAGES, STARTUP_STEPS, FeedStats

_CONSUMER_COUNTERS = (
    "steps",
    "samples",
    "consumer_wait_s",
    "step_s",
    "occupancy_sum",
    "occupancy_count",
    "startup_wait_s",
    "_last_taken",
    "untimed_steps",
    "untimed_s",
    "steady_steps",
    "steady_samples",
    "steady_s",
    "steady_wait_s",
    "_steady_step",
)


class StatsRecorder:
    """Accumulates the figures behind `FeedStats`; each side writes only its own counters."""

    def __init__(self, depth: int):
        self.depth = depth
        self.steps = 0
        self.samples = 0
        self.consumer_wait_s = 0.0
        self.step_s = 0.0
        self.occupancy_sum = 0
        self.occupancy_count = 0
        self.startup_wait_s = 0.0
        self.producer_wait_s = 0.0
        self.slot_wait_s = 0.0
        self.producer_busy_s = 0.0
        self.produced_samples = 0
        self.service_wait_s = 0.0
        self._service_waited = 0.0
        self.service_lag_wait_s = 0.0
        self._service_lagged = 0.0
        self._producer_warm = False
        self._first_of_stream = False
        self._last_taken: float | None = None
        self.copies = 0
        self.copied_bytes = 0
        self.copy_s = 0.0
        self.copy_path: str | None = None
        self.device_blocks = 0
        self.fence_wait_s = 0.0
        self.fences = 0.0
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        """The staging thread's time in each of `STAGES`, over the `staged_batches`."""
        self.staged_batches = 0
        self.untimed_steps = 0
        self.untimed_s = 0.0
        self.steady_steps = 0
        self.steady_samples = 0
        self.steady_s = 0.0
        self.steady_wait_s = 0.0
        self._steady_step = False
        """Whether the step running now came after start-up: its time is the steady state's."""

    def gathered(
        self, *, steps: int, samples: int, wall_s: float, busy_s: float, produced: int
    ) -> None:
        """Records batches a framework gathered and the consumer took in its own threads:
        counted, timed from one taken to the next, their waits untimed (see `FeedStats`)."""
        self.steps += steps
        self.samples += samples
        self.untimed_steps += steps
        self.untimed_s += wall_s
        self.step_s += wall_s
        self.producer_busy_s += busy_s
        self.produced_samples += produced

    def copied(self, nbytes: int, seconds: float) -> None:
        """Records one batch's host-to-device copy, from its start to its end."""
        self.copies += 1
        self.copied_bytes += nbytes
        self.copy_s += seconds

    def taken(self, *, asked: float, got: float, occupancy: int, samples: int):
        """Records one batch taken by the consumer: asked for at `asked`, received at `got`."""
        if self._last_taken is not None:
            self._step_ended(asked - self._last_taken)
        self._steady_step = self.steps - self.untimed_steps >= STARTUP_STEPS
        if self._steady_step:
            self.steady_steps += 1
            self.steady_samples += samples
        startup, self._first_of_stream = self._first_of_stream, False
        if startup:
            self.startup_wait_s += got - asked
        else:
            self.consumer_wait_s += got - asked
            self.occupancy_sum += occupancy
            self.occupancy_count += 1
            if self._steady_step:
                self.steady_wait_s += got - asked
                self.steady_s += got - asked
        self.steps += 1
        self.samples += samples
        self._last_taken = got

    def produced(self, *, busy_s: float, samples: int, gather_s: float) -> None:
        """Records one batch made by the producer (`gather_s` of it making the batch in host
        memory, the rest staging it); the first of a stream only warms the producer up."""
        self.staged_batches += 1
        self.stage_s["gather"] += gather_s
        if self._producer_warm:
            self.producer_busy_s += busy_s
            self.produced_samples += samples
            self.service_wait_s += self._service_waited
            self.service_lag_wait_s += self._service_lagged
        self._service_waited = self._service_lagged = 0.0
        self._producer_warm = True

    def service_waited(self, seconds: float, lagging: bool = False) -> None:
        """Records a wait for rows from tf.data service, counted with the batch it makes;
        `lagging`: a worker held rows of that batch back while the others went on."""
        self._service_waited += seconds
        if lagging:
            self._service_lagged += seconds

    def stream_started(self) -> None:
        """A fresh stream begins: its first batch pays set-up costs and fills the pipeline."""
        self._producer_warm = False
        self._service_waited = self._service_lagged = 0.0
        self._first_of_stream = True

    def consumer_counters(self) -> dict:
        """The consumer's counters, to put back with `restore_consumer`."""
        return {name: getattr(self, name) for name in _CONSUMER_COUNTERS}

    def restore_consumer(self, counters: dict) -> None:
        """Forgets batches taken by a pass that did not count (see `Feeder.as_dataset`)."""
        for name, value in counters.items():
            setattr(self, name, value)

    def loop_ended(self, now: float | None = None) -> None:
        """Closes the last step of a loop; time outside loops is not step time."""
        if self._last_taken is not None:
            self._step_ended((now or time.perf_counter()) - self._last_taken)
        self._last_taken = None

    def _step_ended(self, seconds: float) -> None:
        self.step_s += seconds
        if self._steady_step:
            self.steady_s += seconds
        self._steady_step = False

    def snapshot(
        self,
        overflow_slots: int = 0,
        slots_allocated: int = 0,
        page_locked: bool | None = None,
        page_lock_reason: str | None = None,
        staged: int = 0,
        workers_picked: str | None = None,
        service: str | None = None,
    ) -> FeedStats:
        return FeedStats(
            steps=self.steps,
            samples=self.samples,
            wall_s=self.consumer_wait_s + self.step_s,
            consumer_wait_s=self.consumer_wait_s,
            producer_wait_s=self.producer_wait_s,
            slot_wait_s=self.slot_wait_s,
            producer_busy_s=self.producer_busy_s,
            produced_samples=self.produced_samples,
            service_wait_s=self.service_wait_s,
            startup_wait_s=self.startup_wait_s,
            mean_occupancy=(
                self.occupancy_sum / self.occupancy_count if self.occupancy_count else 0.0
            ),
            depth=self.depth,
            overflow_slots=overflow_slots,
            slots_allocated=slots_allocated,
            staged=staged,
            workers_picked=workers_picked,
            copies=self.copies,
            copied_bytes=self.copied_bytes,
            copy_s=self.copy_s,
            page_locked=page_locked,
            page_lock_reason=page_lock_reason,
            service_lag_wait_s=self.service_lag_wait_s,
            service=service,
            copy_path=self.copy_path if self.copies else None,
            device_blocks=self.device_blocks,
            fence_wait_s=self.fence_wait_s,
            fences=self.fences,
            staged_batches=self.staged_batches,
            stage_s=dict(self.stage_s),
            untimed_steps=self.untimed_steps,
            untimed_s=self.untimed_s,
            steady_steps=self.steady_steps,
            steady_samples=self.steady_samples,
            steady_s=self.steady_s,
            steady_wait_s=self.steady_wait_s,
        )
