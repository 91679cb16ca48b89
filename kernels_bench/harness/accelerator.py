"""A run on one accelerator, in parts: its options, its command line, and the report that
describes the device beside the environment (`gpu.py` and its questions on JAX, `torch_gpu.py`
on PyTorch)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Callable

from kernels_bench import harness


def nvidia_smi() -> list[dict] | None:
    """What `nvidia-smi` says of each GPU: name, driver, memory and the PCIe link in use."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = fields.split(",")
    return [
        dict(zip(names, (value.strip() for value in line.split(",")), strict=False))
        for line in out.strip().splitlines()
    ]


def page_locker_info() -> dict:
    """The page locker feedpipe found, for the JSON."""
    from feedpipe.core.pinned import page_locker

    locker = page_locker()
    return {"available": locker.available, "library": locker.library, "reason": locker.reason}


class Report(harness.Report):
    """The harness's report with the accelerator's description beside the environment."""

    def __init__(self, *args, command: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command
        self.accelerator: dict = {}

    def as_dict(self) -> dict:
        return {**super().as_dict(), "accelerator": self.accelerator}


def add_copy_args(parser: argparse.ArgumentParser) -> None:
    """The copy part's options."""
    parser.add_argument("--copy-mb", default="2,16,64", help="copy sizes, MiB")


def add_rs_args(parser: argparse.ArgumentParser) -> None:
    """The R/S part's options (the busy part's step too)."""
    parser.add_argument(
        "--step-ms", default="30,5", help="R/S: the step's own time, ms (one case each)"
    )
    parser.add_argument("--hidden", type=int, default=4096, help="R/S: hidden units")
    parser.add_argument("--rs-batch", type=int, default=256, help="R/S: global batch")
    parser.add_argument("--rs-batches", type=int, default=8, help="R/S: batches in memory")
    parser.add_argument("--rs-steps", type=int, default=100, help="R/S: timed steps per peer")


def smoke_rs(args: argparse.Namespace) -> None:
    """Shrinks the R/S part's options (the busy part's step too) to run on CPU JAX."""
    args.step_ms = "20"
    args.hidden = 256
    args.rs_batch = 32
    args.rs_batches = 4
    args.rs_steps = 60


def add_copy_rs_args(parser: argparse.ArgumentParser) -> None:
    """The copy and R/S parts' options."""
    add_copy_args(parser)
    add_rs_args(parser)


def parse_run(
    doc: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    smoke: Callable[[argparse.Namespace], None],
    parts: tuple[str, ...],
    argv,
) -> tuple[harness.Settings, list[str]]:
    """The settings (shrunk by `smoke` under --smoke, --copy-mb and --step-ms as lists where
    they are options) and the parts asked for, checked against `parts`."""
    settings = harness.parse_settings(doc, add_args, argv)
    args = settings.args
    if args.smoke:
        smoke(args)
        settings = harness.Settings(args)
    for name in ("copy_mb", "step_ms"):
        if hasattr(args, name):
            setattr(args, name, [float(v) for v in str(getattr(args, name)).split(",")])
    asked = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(asked) - set(parts)
    if unknown:
        raise SystemExit(f"--parts={args.parts}: unknown {sorted(unknown)}; use {parts}.")
    return settings, asked


def command_line(base: str, args: argparse.Namespace, parts: tuple[str, ...]) -> str:
    """`base` with the options that say which run this was."""
    return (
        base
        + (" --smoke" if args.smoke else "")
        + (f" --parts {args.parts}" if args.parts != ",".join(parts) else "")
    )
