"""`workers="auto"`: the feeder picks its workers by measuring them, while the first epoch is made.

It makes batches at once in its own thread, as `workers=0` does, so the first batch comes no
later, and those batches measure what a sample costs: its wall time and the producing thread's
CPU time. `feedpipe.core.cost` then ranks the settings; the best is started in the background
(processes take a while to spawn) and takes over at the next batch once it is ready, and its
own batches measure what it really makes. Threads that fall short of the prediction show how
much of a sample holds the GIL, and the ranking is made again. Threads close to the best are
tried first: they start at once. A setting is tried only where it is predicted `BETTER` than
the best measured so far, at most `MAX_TRIALS` of them; then the
fastest measured is kept for good and every other pool is closed. Who makes a batch never
changes which samples it holds, so the order and the state are those of any fixed setting.

Each worker process holds its own copy of the source, so processes are tried only as many as
fit the memory available (`AutoProducer._fitting`): one worker is started first, and what it
holds once it has loaded the source and read a sample caps the count of every pool of
processes. `close()` ends a pool still starting, so that none outlives the feeder.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

from feedpipe.core import env
from feedpipe.core._contention import snapshot, thread_run_delay_s
from feedpipe.core.cost import SampleCost, Setting, free_cores_since
from feedpipe.core.machine import available_host_bytes
from feedpipe.core.producers import Producer, SlotSupply, ThreadProducer, WorkerProducer
from feedpipe.core.sampler import EpochEnd, Step
from feedpipe.core.slots import HostSlot
from feedpipe.core.state import Position

TRIAL_S = 0.25
"""Seconds of production each setting is measured over (and at least `TRIAL_BATCHES`)."""
TRIAL_BATCHES = 4
WARM_BATCHES = 4
"""Batches a setting makes before it is measured: a new pool's first tasks map its slots and
warm its code up, which its steady state never pays again."""
MAX_TRIALS = 3
"""Settings tried beyond the feeder's own thread."""
BETTER = 1.1
"""A setting is tried only where it is predicted this much faster than the best measured."""
SOONER = 0.5
"""Threads predicted at least this share of the best setting's rate are tried before it."""

CLOSE_WAIT_S = 10.0
"""How long `close()` waits for a pool that was starting to give up once its processes are
killed: it has only to notice (or to finish pickling its setup, which may take seconds)."""

MEMORY_SHARE = 0.5
"""Trial processes may take at most this share of the memory available. A worker is measured
once it has loaded the source and read one sample; reading on grows it (a transform's
intermediates, caches the source fills, the allocator's free lists), and the training process
allocates from the same memory meanwhile (the model, batches in flight): half leaves room for
both to double."""

Key = tuple[str, int]
"""A setting as (mode, workers)."""


class _Starting:
    """The pools of processes starting in the background: once closed, each is ended as soon
    as its processes exist, so that none outlives the feeder while it spawns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._pools: list = []

    def opened(self, pool) -> None:
        with self._lock:
            if not self._closed:
                self._pools.append(pool)
                return
        pool.end()

    def started(self, pool) -> None:
        """`pool` is ready: its producer closes it from here on."""
        with self._lock:
            if pool in self._pools:
                self._pools.remove(pool)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = self._pools, []
        for pool in pools:
            pool.end()


class _TimedSupply:
    """The pipeline's supply, timing the waits for a free slot: those are the consumer's
    pace, not the producer's, and are left out of what a setting is measured to make."""

    def __init__(self, supply: SlotSupply):
        self.supply = supply
        self.waited_s = 0.0

    def acquire(self) -> HostSlot:
        started = time.perf_counter()
        try:
            return self.supply.acquire()
        finally:
            self.waited_s += time.perf_counter() - started

    def __getattr__(self, name: str):
        return getattr(self.supply, name)


@dataclasses.dataclass
class _Window:
    """What the setting running now has made since it took over.

    Its time runs from asking for its first batch to receiving its last, less the waits for a
    free slot: a pool goes on making batches while the feeder's thread stages one, so only the
    time between batches, not the time spent inside the producer, says what it makes.
    """

    samples: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0
    queued_s: float = 0.0
    """Of `busy_s`, the time the feeder's thread was ready to run but other load held the CPU."""
    batches: int = 0
    began: float = 0.0
    queued_began_s: float = 0.0
    waited_before_s: float = 0.0
    warmed: int = 0
    """Batches made before the measurement began (`WARM_BATCHES`)."""

    def full(self) -> bool:
        return self.batches >= TRIAL_BATCHES and self.busy_s >= TRIAL_S


class AutoProducer(Producer):
    """Makes batches with the fastest setting it has measured, measuring while it picks."""

    slots_in_flight = 2
    """As a pool of workers over an indexed source, whichever setting runs."""

    def __init__(
        self, inline: ThreadProducer, start_pool: Callable[[Setting], WorkerProducer], refused: str
    ):
        """`inline` makes batches in the feeder's thread; `start_pool(setting)` starts the
        pool of a setting and returns its producer (it runs in the background); `refused`
        says why processes cannot be used ("" where they can)."""
        self.inline = inline
        self.start_pool = start_pool
        self.refused = refused
        self.setting = Setting("thread", 0, math.nan)
        """The setting making the batches now."""
        self.producers: dict[Key, Producer] = {_key(self.setting): inline}
        self.measured: dict[Key, float] = {}
        """Samples/s each setting tried made, while it was being measured."""
        self.cost: SampleCost | None = None
        self.settled = False
        self.why = "measuring: workers=0 makes the first batches"
        self._window = _Window()
        self._machine = snapshot(), time.perf_counter()
        self._pending: tuple[Setting, concurrent.futures.Future] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "feedpipe-auto")
        self._starting = _Starting()
        self._failed: dict[Key, str] = {}
        """Settings whose pool failed to start, and how."""
        self.worker_bytes: int | None = None
        """The memory one worker process holds of its own (USS) once it has loaded the source
        and read a sample; None until one has."""
        self.memory_capped = ""
        """How memory capped the processes tried ("" where it did not)."""

    # ---- making batches ------------------------------------------------------------------

    def slots(
        self, start: Position, supply: SlotSupply
    ) -> Iterator[tuple[Step, HostSlot] | EpochEnd]:
        timed = _TimedSupply(supply)
        position = start
        self._window = _Window()  # a new stream: the time before it is no setting's
        while True:
            producer = self.producers[_key(self.setting)]
            if self.settled:  # for good: its batches, with nothing timed around them
                yield from producer.slots(position, supply)
                return
            made = producer.slots(position, timed)
            try:
                while True:
                    began, cpu, waited = time.perf_counter(), time.thread_time(), timed.waited_s
                    queued = thread_run_delay_s()
                    item = next(made, None)
                    if item is None:
                        return
                    if isinstance(item, EpochEnd):
                        position = Position(item.epoch + 1, 0)
                        yield item
                        continue
                    step, _ = item
                    cpu_s = time.thread_time() - cpu
                    switch = self._made(
                        len(step.rows), (began, queued), waited, timed.waited_s, cpu_s
                    )
                    position = Position(step.epoch, step.index + 1)
                    yield item
                    if switch:
                        break
            finally:
                made.close()
            if isinstance(producer, WorkerProducer):
                producer.settle(timed)  # the slots its tasks still fill come back
            self._take_over()

    def _made(
        self,
        samples: int,
        asked: tuple[float, float],
        waited_before_s: float,
        waited_s: float,
        cpu_s: float,
    ) -> bool:
        """Books one batch of the setting running, asked for at `asked` (the clock, and this
        thread's run-queue wait then; the slot waits so far `waited_before_s` then, `waited_s`
        now; `cpu_s` of this thread spent inside); whether another setting should take over
        now."""
        if self.settled:
            return False
        if self._pending is not None:
            return self._pending[1].done()
        window = self._window
        if window.warmed < WARM_BATCHES:
            window.warmed += 1
            return False
        if not window.batches:
            self._machine = snapshot(), time.perf_counter()
            window.began, window.queued_began_s = asked
            window.waited_before_s = waited_before_s
        window.samples += samples
        window.busy_s = time.perf_counter() - window.began - (waited_s - window.waited_before_s)
        window.cpu_s += cpu_s
        window.queued_s = thread_run_delay_s() - window.queued_began_s
        window.batches += 1
        if not window.full():
            return False
        self._learn(window)
        return self._next_trial()

    def _learn(self, window: _Window) -> None:
        """What the window says of the samples and of the setting that made them."""
        rate = window.samples / window.busy_s if window.busy_s > 0 else math.inf
        self.measured[_key(self.setting)] = rate
        if self.setting.workers == 0:
            wall_s = 1.0 / rate
            cpu_s = window.cpu_s / window.samples
            free = free_cores_since(*self._machine)
            self.cost = SampleCost(
                wall_s=wall_s,
                cpu_s=cpu_s,
                gil_s=cpu_s,
                threads=0,
                threads_rate=math.nan,
                parallel_cpu=math.nan,
                samples=window.samples,
                free_cores=free,
                queued_s=min(window.queued_s, window.busy_s) / window.samples,
            )
        elif self.setting.mode == "thread" and self.cost is not None:
            # Threads that outran one thread's CPU time released the GIL for the rest of it.
            gil_s = min(self.cost.gil_s, 1.0 / rate)
            self.cost = dataclasses.replace(self.cost, gil_s=gil_s)

    def _next_trial(self) -> bool:
        """Starts the next setting worth trying in the background, or settles.

        Worth trying: not tried yet, and predicted `BETTER` than the best measured. Threads go
        first where predicted at least `SOONER` of the best: they start at once, and feed the
        first epoch while a process pool spawns for the next trial.
        """
        best = max(self.measured.values())
        worth = [
            setting
            for setting in self.cost.settings(at_least_one=True)
            if _key(setting) not in self.measured
            and _key(setting) not in self._failed
            and not (setting.mode == "process" and self.refused)
            and setting.rate >= BETTER * best
        ]
        if worth and len(self.measured) - 1 < MAX_TRIALS:
            sooner = [s for s in worth if s.mode == "thread" and s.rate >= SOONER * worth[0].rate]
            setting = self._fitting(sooner[0] if sooner else worth[0])
            if setting is None:
                return self._settle()
            self._pending = (setting, self._executor.submit(self._start, setting))
            self.why = f"measuring: trying {setting}, predicted {setting.rate:,.0f} samples/s"
            return False
        return self._settle()

    def _start(self, setting: Setting) -> tuple[Setting, Producer]:
        """`start_pool(setting)`, in the background thread, its processes watched from the
        moment they exist, so that `close()` can end them; the setting started and its
        producer. The first pool of several processes is preceded by one process, whose
        memory caps the count (`_fitting`)."""
        if setting.mode == "process" and self.worker_bytes is None and setting.workers > 1:
            self._watched(Setting("process", 1, math.nan), keep=False)
            fitting = self._fitting(setting)
            if fitting is None:
                raise MemoryError(self.memory_capped)
            setting = fitting
        return setting, self._watched(setting, keep=True)

    def _watched(self, setting: Setting, keep: bool) -> Producer:
        """The producer of `setting`'s pool, its processes' memory measured; closed unless
        `keep`."""
        from feedpipe.core.workers import watched

        with watched(self._starting.opened):
            producer = self.start_pool(setting)
        self._starting.started(producer.workers)
        if setting.mode == "process" and self.worker_bytes is None:
            self.worker_bytes = max(map(own_bytes, producer.workers.pids))
        if not keep:
            producer.workers.close()
            producer.close()
        return producer

    def _fitting(self, setting: Setting) -> Setting | None:
        """`setting`, with no more processes than fit `MEMORY_SHARE` of the memory available
        (once one worker's memory is known); None where not one fits, or where the setting
        that fits was tried already."""
        if setting.mode != "process" or not self.worker_bytes:
            return setting
        available, where = available_memory()
        if available is None:
            return setting
        fits = int(MEMORY_SHARE * available // self.worker_bytes)
        if fits >= setting.workers:
            return setting
        self.memory_capped = (
            f"memory capped processes at {fits}: each holds {_size(self.worker_bytes)} once it "
            f"has loaded the source (measured in one), and {fits} of them fit in "
            f"{MEMORY_SHARE:.0%} of the {_size(available)} available ({where})"
        )
        if fits < 1 or ("process", fits) in self.measured:
            return None
        return Setting("process", fits, self.cost.rate("process", fits))

    def _take_over(self) -> None:
        """Hands the batches to the setting started in the background (or the best measured,
        once settled); a pool that failed to start is named and passed over."""
        if self._pending is not None:
            setting, started = self._pending
            self._pending = None
            try:
                setting, self.producers[_key(setting)] = started.result()
                self.setting, self._window = setting, _Window()
                return
            except Exception as error:  # a pool that cannot start: the others go on
                self._failed[_key(setting)] = f"{type(error).__name__}: {error}"
                if self._next_trial():
                    self._take_over()
                return
        best = max(self.measured, key=self.measured.get)
        self.setting = Setting(best[0], best[1], self.measured[best])
        self._close_all_but(best)

    def _settle(self) -> bool:
        """Keeps the fastest setting measured, for good; True: the stream is handed over
        (`_take_over` keeps it and closes the other pools), and from there on it makes the
        batches with nothing timed around them."""
        self.settled = True
        best = max(self.measured, key=self.measured.get)
        tried = ", ".join(f"{_named(k)} {rate:,.0f}" for k, rate in self.measured.items())
        failed = "".join(
            f"; {_named(key)} failed to start ({why})" for key, why in self._failed.items()
        )
        refused = f"; no processes: {self.refused}" if self.refused else ""
        capped = f"; {self.memory_capped}" if self.memory_capped else ""
        self.why = (
            f"{_named(best)}: the fastest measured while the first batches were made "
            f"(samples/s: {tried}); {self.cost.describe()}{refused}{capped}{failed}"
        )
        return True

    def _close_all_but(self, kept: Key) -> None:
        for key, producer in list(self.producers.items()):
            if key != kept and isinstance(producer, WorkerProducer):
                producer.workers.close()
                del self.producers[key]

    # ---- what the feeder says of it -------------------------------------------------------

    @property
    def picked(self) -> str:
        """The setting making the batches now, and whether it is for good."""
        return str(self.setting) + ("" if self.settled else " (still measuring)")

    def close(self) -> None:
        """Closes every pool; one starting in the background is ended (its processes killed)
        and waited for, `CLOSE_WAIT_S` at most, so that no worker outlives the feeder."""
        self._starting.close()
        if self._pending is not None:
            started = self._pending[1]
            try:
                started.result(timeout=CLOSE_WAIT_S)
            except concurrent.futures.TimeoutError:
                pass
            except Exception:  # it failed to start, or was never started: nothing to close
                pass
            started.add_done_callback(_close_started)  # at once where it is done
        self._executor.shutdown(wait=False, cancel_futures=True)
        for producer in self.producers.values():
            if isinstance(producer, WorkerProducer):
                producer.workers.close()
                producer.close()
        self.producers = {_key(self.setting): self.inline}


def _key(setting: Setting) -> Key:
    return (setting.mode if setting.workers else "thread", setting.workers)


def _named(key: Key) -> str:
    return str(Setting(key[0], key[1], math.nan))


def _close_started(future: concurrent.futures.Future) -> None:
    """Closes the pool a setting started after the feeder closed."""
    if not future.cancelled() and future.exception() is None:
        _, producer = future.result()
        producer.workers.close()
        producer.close()


def available_memory() -> tuple[int | None, str]:
    """The bytes of memory new workers may take, and where that figure comes from:
    `FEEDPIPE_AVAILABLE_BYTES` where set, else what the system says is available (None where
    it says nothing)."""
    given = env.nbytes(env.AVAILABLE_BYTES)
    if given is not None:
        return given, env.AVAILABLE_BYTES
    found = available_host_bytes(shared=False)
    return (None, "") if found is None else found


def own_bytes(pid: int) -> int:
    """The memory process `pid` holds of its own (its unique set size: private pages, which
    another worker does not share), else its resident size; 0 where neither is readable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            fields = dict(line.split(":", 1) for line in file if ":" in line)
        return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:,.1f} GiB"
