"""Host RAM the machine can give a document's memory, for refusing work up front instead of halfway.

`SEKV_LOCAL_MAX_HOST_MEMORY` (e.g. `8GiB`) caps what sekv-local plans to use, below what the system
reports free (`MemAvailable` on Linux, free physical pages elsewhere).
"""

from __future__ import annotations

import os

from .errors import SekvError

ENV_LIMIT = "SEKV_LOCAL_MAX_HOST_MEMORY"


def system_available_bytes() -> int | None:
    """Free host RAM as the OS reports it (None when it cannot say)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_host_bytes() -> tuple[int | None, str]:
    """(bytes sekv-local may use, where that figure comes from)."""
    from .cache.budget import parse_budget

    system = system_available_bytes()
    text = os.environ.get(ENV_LIMIT)
    if not text:
        return system, "free RAM"
    try:
        limit = parse_budget(text)
    except SekvError:
        limit = None
    if not isinstance(limit, int):
        raise SekvError(f"{ENV_LIMIT}={text!r} is not a size (examples: 8GiB, 500MB)")
    if system is not None and system < limit:
        return system, "free RAM"
    return limit, ENV_LIMIT
