"""Services: what a feeder's `service` names, where the per-sample work runs instead of this
host: a tf.data service dispatcher ("grpc://host:port") or a Ray cluster."""

from __future__ import annotations

RAY = "ray"
"""`service="ray"`: the Ray cluster this process is connected to (or `RAY_ADDRESS`'s)."""
RAY_CLIENT = "ray://"
"""`service="ray://HOST:PORT"`: a Ray cluster's client server."""


def is_ray(service: str | None) -> bool:
    """Whether `service` names a Ray cluster rather than a tf.data service dispatcher."""
    return service == RAY or (isinstance(service, str) and service.startswith(RAY_CLIENT))
