"""Devices: the replicas' devices, named as TensorFlow names them.

Every placement in feedpipe is written against device strings, so the same code runs on
`/gpu:i` and on the logical CPU devices tests use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def _canonical(spec: tf.DeviceSpec) -> tuple[str, int]:
    return (spec.device_type or "CPU").upper(), spec.device_index or 0


def resolve_devices(devices: Sequence[str] | None, strategy: Any | None) -> tuple[str, ...]:
    """Full TensorFlow names of the replica devices (from `devices`, `strategy`, or the default).

    The default is every GPU, else the first CPU. A device that TensorFlow does not list is a
    ValueError that names it and lists the devices there are.
    """
    if strategy is not None:
        from_strategy = tuple(strategy.extended.worker_devices)
        if devices is not None and len(devices) != len(from_strategy):
            raise ValueError(
                f"`devices` lists {len(devices)} devices but `strategy` has "
                f"{len(from_strategy)} replicas ({', '.join(from_strategy)}); pass one of them."
            )
        if devices is None:
            devices = from_strategy
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
