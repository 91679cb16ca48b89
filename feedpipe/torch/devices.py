"""Devices: the replicas' `torch.device`s, and this process's place under `torch.distributed`.

Devices are `torch.device`s (or strings such as "cuda:0" with `framework="torch"`). PyTorch
trains one device per process (`DistributedDataParallel`), so the default is this process's
device: under `torch.distributed` each process is a host of the core's split, and stages its
rank's rows of every global batch, in the order every layer shares.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of processes under `torch.distributed` (0 and 1
    where it is not initialized).

    A process that `torchrun` started as one of several (`WORLD_SIZE` > 1) but whose process
    group is not initialized yet is refused: its feeder would be a one-process feeder, so
    every process would feed every sample, and nothing would fail (as `DistributedSampler`
    refuses to guess a rank).
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise RuntimeError(
            f"This process is one of WORLD_SIZE={launched} (as torchrun starts them), but "
            "torch.distributed is not initialized in it: its feeder would feed every sample "
            "to every process. Call torch.distributed.init_process_group() before building "
            "the feeder."
        )
    return 0, 1


def _default_device() -> torch.device:
    """This process's device: its GPU (`LOCAL_RANK`, as `torchrun` sets it, where the process
    sees that many GPUs; else the current CUDA device, as where a scheduler shows each process
    its own GPU alone), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def _counted(kind: str) -> int | None:
    """How many devices of `kind` ("cuda", "mps", "xpu") this process sees, where torch has a
    module that counts them; None where it has none (then a copy onto one tells)."""
    module = getattr(torch, kind, None)
    if not hasattr(module, "is_available") or not hasattr(module, "device_count"):
        return None
    return module.device_count() if module.is_available() else 0


def _refuse_absent(given: Any, device: torch.device) -> None:
    """Refuses `device` (as `given`) where this process has no such device, naming the devices
    it has: a copy onto it would fail at construction as if the field's dtype were at fault."""
    count = _counted(device.type)
    if count is None or (count and (device.index or 0) < count):
        return
    if count:
        kind = "CUDA" if device.type == "cuda" else device.type
        why = f"PyTorch sees {count} {kind} device{'s' if count > 1 else ''}"
    elif device.type == "cuda" and torch.version.cuda is None:
        why = "this PyTorch is built without CUDA"
    elif device.type == "cuda":
        why = (
            "PyTorch sees no CUDA device (torch.cuda.is_available() is False: no NVIDIA "
            "driver, or no GPU visible to this process, see CUDA_VISIBLE_DEVICES)"
        )
    else:
        why = f"PyTorch sees no {device.type} device (torch.{device.type}.is_available() is False)"
    present = ["cpu"] + [
        f"{kind}:{index}" for kind in ("cuda", "mps", "xpu") for index in range(_counted(kind) or 0)
    ]
    raise ValueError(
        f"`devices` names {given!r}, which is not a device of this process: {why}; the devices "
        f"are {', '.join(present)}. Leave `devices` unset for this process's device."
    )


def resolve_devices(devices: Any) -> tuple[torch.device, ...]:
    """The replica devices, as `torch.device`s with their index: `devices` given, else this
    process's one device. The CPU may be listed more than once (several replicas on the host,
    as tests and tower-style steps run); an accelerator only once."""
    if devices is None:
        return (_default_device(),)
    if isinstance(devices, (str, torch.device)):
        raise TypeError(
            f"`devices`={devices!r} must be a list of devices, e.g. [torch.device('cuda:0')] "
            "or ['cuda:0', 'cuda:1']."
        )
    resolved = []
    for device in devices:
        try:
            one = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"`devices` holds {device!r}, which is not a PyTorch device ({error}); pass "
                "torch.device objects or strings such as 'cuda:0' or 'cpu'."
            ) from error
        _refuse_absent(device, one)
        if one.type == "cuda" and one.index is None:
            one = torch.device("cuda", torch.cuda.current_device())
        resolved.append(one)
    if not resolved:
        raise ValueError("`devices` is empty; pass [torch.device('cuda:0')] or ['cpu'].")
    accelerators = [d for d in resolved if d.type != "cpu"]
    if len(set(accelerators)) != len(accelerators):
        raise ValueError(f"`devices`={resolved} names a device twice; list each GPU once.")
    if 0 < len(accelerators) < len(resolved):
        raise ValueError(
            f"`devices`={resolved} mixes the CPU with accelerators; stage on one kind."
        )
    return tuple(resolved)
