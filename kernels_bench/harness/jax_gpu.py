"""The JAX GPU questions' command: the environment JAX and Keras read, the accelerator, and the
questions run as parts of one run and one report.

Each question (`gpu_copy.py`, `gpu_busy.py`, `gpu_rs.py`, `gpu_fit.py`) is a module with
`PART` (its name in `--parts`), `add_args` and `smoke` (its options, and how `--smoke` shrinks
them; a function shared by two questions adds its options once), `run(report, settings,
device)`, `NOTE` (how its figures were taken) and `COLUMNS` (the metrics of its table).
`DESCRIBE_FIRST`, where true, runs the question before the accelerator is described, which
loads PyTorch. `main` runs the questions asked for, in their order, into one report.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from kernels_bench import harness
from kernels_bench.harness.accelerator import (
    Report,
    command_line,
    nvidia_smi,
    page_locker_info,
    parse_run,
)


def configure_environment() -> None:
    """What every framework reads when it loads: quiet logs, JAX for Keras, and no JAX
    pre-allocation (PyTorch copies to the same GPU in the copy part)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise SystemExit(f"KERAS_BACKEND={backend}: this benchmark runs Keras on JAX; unset it.")


def cuda_torch():
    """PyTorch with a CUDA device, or None (it is optional)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def accelerator() -> dict:
    """The device, the versions around it and the page locker feedpipe found."""
    import jax

    device = jax.devices()[0]
    info = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": [str(d) for d in jax.devices()],
        "versions": {
            p: harness.version(p)
            for p in (
                "jax",
                "jaxlib",
                "jax-cuda13-plugin",
                "jax-cuda12-plugin",
                "keras",
                "grain",
                "torch",
                "optree",
                "numpy",
            )
        },
        "page_locker": page_locker_info(),
        "nvidia_smi": nvidia_smi(),
        "tensorflow_loaded": "tensorflow" in sys.modules,
    }
    torch = cuda_torch()
    if torch is not None:
        info["torch_cuda"] = torch.version.cuda
        info["torch_device"] = torch.cuda.get_device_name(0)
    return info


def main(name: str, doc: str, question: str, modules: Sequence[ModuleType], argv=None) -> None:
    """Runs the questions of `modules` asked for by `--parts` (every one by default) on JAX's
    first device, and writes `<name>.json` (`<name>_smoke.json` under `--smoke`)."""
    configure_environment()
    names = tuple(module.PART for module in modules)

    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--smoke", action="store_true", help="tiny everything, CPU JAX, < 2 minutes (a check)"
        )
        parser.add_argument("--parts", default=",".join(names), help=f"any of {','.join(names)}")
        for add in dict.fromkeys(module.add_args for module in modules):
            add(parser)

    def smoke(args: argparse.Namespace) -> None:
        """Shrinks every part to run on CPU JAX in under 2 minutes."""
        args.quick = True
        for shrink in dict.fromkeys(module.smoke for module in modules):
            shrink(args)

    settings, parts = parse_run(doc, add_args, smoke, names, argv)
    args = settings.args

    import jax

    device = jax.devices()[0]
    report = Report(
        f"{name}_smoke" if args.smoke else name,
        question,
        settings,
        f"kernels_bench.{name}",
        command=command_line(f"KERAS_BACKEND=jax python -m kernels_bench.{name}", args, names),
    )
    print(f"device: {device.device_kind} ({device.platform}); parts: {', '.join(parts)}")
    if device.platform != "gpu":
        report.note(
            f"Run on {device.platform} ({device.device_kind}), not a GPU: every figure checks "
            "that the script works; none is a GPU figure. On a CPU device jax.device_put may "
            "wrap host memory instead of copying it, so the copy case's GB/s are not copy rates."
        )
    asked = [module for module in modules if module.PART in parts]
    first = [module for module in asked if getattr(module, "DESCRIBE_FIRST", False)]
    for module in first:
        module.run(report, settings, device)
    report.accelerator = accelerator()
    for module in asked:
        if module not in first:
            module.run(report, settings, device)
    report.note(
        " ".join(
            [
                "Each ratio is taken within one repetition (peers in rotating order), then the "
                "median over repetitions.",
                *(module.NOTE for module in modules),
            ]
        )
    )
    report.finish(columns=[column for module in modules for column in module.COLUMNS])
