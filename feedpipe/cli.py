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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="feedpipe",
        description="feedpipe keeps every accelerator fed: per-replica batches staged ahead.",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_demo(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `feedpipe` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return args.run(args)
