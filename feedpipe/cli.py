"""The `feedpipe` command: one subcommand per job, each in its own module, imported on use.

TensorFlow is imported only by the subcommand that runs, so `feedpipe --help` answers at once,
and only after `TF_CPP_MIN_LOG_LEVEL` is set, so TensorFlow's start-up chatter stays hidden.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _add_demo(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="train a small model fed synchronously, then through fp.Feeder, and compare",
        description=(
            "Trains a small Keras model under MirroredStrategy twice on synthetic data whose "
            "reads take storage time: once fed synchronously step by step (the feed_dict "
            "pattern), once through fp.Feeder. Prints steps/s, input-bound fractions and the "
            "speedup. Uses the GPUs if there are any, else logical CPU devices."
        ),
    )
    parser.add_argument(
        "--steps", type=_positive_int, help="training steps per run (default 150; 20 with --quick)"
    )
    parser.add_argument(
        "--devices",
        type=_positive_int,
        default=4,
        help="replicas: the first N GPUs, or N logical CPU devices without GPUs (default 4)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run of a few seconds")
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from feedpipe import demo

    demo.run(steps=args.steps, devices=args.devices, quick=args.quick)
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
        "--steps", type=_positive_int, default=50, help="steps timed per measurement (default 50)"
    )
    parser.add_argument(
        "--warmup", type=_positive_int, default=5, help="untimed steps first (default 5)"
    )
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--report", metavar="DIR", help="write an HTML report with plots to DIR")
    parser.set_defaults(run=_run_diagnose)


def _run_diagnose(args: argparse.Namespace) -> int:
    import json
    import sys

    from feedpipe.diagnosis import TargetError, diagnose, load_target

    try:
        source, step = load_target(args.target)
    except TargetError as error:
        print(f"feedpipe diagnose: error: {error}", file=sys.stderr)
        return 2
    try:
        diagnosis = diagnose(
            source,
            step,
            steps=args.steps,
            warmup=args.warmup,
            report_dir=args.report,
        )
    finally:
        close = getattr(source, "close", None)
        if callable(close):
            close()
    print(json.dumps(diagnosis.to_dict(), indent=1) if args.json else diagnosis)
    if args.report and not args.json:
        print(f"report: {args.report}/index.html")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="feedpipe",
        description="feedpipe keeps every accelerator fed: per-replica batches staged ahead.",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    _add_diagnose(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `feedpipe` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return args.run(args)
