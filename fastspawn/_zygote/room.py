"""How many more ready workers the limits allow (see
fastspawn._zygote.ready): the caller's process and file limits, the
machine's memory, and the cgroups the zygote is in."""

from __future__ import annotations

import sys

from fastspawn._os import cgroups

# No workers made ready while less memory than this is available
# (MemAvailable), or than a tenth of the machine's; nor while a memory
# cgroup's limit leaves less than this, or than a tenth of the limit.
MIN_AVAILABLE = 512 << 20
# Ready workers take at most a quarter of RLIMIT_NPROC, of a pids cgroup's
# pids.max and of RLIMIT_NOFILE (the rest is the launches'), each holding
# two of the zygote's fds.
LIMIT_SHARE = 4
FDS_EACH = 2
MEMINFO_HEAD = 256  # bytes of /proc/meminfo that hold both


def room_under_limits(ready: int) -> int:
    """How many more workers may be made ready beside ``ready`` under this
    process's limits (RLIMIT_NPROC the caller's, as the zygote started;
    RLIMIT_NOFILE the zygote's, which ReadyPool.fill raises for them): a
    quarter of RLIMIT_NPROC in all, a quarter of RLIMIT_NOFILE (each holds
    two of the zygote's fds while it waits: both ends of its socketpair),
    a quarter of a pids cgroup's limit, never taking the last half of it,
    and none while memory is short, on the machine (MemAvailable) or under
    the limit of a memory cgroup the zygote is in (see
    fastspawn._os.cgroups)."""
    import resource

    if _memory_short():
        return 0
    room = sys.maxsize
    for limit, each in ((resource.RLIMIT_NPROC, 1), (resource.RLIMIT_NOFILE, FDS_EACH)):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            room = min(room, soft // LIMIT_SHARE // each - ready)
    for level in _limits()[1]:
        # What the cgroup's other processes fork meanwhile needs the rest.
        free = cgroups.level_left(level)
        if free is not None:
            room = min(room, level.limit // LIMIT_SHARE - ready, free - level.limit // 2)
    return max(0, room)


def _memory_short() -> bool:
    """Whether less than MIN_AVAILABLE, or a tenth, is left of the
    machine's memory or of a memory cgroup's limit over the zygote (a
    job's, a container's: MemAvailable does not show it)."""
    try:
        # The first lines only (MemTotal, MemFree, MemAvailable): a read
        # and parse of the whole file took 90 us, this 23 (warm).
        with open("/proc/meminfo", "rb", buffering=0) as f:
            head = f.read(MEMINFO_HEAD)
        info = {}
        for line in head.split(b"\n")[:-1]:
            key, _colon, value = line.partition(b":")
            info[key] = int(value.split()[0]) << 10
        if info[b"MemAvailable"] < max(MIN_AVAILABLE, info[b"MemTotal"] // 10):
            return True
    except (OSError, KeyError, ValueError, IndexError):
        pass
    left = cgroups.headroom(_limits()[0])
    return left is not None and left[0] < max(MIN_AVAILABLE, left[1] // 10)


def _limits() -> tuple[list[cgroups.Level], list[cgroups.Level]]:
    """The memory and pids limits of the cgroups over the zygote, found
    once."""
    global _cgroup_limits
    if _cgroup_limits is None:
        _cgroup_limits = cgroups.memory_limits(), cgroups.pids_limits()
    return _cgroup_limits


# The limits of the cgroups over the zygote, memory's and pids' (see
# fastspawn._os.cgroups), found at its first refill.
_cgroup_limits: tuple[list[cgroups.Level], list[cgroups.Level]] | None = None
