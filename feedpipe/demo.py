"""`feedpipe demo`: the same training, fed synchronously and then through `fp.Feeder`.

A small MLP trains twice on the replicas of one framework (TensorFlow: a Keras model under
`tf.distribute.MirroredStrategy`, `feedpipe.tf.demo`; JAX: a jitted step sharded over the
devices, `feedpipe.jax.demo`), from the same weights, on the same batches, with the same
compiled step and the same number of steps:

1. *synchronous feeding*, the `feed_dict` pattern: every step the host reads the batch's
   samples, stacks them, places each replica's rows on its device, and only then runs the step;
   reading and computing never overlap;
2. *through the feeder*: a background thread reads and stages the next batches while the step
   runs, so the step finds its batch already on its devices.

The source is a map-style dataset whose samples take real time to read (a GIL-free wait, as
storage or network reads are), so the overlap the feeder buys is the one a user would see. The
wait is sized on the machine the demo runs on, so that reading a global batch takes half as
long as its step: slow enough that synchronous feeding pays for it every step, fast enough
that a feeder can hide it entirely. Without an accelerator the replicas are logical CPU
devices, made before the framework initialises.

The step alone is calibrated once, before the runs (`calibrate`): that one figure sizes the
reads, and the header and the report both print it. Each run also times its own steps, so the
report can say when the machine's noise (the step alone changing from one run to the other)
is larger than the speedup it reports (`noise_exceeds_effect`). `--json PATH` writes the run's
figures (`figures`) for a results record (`kernels_bench/demo.py`).

This module is the story and the report, and knows no framework; each framework's module
supplies a `Training`: its devices, model, step and placement. The framework is imported only
once chosen, so the JAX demo never loads TensorFlow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from feedpipe._frameworks import first_installed
from feedpipe.core.checks import check_int
from feedpipe.core.stats import FeedStats, verdict

if TYPE_CHECKING:
    from feedpipe.feeder import Feeder

FEATURES = 256
"""Floats per sample: 1 KiB records, small enough that reading, not copying, dominates."""
CLASSES = 10
DATASET_SIZE = 5000
"""Not a multiple of the global batch, so every epoch ends on a padded, masked batch."""
PER_REPLICA_BATCH = 32
"""Rows per replica; the global batch is this times the replicas, so it always divides."""
READ_SHARE = 0.5
"""Reading a global batch takes this share of the step's time: synchronous feeding adds it to
every step, and the feeder hides it behind the step."""
SLEEP_QUANTUM_S = 0.001
"""Waits are slept off in portions of at least this: a sleep of tens of microseconds overshoots
by about as much again, so per-sample sleeps would not add up to the wait asked for."""
WARMUP_STEPS = 2
"""Untimed steps before the calibration's: the first compiles the step, and the second still ran
about 1.5x slower than the later ones on TensorFlow here (35 to 63 ms against 23 to 28)."""
TIMED_STEPS = 10
"""Steps the calibration times; their median is the step alone: a few slow steps, as a busy
machine gives, move it little (a machine busy throughout the calibration still does, which
the report shows beside each run's own steps)."""
HIDDEN_UNITS = 1024
"""Width of the MLP's two hidden layers: its step outlasts reading a batch, on 2 cores too."""
LEARNING_RATE = 0.05
MOMENTUM = 0.9
"""SGD with momentum, as Keras's `SGD` applies it: velocity = momentum * velocity - rate *
gradient, then weights += velocity."""
NOISE_BANK = 4096
"""Distinct noise vectors the samples draw from, so building a sample is one cheap add."""
DEFAULT_STEPS = 150
DEFAULT_REPLICAS = 4
"""Replicas where `--devices` is not given, on TensorFlow and JAX (PyTorch trains on one)."""
QUICK_STEPS = 20
FRAMEWORKS = {
    "tensorflow": "feedpipe.tf.demo",
    "jax": "feedpipe.jax.demo",
    "torch": "feedpipe.torch.demo",
}
"""Each framework the demo runs on, in the order the default looks for them, and its module."""


class SyntheticRecords:
    """A map-style dataset of labelled feature vectors whose reads take storage time.

    `__getitem__` waits `read_latency_s` on average with `time.sleep`, which releases the GIL
    as a real file or network read does (the waits of each reading thread are booked and slept
    off in portions of `SLEEP_QUANTUM_S`, oversleep carried over), then builds the sample with
    numpy. Classes are overlapping clusters, so the loss falls steadily over the run.
    """

    def __init__(self, size: int = DATASET_SIZE, read_latency_s: float = 0.0, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.size = size
        self.read_latency_s = read_latency_s
        self._debt = threading.local()
        self._centers = rng.normal(scale=0.1, size=(CLASSES, FEATURES)).astype(np.float32)
        self._noise = rng.normal(size=(NOISE_BANK, FEATURES)).astype(np.float32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample index {index} is outside 0..{self.size - 1}")
        self._wait()
        label = index % CLASSES
        features = self._centers[label] + self._noise[(index * 7919) % NOISE_BANK]
        return features, np.int32(label)

    def _wait(self) -> None:
        debt = getattr(self._debt, "s", 0.0) + self.read_latency_s
        if debt >= SLEEP_QUANTUM_S:
            started = time.perf_counter()
            time.sleep(debt)
            debt -= time.perf_counter() - started
        self._debt.s = debt

    def __repr__(self) -> str:
        return f"SyntheticRecords(size={self.size}, read_latency_s={self.read_latency_s})"


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    """What one training run measured, in the units the report prints."""

    name: str
    steps: int
    wall_s: float
    """The whole training loop, from asking for the first batch to the last step's loss."""
    input_bound_fraction: float
    """Share of wall time the step waited for its input."""
    final_loss: float
    """Mean loss over the real samples of the last step."""
    step_s: float
    """Time spent inside the step, its batch already on the devices, over the whole run: the
    step alone as this run saw it, timed the same way in both runs."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def step_alone_s(self) -> float:
        """The step alone's mean time in this run."""
        return self.step_s / self.steps


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    """What the demo measured once, before the runs, to size its source."""

    step_s: float
    """The step alone: the median time of the compiled step on a batch already on its devices.
    The reads are sized from it, and the header and the report print it."""
    read_latency_s: float
    """Each sample's wait, so that reading a global batch takes `READ_SHARE` of `step_s`."""
    batch_read_s: float
    """Reading one global batch here once the wait is set, building included."""


class Training(Protocol):
    """What a framework's module supplies: one model, its compiled step, and its replicas.

    `Training(devices)` makes `devices` replicas (logical CPU devices where there is no
    accelerator; None: the framework's default, 4 on TensorFlow and JAX, 1 on PyTorch) and a
    seeded MLP of `HIDDEN_UNITS` units trained with SGD at `LEARNING_RATE` and `MOMENTUM`.
    """

    devices: list[str]
    """The replicas' devices, as the report names them."""
    on: str
    """What the replicas are: "GPUs", or "logical CPU devices: no GPU found"."""
    model: str
    """The model, as the report's first line names it."""

    def place(self, features: np.ndarray, labels: np.ndarray, real: np.ndarray) -> tuple:
        """`(inputs, mask)` of one global batch, each replica's rows on its device, as
        `batch.distributed()` gives them; returns once they are there."""

    def step(self, inputs: Any, mask: Any, num_valid: int) -> float:
        """One training step: the mean loss over the `num_valid` real samples, once computed."""

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the weights and optimizer state back to their current values."""

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        """The process-wide settings the step runs under, held for the block and put back after
        (PyTorch: its intra-op threads)."""

    def feeder(self, dataset: SyntheticRecords, global_batch_size: int) -> Feeder:
        """A feeder of `dataset` onto the replicas, in order."""

    def progress_bar(self, steps: int) -> Callable[[int, float], None]:
        """`update(done, loss)`: shows a run's progress."""


def progress_line(steps: int) -> Callable[[int, float], None]:
    """`update(done, loss)`: redrawn in place on a terminal; one line at the end otherwise."""
    started = time.perf_counter()

    def update(done: int, loss: float) -> None:
        if done == steps or sys.stdout.isatty():
            elapsed_s = time.perf_counter() - started
            line = f"\r{done}/{steps} - {elapsed_s:.0f}s - loss: {loss:.4f}"
            print(line, end="\n" if done == steps else "", flush=True)

    return update


def build_batch_synchronously(
    dataset: SyntheticRecords, step: int, global_batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The feed_dict pattern's host half: read, stack and pad step `step`'s batch, in the caller.

    Returns `(features, labels, real, num_valid)`, `real` marking the real rows. Batches follow
    the feeder's unshuffled order (epoch after epoch, the last batch of each padded and masked),
    so both runs train on the same samples.
    """
    steps_per_epoch = -(-len(dataset) // global_batch_size)
    first = (step % steps_per_epoch) * global_batch_size
    samples = [dataset[i] for i in range(first, min(first + global_batch_size, len(dataset)))]
    num_valid = len(samples)
    # Padding repeats the real rows, as the feeder's does; the mask hides it from the loss.
    rows_taken = np.resize(np.arange(num_valid), global_batch_size)
    features = np.stack([s[0] for s in samples])[rows_taken]
    labels = np.array([s[1] for s in samples], np.int32)[rows_taken]
    real = np.arange(global_batch_size) < num_valid
    return features, labels, real, num_valid


def train_synchronously(
    training: Training, dataset: SyntheticRecords, global_batch_size: int, steps: int
) -> RunResult:
    """Trains `steps` steps, building and placing each batch on the host right before its step."""
    update = training.progress_bar(steps)
    input_s = step_s = 0.0
    started = time.perf_counter()
    for i in range(steps):
        asked = time.perf_counter()
        features, labels, real, num_valid = build_batch_synchronously(dataset, i, global_batch_size)
        inputs, mask = training.place(features, labels, real)
        placed = time.perf_counter()
        loss = training.step(inputs, mask, num_valid)
        step_s += time.perf_counter() - placed
        input_s += placed - asked
        update(i + 1, loss)
    wall_s = time.perf_counter() - started
    return RunResult("synchronous feeding", steps, wall_s, input_s / wall_s, loss, step_s)


def train_with_feeder(
    training: Training, feeder: Feeder, steps: int
) -> tuple[RunResult, FeedStats]:
    """Trains `steps` steps on batches the feeder has already staged on the devices."""
    update = training.progress_bar(steps)
    done = 0
    step_s = 0.0
    started = time.perf_counter()
    while done < steps:
        for batch in feeder:  # each pass is one epoch
            inputs, mask = batch.distributed()
            stepping = time.perf_counter()
            loss = training.step(inputs, mask, batch.num_valid)
            step_s += time.perf_counter() - stepping
            done += 1
            update(done, loss)
            if done == steps:
                break
    wall_s = time.perf_counter() - started
    stats = feeder.stats()
    fed = RunResult("fp.Feeder", steps, wall_s, stats.input_bound_fraction, loss, step_s)
    return fed, stats


def _replicas(count: int) -> str:
    return f"{count} replica{'' if count == 1 else 's'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def speedup_of(runs: Sequence[RunResult]) -> float:
    """The feeder's steps/s over synchronous feeding's."""
    sync, fed = runs
    return fed.steps_per_s / sync.steps_per_s


def too_noisy(runs: Sequence[RunResult]) -> bool:
    """`noise_exceeds_effect` for the two runs: their steps alone and their speedup."""
    sync, fed = runs
    return noise_exceeds_effect((sync.step_alone_s, fed.step_alone_s), speedup_of(runs))


def noise_exceeds_effect(step_alone_s: tuple[float, float], speedup: float) -> bool:
    """Whether the step alone changed from one run to the other by more than the speedup.

    The step is the same in both runs, so a change in its own time is the machine's noise
    (other work, the step's threads): where it is larger than the effect reported, the speedup
    cannot be told apart from it. Both are compared as ratios, whichever way they go.
    """
    noise = max(step_alone_s) / min(step_alone_s) - 1
    effect = max(speedup, 1 / speedup) - 1
    return noise > effect


def print_header(
    training: Training, steps: int, dataset: SyntheticRecords, calibration: Calibration
) -> None:
    """What the demo trains, on what, and how its source was sized."""
    replicas = len(training.devices)
    print(
        f"feedpipe demo: {steps} steps of a {training.model} on {_replicas(replicas)} "
        f"({training.on}), global batch {PER_REPLICA_BATCH * replicas}\n"
        f"source: {len(dataset):,} synthetic samples of {FEATURES} floats; each read waits "
        f"{calibration.read_latency_s * 1e6:.0f} µs (GIL-free, like storage), so that reading a "
        f"batch takes about half a step here ({_ms(calibration.batch_read_s)}; the step alone, "
        f"calibrated: {_ms(calibration.step_s)})"
    )


def print_report(
    devices: Sequence[str],
    runs: Sequence[RunResult],
    stats: FeedStats,
    calibration: Calibration,
) -> None:
    """Both runs side by side, the speedup, the feeder's own verdict, and a warning where the
    machine's noise is larger than the speedup."""
    print(
        f"\n{'':22}{'steps/s':>9}{'ms/step':>9}{'step alone':>12}{'input-bound':>13}  "
        f"{'verdict':<24}{'final loss':>10}"
    )
    for run in runs:
        print(
            f"{run.name:<22}{run.steps_per_s:>9.1f}{1e3 / run.steps_per_s:>9.1f}"
            f"{_ms(run.step_alone_s):>12}{run.input_bound_fraction:>13.1%}  "
            f"{verdict(run.input_bound_fraction):<24}{run.final_loss:>10.4f}"
        )
    sync, fed = runs
    print(
        f"\nspeedup with the feeder: {speedup_of(runs):.2f}x on "
        f"{_replicas(len(devices))} ({', '.join(devices)})"
    )
    if too_noisy(runs):
        print(
            f"warning: the step alone took {_ms(sync.step_alone_s)} in one run and "
            f"{_ms(fed.step_alone_s)} in the other, a larger change than the speedup of "
            f"{speedup_of(runs):.2f}x: the machine's noise is larger than the effect, so do not "
            "trust this speedup (run the demo again when the machine is quieter)."
        )
    print(f"feeder: {stats}")
    print(
        "ms/step: the loop's time per step. step alone: the step's own time, its batch already "
        "on the\ndevices, timed in each run and once before them (calibrated: "
        f"{_ms(calibration.step_s)}, the header's figure, which\nsized the reads; feeder.stats() "
        "counts it in samples/s of the loop's time not spent waiting).\ninput-bound: share of "
        "wall time the step waited for its batch (synchronous: the host building\nit; feeder: "
        "feeder.stats()); verdicts use the TensorFlow profiler's thresholds of 5 % and 20 %."
    )


def figures(
    framework: str,
    training: Training,
    runs: Sequence[RunResult],
    calibration: Calibration,
) -> dict[str, Any]:
    """One run's figures, as `--json` writes them: what `kernels_bench/demo.py` records."""
    sync, fed = runs
    return {
        "framework": framework,
        "framework_version": importlib.metadata.version(framework),
        "python": platform.python_version(),
        "model": training.model,
        "devices": list(training.devices),
        "on": training.on,
        "steps": sync.steps,
        "global_batch_size": PER_REPLICA_BATCH * len(training.devices),
        "speedup": speedup_of(runs),
        "steps_per_s_sync": sync.steps_per_s,
        "steps_per_s_feeder": fed.steps_per_s,
        "input_bound_sync_pct": 100 * sync.input_bound_fraction,
        "input_bound_feeder_pct": 100 * fed.input_bound_fraction,
        "step_alone_ms": 1e3 * calibration.step_s,
        "step_alone_sync_ms": 1e3 * sync.step_alone_s,
        "step_alone_feeder_ms": 1e3 * fed.step_alone_s,
        "batch_read_ms": 1e3 * calibration.batch_read_s,
        "read_latency_us": 1e6 * calibration.read_latency_s,
        "final_loss_sync": sync.final_loss,
        "final_loss_feeder": fed.final_loss,
        "loss_equal": sync.final_loss == fed.final_loss,
        "noise_warning": too_noisy(runs),
    }


def measure_read_s(dataset: SyntheticRecords, samples: int = 256) -> float:
    """Seconds to read one sample here, on average: the wait and the building."""
    started = time.perf_counter()
    for index in range(samples):
        dataset[index % len(dataset)]
    return (time.perf_counter() - started) / samples


def measure_step_s(training: Training, inputs: Any, mask: Any, num_valid: int) -> float:
    """The median time of the compiled step on a batch already on its devices, after
    `WARMUP_STEPS` untimed ones."""
    for _ in range(WARMUP_STEPS):
        training.step(inputs, mask, num_valid)
    times = []
    for _ in range(TIMED_STEPS):
        started = time.perf_counter()
        training.step(inputs, mask, num_valid)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def calibrate(training: Training, dataset: SyntheticRecords, global_batch_size: int) -> Calibration:
    """Times the step alone, once, and sizes `dataset`'s reads from it; the weights are put
    back as they were, so both runs start from them."""
    features, labels, real, num_valid = build_batch_synchronously(dataset, 0, global_batch_size)
    inputs, mask = training.place(features, labels, real)
    restore = training.snapshot()
    step_s = measure_step_s(training, inputs, mask, num_valid)
    restore()
    per_sample_s = READ_SHARE * step_s / global_batch_size
    dataset.read_latency_s = max(0.0, per_sample_s - measure_read_s(dataset))
    batch_read_s = measure_read_s(dataset) * global_batch_size
    return Calibration(step_s, dataset.read_latency_s, batch_read_s)


def choose_framework(framework: str | None = None) -> str:
    """`framework` ("tensorflow", "jax" or "torch") once checked to be installed; None: the
    first installed of them, in that order."""
    if framework is None:
        return first_installed("The demo trains on")
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"`--framework`={framework!r} must be one of {', '.join(map(repr, FRAMEWORKS))}."
        )
    if importlib.util.find_spec(framework) is None:
        raise ImportError(
            f"`--framework`={framework!r} is not installed here; install it: "
            f'pip install "feedpipe[{framework}]".'
        )
    return framework


def run(
    steps: int | None = None,
    devices: int | None = None,
    quick: bool = False,
    framework: str | None = None,
    json_path: str | None = None,
) -> list[RunResult]:
    """Runs the demo on `framework` (see `choose_framework`) and prints its report; writes its
    figures to `json_path` where given; returns both runs' results."""
    if steps is None:
        steps = QUICK_STEPS if quick else DEFAULT_STEPS
    check_int("--steps", steps, f"pass the training steps per run, e.g. --steps {DEFAULT_STEPS}")
    framework = choose_framework(framework)
    module = importlib.import_module(FRAMEWORKS[framework])
    training: Training = module.Training(devices)
    global_batch_size = PER_REPLICA_BATCH * len(training.devices)
    dataset = SyntheticRecords()
    with training.pinned():
        calibration = calibrate(training, dataset, global_batch_size)
        print_header(training, steps, dataset, calibration)
        restore = training.snapshot()
        print("\n1/2 synchronous feeding (feed_dict pattern): build the batch, then run the step")
        sync = train_synchronously(training, dataset, global_batch_size, steps)
        restore()
        print("2/2 fp.Feeder: the next batches are read and staged while the step runs")
        with training.feeder(dataset, global_batch_size) as feeder:
            fed, stats = train_with_feeder(training, feeder, steps)
    print_report(training.devices, [sync, fed], stats, calibration)
    if json_path is not None:
        with open(json_path, "w") as file:
            json.dump(figures(framework, training, [sync, fed], calibration), file, indent=2)
            file.write("\n")
    return [sync, fed]
