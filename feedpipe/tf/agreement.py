"""Agreement over TensorFlow: the exchange a multi-worker strategy's hosts check their feeders
with (the rule is the core's, `feedpipe.core.agreement`).

Two all-gathers over the strategy's replicas (the payloads' lengths, then the payloads padded to
the longest), so they wait as long as its CommunicationOptions(timeout_seconds=) lets a step
wait.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from feedpipe.core.agreement import NoAnswer
from feedpipe.core.split import HostShare


def exchange(strategy: Any, share: HostShare, payload: bytes) -> list[bytes]:
    """Every host's `payload`, in host order; `NoAnswer` where a host did not answer."""
    data = np.frombuffer(payload, np.uint8)
    try:
        sizes = _gather(strategy, share, np.array([data.size]))[:, 0]
        rows = _gather(strategy, share, np.pad(data, (0, sizes.max() - data.size)))
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as error:
        raise NoAnswer(type(error).__name__) from error
    return [row[:size].astype(np.uint8).tobytes() for row, size in zip(rows, sizes, strict=True)]


def _gather(strategy: Any, share: HostShare, array: np.ndarray) -> np.ndarray:
    """`array` of every host, one row each. Sent as float32, which every collective
    implementation gathers on every device (exact for bytes and lengths)."""
    value = tf.constant(array[None], tf.float32)
    replicas = strategy.experimental_distribute_values_from_function(lambda _: value)
    rows = strategy.gather(replicas, axis=0).numpy()
    return np.rint(rows[:: share.local_replicas]).astype(np.int64)
