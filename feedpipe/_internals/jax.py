"""Every call feedpipe makes into JAX's private APIs (`jax._src`).

Each is here because no public API does the job (the reason is beside it), so a new release of
JAX is checked against this file alone. JAX is imported inside the functions: importing this
module imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def jax_distributed_client() -> Any:
    """The client of the coordination service `jax.distributed.initialize` connected this
    process to: its key-value store has reads with a deadline, which no public JAX API offers
    between processes (`multihost_utils` runs compiled collectives, which wait forever for a
    process that never joins)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "The feeder's devices span several processes, but jax.distributed is not "
            "initialized in this one; call jax.distributed.initialize() first."
        )
    return client


def uncommitted_jax_array(array: Any) -> Any:
    """`array`, a `jax.Array` on one device, as an uncommitted array on that device sharing its
    buffer: what `jax.device_put(numpy_array)` gives. `jit` compiles again for an argument
    that is committed where it was not, and no public API drops the commitment without a
    copy (`jax.device_put(array)` returns `array` as it is)."""
    from jax._src.array import ArrayImpl

    one = array.addressable_data(0)  # its sharding: SingleDeviceSharding, without a mesh
    return ArrayImpl(one.aval, one.sharding, [one], committed=False, _skip_checks=True)


def jax_dlpack_import() -> Callable[[Any, Any, int], Any] | None:
    """JAX's own DLPack import, `(capsule, device, DLPack device type) -> jax.Array`, without the
    Python around it, or None where this jaxlib has no such entry point.

    `jax.dlpack.from_dlpack` looks the backend and device up again, asks for a stream to order
    the import behind and wraps the array once more: 70 µs a field on a CPU here, 0.08 to 0.16
    ms on an H100, against 11 µs for the import itself; no public API imports without them."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    to_buffer = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    if to_buffer is None or jaxlib_extension_version < 467:
        return None

    def take(capsule: Any, device: Any, device_type: int) -> Any:
        return to_buffer(capsule, device, None, False, device_type)

    return take
