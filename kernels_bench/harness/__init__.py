"""The shared harness: settings, TensorFlow set-up, the emulated step, repetition and the report.

Every benchmark in `kernels_bench` follows one recipe: warm up (never timed), measure the peers
of one question side by side in each repetition, turn each repetition into ratios (so that drift
and noise from other work on the machine cancel within the repetition), and report the median
over at least 3 repetitions, with the spread, as JSON in `kernels_bench/results/<name>.json`
together with the environment it ran in. An absolute time means something only on a GPU.

This module is that recipe; the package's other modules hold what several scripts share beyond
it: `processes` (processes on loopback ended by PID), `accelerator` and `parts` (a run on one
accelerator in parts, and its bookkeeping), `images` (a Python image source and the peers'
inputs over it), `jax_staging` and `jax_gpu` (the JAX GPU questions' copies, step and command)
and `keras_fit` (Keras 3's fit on JAX against its peers).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
REPO_DIR = Path(__file__).resolve().parent.parent.parent

MIN_REPS = 3
"""Fewest repetitions a median is taken over (DESIGN.md, Metrics)."""
FULL_REPS = 5
"""Repetitions of a full run: the median of 5 survives two outliers."""


# ---- settings ----------------------------------------------------------------------------------


class Settings:
    """What a run was asked for: quick or full, repetitions, where the JSON goes."""

    def __init__(self, args: argparse.Namespace):
        self.quick: bool = args.quick
        self.reps: int = args.reps or (MIN_REPS if args.quick else FULL_REPS)
        if self.reps < MIN_REPS:
            raise SystemExit(f"--reps={self.reps}: a median needs at least {MIN_REPS}.")
        self.out_dir = Path(args.out_dir)
        self.seed: int = args.seed
        self.args = args

    def pick(self, quick: Any, full: Any) -> Any:
        """`quick` in a --quick run, else `full`."""
        return quick if self.quick else full

    def as_dict(self) -> dict:
        return {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(self.args).items()
        }


def parse_settings(
    doc: str | None,
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
) -> Settings:
    """Parses the command line every benchmark shares, plus the benchmark's own options."""
    parser = argparse.ArgumentParser(
        description=(doc or "").strip().split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer and shorter repetitions (for development)"
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help=f"repetitions (default {FULL_REPS}, or {MIN_REPS} with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data, orders and jitter")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where <name>.json is written")
    if add_args is not None:
        add_args(parser)
    return Settings(parser.parse_args(argv))


# ---- TensorFlow ------------------------------------------------------------------------------


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Hides what TensorFlow's C++ side prints while it loads (absl and CUDA-probe lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def configure_tf(num_devices: int = 2) -> list[str]:
    """Imports TensorFlow with `num_devices` logical CPU devices; returns their names.

    Must run before anything else touches TensorFlow's devices (it fixes them for the process).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _native_stderr_silenced():
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        with contextlib.suppress(RuntimeError):  # already initialised: checked below
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
            )
        names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(names) < num_devices:
        raise RuntimeError(
            f"TensorFlow was initialised with {len(names)} CPU devices before the benchmark "
            f"could configure {num_devices}; run the benchmark in a fresh process."
        )
    return names[:num_devices]


# ---- the emulated accelerator ----------------------------------------------------------------


class EmulatedStep:
    """An emulated accelerator step: a GIL-free `time.sleep` (the MLPerf Storage method).

    Each call sleeps `step_s * (1 + jitter * u)` with `u` uniform in [-1, 1], so the mean stays
    `step_s`. The durations come from a seeded sequence; `reset()` replays it, so runs compared
    with each other (the step alone, the step fed by the feeder) see the same durations.
    """

    def __init__(self, step_s: float, jitter: float = 0.0, seed: int = 0):
        if step_s < 0 or not 0 <= jitter < 1:
            raise ValueError(f"step_s={step_s} must be >= 0 and jitter={jitter} in [0, 1).")
        self.step_s = step_s
        self.jitter = jitter
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self._rng = np.random.default_rng([self.seed, 7])

    def duration_s(self) -> float:
        if not self.jitter:
            return self.step_s
        return self.step_s * (1.0 + self.jitter * self._rng.uniform(-1.0, 1.0))

    def __call__(self) -> None:
        time.sleep(self.duration_s())

    def as_dict(self) -> dict:
        return {"kind": "sleep", "step_s": self.step_s, "jitter": self.jitter}


class BusyStep:
    """An emulated step that keeps its core busy without holding the GIL.

    It hashes a 64 KiB buffer until `step_s` has passed; `hashlib` releases the GIL while it
    hashes more than 2 KiB, so other Python threads run meanwhile, as beside a real step whose
    thread dispatches work instead of sleeping. A woken thread's first microseconds are slow
    on some machines (virtual CPUs, deep idle states); this step never sleeps.
    """

    _BUFFER = bytes(64 * 1024)

    def __init__(self, step_s: float):
        self.step_s = step_s

    def __call__(self) -> None:
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            hashlib.sha256(self._BUFFER)

    def as_dict(self) -> dict:
        return {"kind": "busy (sha256, GIL released)", "step_s": self.step_s}


class SleepDebt:
    """Spends a known amount of GIL-free time in many small portions, accurately on average.

    `add(s)` books `s` seconds; the debt is slept off once it reaches `quantum_s`, and any
    oversleep is carried as negative debt. Per-sample sleeps of tens of microseconds would
    otherwise each overshoot by the kernel's timer slack (~50-100 µs).
    """

    def __init__(self, quantum_s: float = 0.001):
        self.quantum_s = quantum_s
        self.debt_s = 0.0

    def add(self, seconds: float) -> None:
        self.debt_s += seconds
        if self.debt_s >= self.quantum_s:
            started = time.perf_counter()
            time.sleep(self.debt_s)
            self.debt_s -= time.perf_counter() - started


def target_real_over_synthetic(report: Report, case: str, step_ms: float) -> None:
    """The R/S >= 0.95 target, which applies where the synthetic step takes >= 10 ms."""
    report.target(
        case,
        "real_over_synthetic",
        ">=",
        0.95,
        "R/S",
        applies=step_ms >= 10,
        why_not=f"synthetic step {step_ms:.1f} ms < 10 ms; reported only",
    )


def framework_env() -> dict[str, str]:
    """The environment of a fresh interpreter of one framework's venv, as a user of it runs
    one: no Keras backend or XLA devices chosen here, TensorFlow's start-up lines left out, and
    this checkout's feedpipe and kernels_bench first on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def endless(feeder) -> Iterator:
    """A feeder's batches across epoch boundaries (each `for` over a feeder is one epoch)."""
    while True:
        yield from feeder


# ---- repetition and statistics ---------------------------------------------------------------


@contextlib.contextmanager
def traced() -> Iterator[dict]:
    """The peak of memory allocated inside the block (`tracemalloc`, which sees numpy's
    buffers), as `peak_bytes` of the dict it yields."""
    out: dict = {}
    gc.collect()
    tracemalloc.start()
    try:
        yield out
    finally:
        out["peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def timed_then_traced(call: Callable[[], Any]) -> tuple[Any, float, int]:
    """What one call of `call` returns and its seconds, then the peak bytes of another call,
    traced apart: tracing slows each allocation, so a traced call's time would mean little."""
    gc.collect()
    started = time.perf_counter()
    made = call()
    seconds = time.perf_counter() - started
    with traced() as memory:
        call()
    return made, seconds, memory["peak_bytes"]


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarise(values: Sequence[float]) -> dict:
    """Median, spread and every repetition's value."""
    values = [float(v) for v in values]
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "reps": values,
    }


def rotate(items: Sequence[Any], rep: int) -> list[Any]:
    """`items` started at `rep`: each peer takes each position in turn across repetitions."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def cpu_clock(thread_ident: int) -> Callable[[], float]:
    """A clock of the CPU seconds a thread (by `threading.Thread.ident`) has used."""
    clock_id = time.pthread_getcpuclockid(thread_ident)
    return lambda: time.clock_gettime(clock_id)


# ---- environment -------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def version(package: str) -> str | None:
    """The installed version of `package`, or None where it is not installed."""
    import importlib.metadata as md

    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def environment() -> dict:
    """Versions, cores, devices, commit and machine load: what a reader needs to weigh a figure."""
    packages = ("tensorflow", "keras", "numpy", "optree", "psutil", "grain", "feedpipe")
    versions = {package: version(package) for package in packages}
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": versions,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        # Which tracked files differed from the commit, and a fingerprint of how: results
        # taken on a working tree are attributable to it.
        "git_modified": (_git("diff", "HEAD", "--name-only") or "").split(),
        "git_diff_sha1": hashlib.sha1((_git("diff", "HEAD") or "").encode()).hexdigest(),
        "switch_interval_s": sys.getswitchinterval(),
    }
    with contextlib.suppress(ImportError):
        import psutil

        env["memory_bytes"] = psutil.virtual_memory().total
    if "tensorflow" in sys.modules:
        tf = sys.modules["tensorflow"]
        env["tf_devices"] = [d.name for d in tf.config.list_logical_devices()]
        env["tf_intra_op_threads"] = tf.config.threading.get_intra_op_parallelism_threads()
        env["tf_inter_op_threads"] = tf.config.threading.get_inter_op_parallelism_threads()
    return env


# ---- the report --------------------------------------------------------------------------------

_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}


class Report:
    """Collects one benchmark's cases and targets, prints a compact table and writes JSON."""

    def __init__(self, name: str, question: str, settings: Settings, module: str):
        self.name = name
        self.question = question
        self.settings = settings
        self.command = f"python -m {module}" + (" --quick" if settings.quick else "")
        self.started = time.perf_counter()
        self.started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        self.cases: list[dict] = []
        self.targets: list[dict] = []
        self.notes: list[str] = []

    def add_case(
        self,
        case: str,
        params: dict,
        reps: Sequence[dict],
        units: dict | None = None,
        extra: dict | None = None,
    ) -> dict:
        """Adds a case from its repetitions: one dict of metric → value per repetition."""
        metrics = {}
        for key in reps[0]:
            values = [rep[key] for rep in reps if rep.get(key) is not None]
            if values:
                metrics[key] = summarise(values)
                if units and key in units:
                    metrics[key]["unit"] = units[key]
        entry = {"case": case, "params": params, "metrics": metrics}
        if extra:
            entry.update(extra)
        self.cases.append(entry)
        return entry

    def median(self, case: str, metric: str) -> float:
        for entry in self.cases:
            if entry["case"] == case:
                return entry["metrics"][metric]["median"]
        raise KeyError(case)

    def target(
        self,
        case: str,
        metric: str,
        op: str,
        threshold: float,
        label: str | None = None,
        applies: bool = True,
        why_not: str | None = None,
        value: float | None = None,
    ) -> dict:
        """Checks the median of `metric` in `case` (or `value`, a figure taken once over every
        repetition) against `op threshold`; a target that does not apply here may lack the
        metric."""
        try:
            value = self.median(case, metric) if value is None else value
        except KeyError:
            if applies:
                raise
            value = None
        entry = {
            "case": case,
            "metric": metric,
            "label": label or metric,
            "value": value,
            "op": op,
            "threshold": threshold,
            "met": bool(_OPS[op](value, threshold)) if applies else None,
        }
        if not applies:
            entry["not_applicable"] = why_not
        self.targets.append(entry)
        return entry

    def note(self, text: str) -> None:
        self.notes.append(text)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "question": self.question,
            "command": self.command,
            "quick": self.settings.quick,
            "reps": self.settings.reps,
            "settings": self.settings.as_dict(),
            "started_at": self.started_at,
            "duration_s": round(time.perf_counter() - self.started, 1),
            "load_average_at_start": self.load_at_start,
            "environment": environment(),
            "cases": self.cases,
            "targets": self.targets,
            "notes": self.notes,
        }

    def write(self) -> Path:
        """Writes `<out_dir>/<name>.json` (atomically) and returns its path."""
        out_dir = self.settings.out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2, default=_json_default) + "\n")
        tmp.replace(path)
        return path

    def print_table(self, columns: Sequence[str] | None = None) -> None:
        """One line per case: the median of each metric and, in brackets, its min-max."""
        print(f"\n{self.name}: {self.question}")
        mode = "quick" if self.settings.quick else "full"
        print(f"({mode} run, median of {self.settings.reps} repetitions [min-max])")
        width = max(len(c["case"]) for c in self.cases) if self.cases else 10
        for entry in self.cases:
            cells = []
            for key, stat in entry["metrics"].items():
                if columns is not None and key not in columns:
                    continue
                cells.append(
                    f"{key}={_fmt(stat['median'])} [{_fmt(stat['min'])}-{_fmt(stat['max'])}]"
                )
            print(f"  {entry['case']:<{width}}  " + "  ".join(cells))
        if self.targets:
            print("targets:")
            for t in self.targets:
                status = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
                print(
                    f"  [{status:^6}] {t['case']}: {t['label']} = {_fmt(t['value'])} "
                    f"(target {t['op']} {_fmt(t['threshold'])})"
                    + (f" - {t['not_applicable']}" if t["met"] is None else "")
                )
        for text in self.notes:
            print(f"note: {text}")

    def finish(self, columns: Sequence[str] | None = None) -> Path:
        self.print_table(columns)
        path = self.write()
        print(f"wrote {_relative(path)}")
        return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.2e}"
    return str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---- other work on the machine ----------------------------------------------------------------


def tree_cpu_s() -> float:
    """CPU-seconds of this process (every thread) and of the live processes it started."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def _machine_busy_s() -> float:
    """CPU-seconds the machine's cores have been busy, all processes (`/proc/stat`)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU-seconds of this process tree: running, and ended and waited for."""
    times = os.times()
    return tree_cpu_s() + times.children_user + times.children_system


class OtherLoad:
    """Cores that other processes kept busy during a `with` block: the machine's busy time less
    this process tree's, over the block's wall time. On a shared 2-core machine a repetition
    with other work beside it (say above 0.1 core) does not measure the peers alone."""

    cores = 0.0

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), _machine_busy_s(), _own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        other = (_machine_busy_s() - busy0) - (_own_cpu_s() - own0)
        self.cores = max(0.0, other / wall) if wall > 0 else 0.0
