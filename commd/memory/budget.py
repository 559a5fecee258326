"""How much shared memory this process may still reserve, and the arena size that follows.

Arena segments are memfd files (the kernel's internal shmem mount, not
/dev/shm) whose pages are reserved when they are created.  That mount has no
size limit of its own: what bounds it is the machine's available memory and
the memory limit of our cgroup (a container's).  Reserving beyond either does
not fail cleanly — the OOM killer picks a victim — so a segment is refused
up front when it does not fit in what is free, with both figures named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from commd.runtime import env_bytes

#: The arena a client maps when nothing else is said (it grows on demand).
DEFAULT_ARENA_BYTES = 64 << 20
#: A default arena takes at most this fraction of the free shared memory: the node's
#: other ranks, their staging growth and the training itself need the rest.
FAIR_SHARE_DIVISOR = 8
MIN_ARENA_BYTES = 1 << 16
MAX_ARENA_BYTES = 1 << 40
ARENA_ENV = "COMMD_ARENA_BYTES"
SOURCE = "shared memory (memfd on the kernel's shmem mount)"


@dataclass(frozen=True)
class Budget:
    """Bytes that may still be reserved, and what limits them (for error messages)."""

    free: int
    limited_by: str


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


#: cgroup v2 and v1 layouts: (mount, limit file, usage file).
_CGROUP_LAYOUTS = {
    "": (Path("/sys/fs/cgroup"), "memory.max", "memory.current"),
    "memory": (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"),
}
#: v1 reports "no limit" as a huge number.
_UNLIMITED = 1 << 62


def _cgroup_room() -> tuple[int, str] | None:
    """Bytes left below this process's tightest cgroup memory limit (None: no limit or unknown)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        key = "" if controllers == "" else ("memory" if "memory" in controllers.split(",") else None)
        if key is None:
            continue
        mount, limit_file, usage_file = _CGROUP_LAYOUTS[key]
        directory = mount / relative.lstrip("/")
        # A limit anywhere up the hierarchy applies (in a container the mount is its own cgroup).
        for d in (directory, *directory.parents):
            if not d.is_relative_to(mount):
                break
            room = _room_in(d, limit_file, usage_file)
            if room is not None and (best is None or room[0] < best[0]):
                best = room
    return best


def _room_in(directory: Path, limit_file: str, usage_file: str) -> tuple[int, str] | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        current = int((directory / usage_file).read_text().strip())
        limit = _UNLIMITED if limit_text == "max" else int(limit_text)
    except (OSError, ValueError):
        return None
    if limit >= _UNLIMITED:
        return None
    return max(0, limit - current), f"the memory limit of cgroup {directory} ({limit} bytes, {current} in use)"


def shared_memory_budget() -> Budget:
    """What a new segment may reserve now: the tighter of MemAvailable and the cgroup's room."""
    available = _meminfo_available()
    budget = Budget(available, "MemAvailable in /proc/meminfo") if available is not None else Budget(
        MAX_ARENA_BYTES, "no limit known")
    room = _cgroup_room()
    if room is not None and room[0] < budget.free:
        budget = Budget(room[0], room[1])
    return budget


def default_arena_bytes(budget: Budget | None = None) -> int:
    """min(64 MiB, a fair share of the free shared memory), in whole 64 KiB units."""
    budget = budget or shared_memory_budget()
    share = budget.free // FAIR_SHARE_DIVISOR // MIN_ARENA_BYTES * MIN_ARENA_BYTES
    return max(MIN_ARENA_BYTES, min(DEFAULT_ARENA_BYTES, share))


def arena_bytes_setting() -> int | None:
    """COMMD_ARENA_BYTES parsed and checked (None: unset); call it before starting anything."""
    if not os.environ.get(ARENA_ENV):
        return None
    return env_bytes(ARENA_ENV, DEFAULT_ARENA_BYTES, MIN_ARENA_BYTES, MAX_ARENA_BYTES)


def check_environment() -> None:
    """Fail early, naming the variable, when a shared-memory setting is invalid."""
    arena_bytes_setting()


__all__ = [
    "ARENA_ENV", "Budget", "DEFAULT_ARENA_BYTES", "SOURCE", "arena_bytes_setting",
    "check_environment", "default_arena_bytes", "shared_memory_budget",
]
