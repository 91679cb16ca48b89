"""Devices: the mesh a JAX feeder shards each global batch over, and this process's place in it.

The default is a 1-D mesh over every device of every process, ordered by process so that each
process's replicas, and its rows of each global batch, are contiguous (`feedpipe.core.split`);
`process_share` says which devices are this process's and which rows they take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from feedpipe.core.split import HostShare

BATCH_AXIS = "batch"
"""The mesh axis name of the default 1-D mesh, as `keras.distribution.DataParallel` names it."""


def _process_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Devices ordered by process, then id: process `p`'s replicas are then contiguous, and so
    are its rows of each global batch (`feedpipe.core.split`)."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def resolve_mesh(devices: Any) -> Mesh:
    """The mesh to shard global batches over: the one given, or a 1-D mesh over `devices`
    (None: every device of every process)."""
    if isinstance(devices, Mesh):
        return devices
    if devices is None:
        devices = _process_major(jax.devices())
    else:
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` is empty; pass jax.devices() or a list of them.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"`devices`={devices} names a device twice; list each once.")
        if jax.process_count() > 1:
            devices = _process_major(devices)
    return Mesh(np.array(devices), (BATCH_AXIS,))


def process_share(global_batch_size: int, mesh: Mesh) -> tuple[tuple[jax.Device, ...], HostShare]:
    """This process's devices, in mesh order, and its rows of each global batch."""
    flat = list(mesh.devices.flat)
    mine = jax.process_index()
    local = tuple(d for d in flat if d.process_index == mine)
    processes = sorted({d.process_index for d in flat})
    if not local:
        raise ValueError(
            f"`devices` holds no device of this process ({mine}); pass jax.devices(), whose "
            "devices include this process's."
        )
    if len(processes) == 1:
        return local, HostShare(global_batch_size, local_replicas=len(local))
    counts = {p: sum(d.process_index == p for d in flat) for p in processes}
    host = processes.index(mine)
    contiguous = flat[host * len(local) : (host + 1) * len(local)] == list(local)
    if len(set(counts.values())) != 1 or not contiguous:
        raise ValueError(
            f"The mesh's devices per process are {counts}, in the order "
            f"{[d.process_index for d in flat]}: each process must hold as many devices, "
            "contiguous along the batch axis, so that it makes a contiguous share of each "
            "global batch; use the default (devices=None) or order them by process."
        )
    return local, HostShare(global_batch_size, len(processes), host, len(local))
