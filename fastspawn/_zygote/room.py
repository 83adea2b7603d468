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
    """How many more workers may be made ready under this process's limits
    (RLIMIT_NPROC the caller's, as the zygote started; RLIMIT_NOFILE
    the zygote's, which ReadyPool.fill raises for them): a quarter of RLIMIT_NPROC
    in all, a quarter of RLIMIT_NOFILE (each holds two of the zygote's
    fds while it waits: both ends of its socketpair), and none while
    memory is short: on the machine (MemAvailable) or under the limit of
    a memory cgroup the zygote is in; and a quarter of a pids cgroup's
    limit (see fastspawn._os.cgroups)."""
    import resource

    room = sys.maxsize
    for limit, each in ((resource.RLIMIT_NPROC, 1), (resource.RLIMIT_NOFILE, FDS_EACH)):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            room = min(room, max(0, soft // LIMIT_SHARE // each - ready))
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
            room = 0
    except (OSError, KeyError, ValueError, IndexError):
        pass
    # And what the cgroups over the zygote allow (a job's, a container's):
    # memory MemAvailable does not show, processes as RLIMIT_NPROC does.
    global _cgroup_limits
    if _cgroup_limits is None:
        _cgroup_limits = cgroups.memory_limits(), cgroups.pids_limits()
    memory, pids = _cgroup_limits
    left = cgroups.headroom(memory)
    if left is not None and left[0] < max(MIN_AVAILABLE, left[1] // 10):
        room = 0
    for level in pids:
        room = min(room, max(0, level.limit // LIMIT_SHARE - ready))
    return room


# The limits of the cgroups over the zygote, memory's and pids' (see
# fastspawn._os.cgroups), found at its first refill.
_cgroup_limits: tuple[list[cgroups.Level], list[cgroups.Level]] | None = None
