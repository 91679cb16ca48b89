"""What the machine gives this process: the cores it may run on, and the host memory a new
mapping can take now. Workers, gather threads, the cost model and the slots all size
themselves by these two figures, read here alone.
"""

from __future__ import annotations

import os

from feedpipe.core._shm import MEMFD, SHM_DIR

_CGROUP_MEMORY = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)
"""A container's memory limit and usage, as the container sees its own cgroup."""


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max": no limit
        return None


def available_host_bytes(shared: bool) -> tuple[int, str] | None:
    """The host memory a new mapping can take now, and where that figure comes from: the
    lowest of the kernel's estimate (`MemAvailable` in /proc/meminfo, else free pages), the
    container's cgroup limit less its usage, and, for slots shared with worker processes on a
    system without memfds, the free space of the directory their files live in (a memfd is
    memory, which the first two count, and never takes `/dev/shm`'s space). None where the
    system says none of these."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
                    break
    except (OSError, ValueError):
        pass
    if not found:
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            found.append((pages, "the free pages os.sysconf reports"))
        except (OSError, ValueError, AttributeError):
            pass
    for limit_path, usage_path in _CGROUP_MEMORY:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            found.append((max(limit - usage, 0), f"this container's cgroup limit ({limit_path})"))
            break
    if shared and not MEMFD:
        try:
            disk = os.statvfs(SHM_DIR)
            found.append((disk.f_bavail * disk.f_frsize, f"the free space of {SHM_DIR}"))
        except OSError:
            pass
    return min(found) if found else None
