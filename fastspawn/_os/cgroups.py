"""What the cgroups over this process allow: a Slurm job's allocation, a
container's, a systemd unit's.

Inside a memory cgroup the machine's MemAvailable says nothing of the
limit that counts: a job allowed 8 GiB on a host with 512 GiB free sees
500 GiB available, and past its limit the kernel reclaims its pages or
kills its largest process (the job's own, usually).  A pids cgroup's
limit is the process count's RLIMIT_NPROC for everyone in it.  So the
zygote, before it makes workers ready (each a process holding 2-3 MiB of
its own), also asks what the limits of its cgroups and of each one above
them allow.

The cgroup is found once (:func:`memory_limits`, :func:`pids_limits`),
from /proc/self/cgroup and /proc/self/mountinfo, in the controller's v1
hierarchy where it has one, else in v2's: memory.max and memory.high
under v2 (the lower: above memory.high the kernel throttles and
reclaims), memory.limit_in_bytes under v1, pids.max under both; each
level up to the hierarchy's mount whose limit is finite is kept with its
usage file (memory.current, memory.usage_in_bytes, pids.current: each
counts the cgroups below).  The limits are read then and kept; the usage
is read at each ask (:func:`headroom`).
"""

from __future__ import annotations

import os
import re

from fastspawn._os.limits import read_number

# v1's "no limit": PAGE_COUNTER_MAX pages, rounded to a page; any value this
# large is none.
_UNLIMITED_V1 = 1 << 62

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class Level:
    """One cgroup with a limit: ``limit`` (bytes of memory, or tasks), its
    usage read from ``usage`` (a file's path)."""

    __slots__ = ("limit", "usage")

    def __init__(self, limit: int, usage: str) -> None:
        self.limit = limit
        self.usage = usage

    def __repr__(self) -> str:
        return f"Level(limit={self.limit}, usage={self.usage!r})"


def memory_limits(
    cgroup_file: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> list[Level]:
    """The memory limits over this process: its memory cgroup's and each
    ancestor's, up to the hierarchy's mount, that are finite (none where
    there is no memory cgroup, its directory is not mounted here, or the
    files are unreadable)."""
    return _find(
        cgroup_file,
        mountinfo,
        "memory",
        (_limit_v1, "memory.usage_in_bytes"),
        (_limit_v2, "memory.current"),
    )


def pids_limits(
    cgroup_file: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> list[Level]:
    """The process-count limits over this process (pids.max), as
    :func:`memory_limits` finds the memory ones."""
    pids = (_limit_pids, "pids.current")
    return _find(cgroup_file, mountinfo, "pids", pids, pids)


def _find(
    cgroup_file: str,
    mountinfo: str,
    controller: str,
    v1: tuple[Callable[[str], int | None], str],
    v2: tuple[Callable[[str], int | None], str],
) -> list[Level]:
    """The finite limits over this process of ``controller``: read with
    ``v1`` (the limit's reader, the usage file's name) in its v1
    hierarchy, if it has one, else with ``v2`` in v2's."""
    try:
        with open(cgroup_file) as f:
            memberships = f.read().splitlines()
        with open(mountinfo) as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    in_v1, in_v2 = _membership(memberships, controller)
    if in_v1 is not None:
        directory = _directory(mounts, in_v1, "cgroup", controller)
        if directory is not None:
            return _levels(*directory, *v1)
    if in_v2 is not None:
        directory = _directory(mounts, in_v2, "cgroup2", None)
        if directory is not None:
            return _levels(*directory, *v2)
    return []


def headroom(levels: Sequence[Level]) -> tuple[int, int] | None:
    """(what is left, the limit) of the level that leaves the least; None
    when there is no limit or a usage file could not be read."""
    least: tuple[int, int] | None = None
    for level in levels:
        left = level_left(level)
        if left is None:
            return None
        if least is None or left < least[0]:
            least = (left, level.limit)
    return least


def level_left(level: Level) -> int | None:
    """What ``level``'s limit leaves now (None: its usage unreadable)."""
    used = read_number(level.usage)
    return None if used is None else level.limit - used


def _membership(lines: Sequence[str], controller: str) -> tuple[str | None, str | None]:
    """This process's cgroup in ``controller``'s v1 hierarchy and in v2's,
    from /proc/self/cgroup's lines ("id:controllers:path"); None where
    absent."""
    v1 = v2 = None
    for line in lines:
        number, _colon, rest = line.partition(":")
        controllers, _colon, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v1, v2


def _directory(
    mounts: Sequence[str], path: str, fstype: str, option: str | None
) -> tuple[str, str] | None:
    """(the directory of cgroup ``path``, the hierarchy's mount point) for
    the first mount of ``fstype`` (with ``option`` among its super options,
    v1's controller) whose root holds ``path``: mountinfo's fields are id,
    parent, device, root, mount point, options, optional fields, "-",
    fstype, source, super options."""
    for line in mounts:
        fields = line.split()
        try:
            dash = fields.index("-")
            root, point = fields[3], fields[4]
            kind, options = fields[dash + 1], fields[dash + 3]
        except (ValueError, IndexError):
            continue
        if kind != fstype or (option is not None and option not in options.split(",")):
            continue
        if root == "/":
            inside = path
        elif path == root or path.startswith(root + "/"):
            inside = path[len(root) :]
        else:
            continue
        point = _unescape(point)
        return os.path.join(point, inside.lstrip("/")).rstrip("/") or "/", point
    return None


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (of a space, tab, newline, backslash:
    ``\\040``) undone."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _levels(
    directory: str, top: str, limit_of: Callable[[str], int | None], usage_name: str
) -> list[Level]:
    """From ``directory`` up to the mount point ``top``: a Level for each
    cgroup whose limit (``limit_of(directory)``) is finite."""
    levels = []
    while True:
        limit = limit_of(directory)
        if limit is not None:
            levels.append(Level(limit, os.path.join(directory, usage_name)))
        if os.path.normpath(directory) == os.path.normpath(top):
            return levels
        parent = os.path.dirname(directory)
        if parent == directory:
            return levels
        directory = parent


def _limit_v2(directory: str) -> int | None:
    """The lower of memory.max and memory.high, None where both are
    "max" or absent (the memory controller off for that cgroup)."""
    limits = [read_number(os.path.join(directory, name)) for name in ("memory.max", "memory.high")]
    finite = [limit for limit in limits if limit is not None]
    return min(finite) if finite else None


def _limit_v1(directory: str) -> int | None:
    limit = read_number(os.path.join(directory, "memory.limit_in_bytes"))
    return None if limit is None or limit >= _UNLIMITED_V1 else limit


def _limit_pids(directory: str) -> int | None:
    return read_number(os.path.join(directory, "pids.max"))
