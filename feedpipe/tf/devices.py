"""Devices: the replicas' devices, named as TensorFlow names them, and this host's place.

Every placement in feedpipe is written against device strings, so the same code runs on
`/gpu:i` and on the logical CPU devices tests use. Under a MultiWorkerMirroredStrategy the
devices are this host's replicas only (TensorFlow also lists the other hosts' devices, which
this process must never place data on), and `host_share` says which rows of each global batch
they take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from feedpipe._internals.tf import host_index
from feedpipe.core.split import HostShare


def _canonical(spec: tf.DeviceSpec) -> tuple[str, int]:
    return (spec.device_type or "CPU").upper(), spec.device_index or 0


def _hosts(strategy: Any) -> int:
    """Hosts of `strategy`: replicas over this host's replicas (1 but for multi-worker)."""
    return strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)


def _tasks_listed() -> set[tuple]:
    """The tasks TensorFlow lists devices of: more than one once this process has joined a
    cluster (a MultiWorkerMirroredStrategy was made)."""
    return {
        (spec.job, spec.replica, spec.task)
        for spec in (tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices())
    }


def resolve_devices(devices: Sequence[str] | None, strategy: Any | None) -> tuple[str, ...]:
    """Full TensorFlow names of the replica devices (from `devices`, `strategy`, or the default).

    The default is every GPU, else the first CPU. A device that TensorFlow does not list is a
    ValueError that names it and lists the devices there are.
    """
    if strategy is None and tf.distribute.has_strategy():
        current = tf.distribute.get_strategy()
        if _hosts(current) > 1:
            raise ValueError(
                "fp.Feeder is built inside the scope of a MultiWorkerMirroredStrategy with "
                f"{_hosts(current)} hosts but without strategy=; pass strategy=strategy, so "
                "that this host makes only its replicas' rows of each global batch."
            )
    if strategy is not None:
        from_strategy = tuple(strategy.extended.worker_devices)
        if devices is not None and _hosts(strategy) > 1:
            raise ValueError(
                f"`devices`={list(devices)} was given with a MultiWorkerMirroredStrategy of "
                f"{_hosts(strategy)} hosts: its devices on this host are "
                f"{', '.join(from_strategy)}, and the strategy says which rows of each global "
                "batch they take; pass strategy= alone."
            )
        if devices is not None and len(devices) != len(from_strategy):
            raise ValueError(
                f"`devices` lists {len(devices)} devices but `strategy` has "
                f"{len(from_strategy)} replicas ({', '.join(from_strategy)}); pass one of them."
            )
        if devices is None:
            return from_strategy
    if len(_tasks_listed()) > 1:
        raise ValueError(
            f"`devices`={None if devices is None else list(devices)}, but this process is one "
            "host of a cluster (a MultiWorkerMirroredStrategy was made), and a device string "
            "does not say which rows of each global batch this host takes; pass "
            "strategy=strategy instead of devices=."
        )
    if devices is None:
        gpus = tf.config.list_logical_devices("GPU")
        return tuple(d.name for d in gpus) or (tf.config.list_logical_devices("CPU")[0].name,)
    if isinstance(devices, str):
        raise TypeError(
            f'`devices`={devices!r} must be a list of device strings, e.g. ["{devices}"].'
        )
    if not devices:
        raise ValueError("`devices` is empty; list at least one device, e.g. ['/gpu:0'].")
    known = {
        _canonical(tf.DeviceSpec.from_string(d.name)): d.name
        for d in tf.config.list_logical_devices()
    }
    resolved = []
    for device in devices:
        try:
            key = _canonical(tf.DeviceSpec.from_string(device))
        except ValueError:
            key = None
        if key not in known:
            raise ValueError(
                f"`devices` names {device!r}, which is not a device of this process; "
                f"the devices are {', '.join(sorted(known.values()))}."
            )
        resolved.append(known[key])
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"`devices`={list(devices)} names a device twice; list each once.")
    return tuple(resolved)


def host_share(global_batch_size: int, strategy: Any | None, local_replicas: int) -> HostShare:
    """This host's rows of each global batch: all of them on one host; under a
    MultiWorkerMirroredStrategy, those of the replicas it runs."""
    if strategy is None or _hosts(strategy) == 1:
        return HostShare(global_batch_size, local_replicas=local_replicas)
    return HostShare(global_batch_size, _hosts(strategy), host_index(strategy), local_replicas)
