"""The `feedpipe` command: one subcommand per job, each in its own module, imported on use.

TensorFlow is imported only by the subcommand that runs, where it is installed (never by
`feedpipe demo --framework jax`), so `feedpipe --help` and `feedpipe --version` answer at once.
Unless the user set `TF_CPP_MIN_LOG_LEVEL`, it is set to 2 before TensorFlow is imported, and
the lines TensorFlow's C++ start-up writes before that setting takes effect (no CUDA driver, a
failed cuInit, on a machine without a GPU) are caught at the descriptor and left out; any other
line is written back. The demo says itself which devices it runs on.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from feedpipe._version import __version__
from feedpipe.core.checks import check_int

START_UP_CHATTER = (
    "All log messages before absl::InitializeLog() is called",
    "cudart_stub.cc",
    "cuda_platform.cc",
    "cuda_executor.cc",
    "cpu_feature_guard.cc",
    "To enable the following instructions",
)
"""Pieces of the lines TensorFlow writes on start-up whatever `TF_CPP_MIN_LOG_LEVEL` says:
its CUDA probe on a machine without a GPU and its CPU-feature notice."""


class _Count(argparse.Action):
    """An option taking an integer >= 1, refused in the words of every count in feedpipe:
    "`--steps`=0.5 must be an integer >= 1; {fix}." (`fix` is the keyword `add_argument` gets)."""

    def __init__(self, *args: Any, fix: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fix = fix

    def __call__(self, parser, namespace, values, option_string=None):
        value: Any = values
        for number in (int, float):  # "0.5" reads as 0.5; text that is no number stays text
            with contextlib.suppress(ValueError):
                value = number(values)
                break
        try:
            setattr(namespace, self.dest, check_int(option_string, value, self.fix))
        except ValueError as error:
            parser.error(str(error))


def _add_demo(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="train a small model fed synchronously, then through fp.Feeder, and compare",
        description=(
            "Trains a small model twice on synthetic data whose reads take storage time: once "
            "fed synchronously step by step (the feed_dict pattern), once through fp.Feeder. "
            "Prints steps/s, input-bound fractions and the speedup. On TensorFlow a Keras MLP "
            "under MirroredStrategy, on JAX a jitted MLP sharded over the devices, on PyTorch "
            "an MLP on this process's device. Uses the GPUs if there are any, else logical CPU "
            "devices."
        ),
    )
    parser.add_argument(
        "--framework",
        choices=("tensorflow", "jax", "torch"),
        help="the framework to train with (default: the first installed of tensorflow, jax, torch)",
    )
    parser.add_argument(
        "--steps",
        action=_Count,
        fix="pass the training steps per run, e.g. --steps 150",
        help="training steps per run (default 150; 20 with --quick)",
    )
    parser.add_argument(
        "--devices",
        action=_Count,
        fix="pass the replicas to train on, e.g. --devices 4",
        help="replicas: the first N GPUs, or N logical CPU devices without GPUs (default 4; "
        "PyTorch trains on 1, one device per process)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run of a few seconds")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write this run's figures (speedup, input-bound %%, step alone, final losses, "
        "whether the noise warning fired) to PATH as JSON",
    )
    parser.set_defaults(run=_run_demo)


@contextlib.contextmanager
def _start_up_lines_left_out() -> Iterator[None]:
    """Runs the block with stderr caught at the descriptor, then writes back every caught line
    but TensorFlow's start-up chatter."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not any(piece in line for piece in START_UP_CHATTER):
                    sys.stderr.write(line)
            sys.stderr.flush()


def _start_tensorflow() -> None:
    """Imports TensorFlow, where it is installed, and lets it probe for GPUs, quietly unless
    the user chose a log level.

    Listing the physical devices runs the CUDA probe without starting TensorFlow's runtime, so
    the demo can still make its logical CPU devices afterwards.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ or importlib.util.find_spec("tensorflow") is None:
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with _start_up_lines_left_out():
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")


def _run_demo(args: argparse.Namespace) -> int:
    from feedpipe import demo

    try:
        framework = demo.choose_framework(args.framework)
    except ImportError as error:
        print(f"feedpipe demo: error: {error}", file=sys.stderr)
        return 2
    if framework == "tensorflow":
        _start_tensorflow()
    demo.run(
        steps=args.steps,
        devices=args.devices,
        quick=args.quick,
        framework=framework,
        json_path=args.json,
    )
    return 0


def _add_diagnose(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "diagnose",
        help="is the step starved of input? measure, give the verdict and the remedies",
        description=(
            "Runs the input alone, the step alone on a batch already on its devices, and both "
            "together; prints the verdict (the TensorFlow profiler's thresholds), the rates, "
            "the overlap efficiency and real/synthetic, and remedies ranked by expected gain."
        ),
    )
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="module:function or path/to/file.py:function returning (input, step)",
    )
    parser.add_argument(
        "--steps",
        action=_Count,
        fix="pass the steps timed per measurement, e.g. --steps 50",
        default=50,
        help="steps timed per measurement (default 50)",
    )
    parser.add_argument(
        "--warmup",
        action=_Count,
        fix="pass the untimed steps run first, e.g. --warmup 5",
        default=5,
        help="untimed steps first (default 5)",
    )
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--report",
        metavar="DIR",
        help='write an HTML report with plots to DIR (matplotlib: pip install "feedpipe[report]")',
    )
    parser.set_defaults(run=_run_diagnose)


def _run_diagnose(args: argparse.Namespace) -> int:
    import json

    if args.report:
        from feedpipe.diagnostics.report import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as error:
            print(
                f"feedpipe diagnose: error: --report {error} Or leave --report out: the "
                "verdict and the remedies need no matplotlib.",
                file=sys.stderr,
            )
            return 2
    _start_tensorflow()
    from feedpipe.diagnostics.diagnosis import TargetError, diagnose, load_target

    try:
        source, step = load_target(args.target)
    except TargetError as error:
        print(f"feedpipe diagnose: error: {error}", file=sys.stderr)
        return 2
    try:
        diagnosis = diagnose(source, step, steps=args.steps, warmup=args.warmup)
    finally:
        close = getattr(source, "close", None)
        if callable(close):
            close()
    if args.report:
        from feedpipe.diagnostics.report import write_report

        page = write_report(diagnosis, args.report, command=args.command)
    if args.json:
        print(json.dumps({"command": args.command, **diagnosis.to_dict()}, indent=1))
    else:
        print(diagnosis)
        if args.report:
            print(f"report: {page}")
    return 0


def _add_service(subcommands: argparse._SubParsersAction) -> None:
    from feedpipe.service.servers import EXPOSED, SAFE_SETUP

    exposed = f"{EXPOSED}; {SAFE_SETUP} (docs/multi-host.md)."
    parser = subcommands.add_parser(
        "service",
        help="run per-sample TensorFlow work on other machines' CPUs (tf.data service servers)",
        description=(
            "Runs TensorFlow's tf.data service servers, so that per-sample TensorFlow work "
            "(decode, augment) runs on other machines' CPUs: one dispatcher, and workers on "
            "the machines whose CPUs do the work. Each prints one line saying where it serves "
            "and serves until SIGTERM or Ctrl-C (exit 0). Trainers reach the service at the "
            "dispatcher's grpc://HOST:PORT. TensorFlow keeps a lost worker's tasks in its jobs, "
            "so those jobs end only once a worker serves at its address again: restart a lost "
            f"worker with the same --port and --worker-address. {exposed}"
        ),
    )
    roles = parser.add_subparsers(title="servers", metavar="SERVER", required=True)
    dispatcher = roles.add_parser(
        "dispatcher",
        help="hands out the work: the one server that trainers and workers connect to",
        description=f"Runs a tf.data service dispatcher (TensorFlow's DispatchServer). {exposed}",
    )
    dispatcher.add_argument(
        "--port",
        type=int,
        required=True,
        help="port to serve on, on every interface (0: a free one)",
    )
    dispatcher.add_argument(
        "--work-dir", metavar="DIR", help="directory for the dispatcher's state (its journal)"
    )
    dispatcher.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="journal the state to --work-dir, so a restarted dispatcher resumes its jobs",
    )
    dispatcher.set_defaults(run=_run_service, server="dispatcher")
    worker = roles.add_parser(
        "worker",
        help="runs the per-sample work on this machine's CPUs, for a dispatcher",
        description=f"Runs a tf.data service worker (TensorFlow's WorkerServer). {exposed}",
    )
    worker.add_argument(
        "--dispatcher", metavar="HOST:PORT", required=True, help="the dispatcher's address"
    )
    worker.add_argument(
        "--port",
        type=int,
        default=0,
        help="port to serve on, on every interface (default 0: a free one)",
    )
    worker.add_argument(
        "--worker-address",
        metavar="HOST:PORT",
        help=(
            "where trainers reach this worker, %%port%% standing for the port served on "
            "(default: this machine's name:%%port%%)"
        ),
    )
    worker.add_argument(
        "--wait-s",
        type=float,
        help="seconds to wait for the dispatcher to answer before giving up (default 60)",
    )
    worker.set_defaults(run=_run_service, server="worker")


def _run_service(args: argparse.Namespace) -> int:
    _start_tensorflow()
    from feedpipe.service.servers import LaunchError, serve_dispatcher, serve_worker

    try:
        if args.server == "dispatcher":
            serve_dispatcher(args.port, args.work_dir, args.fault_tolerant)
        else:
            wait = {} if args.wait_s is None else {"wait_s": args.wait_s}
            serve_worker(args.dispatcher, args.port, args.worker_address, **wait)
    except LaunchError as error:
        print(f"feedpipe service {args.server}: error: {error}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="feedpipe",
        description="feedpipe keeps every accelerator fed: per-replica batches staged ahead.",
    )
    parser.add_argument("--version", action="version", version=f"feedpipe {__version__}")
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    _add_diagnose(subcommands)
    _add_service(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `feedpipe` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["feedpipe", *argv])
    return args.run(args)
