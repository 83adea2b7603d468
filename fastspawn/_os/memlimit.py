"""How much memory a memory cgroup's limits leave this process: a Slurm
job's allocation, a container's, a systemd unit's.

Inside such a cgroup the machine's MemAvailable says nothing of the limit
that counts: a job allowed 8 GiB on a host with 512 GiB free sees 500 GiB
available, and past its limit the kernel reclaims its pages or kills its
largest process (the job's own, usually).  So the zygote, before it makes
workers ready (each holding 2-3 MiB of its own), also asks what the limits
of its cgroup and of each one above it leave (:func:`headroom`).

The cgroup is found once (:func:`find_limits`), from /proc/self/cgroup and
/proc/self/mountinfo: under cgroup v2 its memory.max and memory.high
(the lower: above memory.high the kernel throttles and reclaims), under
v1's memory controller its memory.limit_in_bytes; each level up to the
hierarchy's mount whose limit is finite is kept with its usage file
(memory.current, memory.usage_in_bytes: both count the cgroups below).
The limits are read then and kept; the usage is read at each ask.
"""

from __future__ import annotations

import os
import re

# v1's "no limit": PAGE_COUNTER_MAX pages, rounded to a page; any value this
# large is none.
_UNLIMITED_V1 = 1 << 62

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class Level:
    """One cgroup with a memory limit: ``limit`` bytes, its usage read from
    ``usage`` (a file's path)."""

    __slots__ = ("limit", "usage")

    def __init__(self, limit: int, usage: str) -> None:
        self.limit = limit
        self.usage = usage

    def __repr__(self) -> str:
        return f"Level(limit={self.limit}, usage={self.usage!r})"


def find_limits(
    cgroup_file: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> list[Level]:
    """The memory limits over this process: its cgroup's and each
    ancestor's, up to the hierarchy's mount, that are finite (none where
    there is no memory cgroup, its directory is not mounted here, or the
    files are unreadable)."""
    try:
        with open(cgroup_file) as f:
            memberships = f.read().splitlines()
        with open(mountinfo) as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    v1, v2 = _membership(memberships)
    if v1 is not None:
        directory = _directory(mounts, v1, "cgroup", "memory")
        if directory is not None:
            return _levels(*directory, _limit_v1, "memory.usage_in_bytes")
    if v2 is not None:
        directory = _directory(mounts, v2, "cgroup2", None)
        if directory is not None:
            return _levels(*directory, _limit_v2, "memory.current")
    return []


def headroom(levels: Sequence[Level]) -> tuple[int, int] | None:
    """(bytes left, limit) of the level that leaves the least; None when
    there is no limit or a usage file could not be read."""
    least: tuple[int, int] | None = None
    for level in levels:
        try:
            with open(level.usage, "rb", buffering=0) as f:
                used = int(f.read(64))
        except (OSError, ValueError):
            return None
        left = level.limit - used
        if least is None or left < least[0]:
            least = (left, level.limit)
    return least


def _membership(lines: Sequence[str]) -> tuple[str | None, str | None]:
    """This process's cgroup in v1's memory hierarchy and in v2's, from
    /proc/self/cgroup's lines ("id:controllers:path"); None where absent."""
    v1 = v2 = None
    for line in lines:
        number, _colon, rest = line.partition(":")
        controllers, _colon, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
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
    limits = [_read_limit(os.path.join(directory, name)) for name in ("memory.max", "memory.high")]
    finite = [limit for limit in limits if limit is not None]
    return min(finite) if finite else None


def _limit_v1(directory: str) -> int | None:
    limit = _read_limit(os.path.join(directory, "memory.limit_in_bytes"))
    return None if limit is None or limit >= _UNLIMITED_V1 else limit


def _read_limit(path: str) -> int | None:
    try:
        with open(path, "rb", buffering=0) as f:
            text = f.read(64).strip()
        return None if text == b"max" else int(text)
    except (OSError, ValueError):
        return None
