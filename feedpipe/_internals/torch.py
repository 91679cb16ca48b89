"""Every call feedpipe makes into PyTorch's private APIs.

Each is here because no public API does the job (the reason is beside it), so a new release of
PyTorch is checked against this file alone. PyTorch is imported inside the functions: importing
this module imports no framework.
"""

from __future__ import annotations

from typing import Any


def torch_default_store() -> Any:
    """The key-value store of `torch.distributed`'s default process group, whose waits take a
    deadline: no public API hands it out, and the collectives wait for the group's own timeout
    (30 minutes by default) for a process that never joins."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "The feeder is shared by several processes, but torch.distributed is not "
            "initialized in this one; call torch.distributed.init_process_group() first."
        )
    return dist.distributed_c10d._get_default_store()
