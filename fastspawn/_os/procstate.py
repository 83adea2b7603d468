"""The per-process settings a child inherits at fork: umask, CPU affinity,
nice value, resource limits.

A spawn child gets the caller's as they are when it starts.  A zygote worker
forks from the zygote, which has the caller's as they were when the zygote
started.  So the caller records them when it starts its zygote
(``capture``), sends with each launch what changed since (``changed``), and
each worker applies that (``apply``) before running ``fn``: a caller that
tightens its umask to 077 after the zygote started gets 0600 files from its
workers, as it would from spawn.
"""

from __future__ import annotations

import os
import sys

# Imported in the zygote: typing only for the type checker.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The limits a launcher may change while it runs (users raise RLIMIT_NOFILE
# for many workers, RLIMIT_MEMLOCK for RDMA, RLIMIT_CORE for crash dumps).
_LIMITS = (
    "RLIMIT_AS",
    "RLIMIT_CORE",
    "RLIMIT_CPU",
    "RLIMIT_DATA",
    "RLIMIT_FSIZE",
    "RLIMIT_MEMLOCK",
    "RLIMIT_NOFILE",
    "RLIMIT_NPROC",
    "RLIMIT_STACK",
)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would leave
    another thread a moment with the wrong one).  Every launch reads it:
    from a raw file, searching its bytes, not a text file's lines (224 us
    after a pause instead of 328, AMD EPYC; a file object, not a bare fd:
    a Ctrl-C between an os.open and its try would leak the fd)."""
    try:
        with open("/proc/self/status", "rb", buffering=0) as f:
            status = f.read(1 << 16)
        _before, found, rest = status.partition(b"\nUmask:")
        if found:
            return int(rest.split(b"\n", 1)[0], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # kernels before 4.7: briefly the strictest one
    os.umask(mask)
    return mask


def capture() -> dict[str, Any]:
    """The settings of this process (CPU affinity: of the calling thread)."""
    import resource

    limits = {}
    for name in _LIMITS:
        number = getattr(resource, name, None)
        if number is not None:
            limits[number] = resource.getrlimit(number)
    return {
        "umask": _umask(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "rlimits": limits,
    }


def changed(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """What differs in ``now`` from ``before``: {} when nothing does."""
    diff: dict[str, Any] = {}
    for key, value in now.items():
        if key == "rlimits":
            limits = {n: v for n, v in value.items() if before["rlimits"].get(n) != v}
            if limits:
                diff[key] = limits
        elif before.get(key) != value:
            diff[key] = value
    return diff


def apply(diff: dict[str, Any]) -> None:
    """Take on ``diff`` (from ``changed``) in this worker.  What the kernel
    refuses (a CPU outside this process's cpuset, a lower nice value or a
    higher hard limit without the privilege) is reported on stderr and left
    as inherited: the worker still runs."""
    if "umask" in diff:
        os.umask(diff["umask"])
    problems = []
    if "affinity" in diff:
        try:
            os.sched_setaffinity(0, diff["affinity"])
        except OSError as exc:
            problems.append(f"CPU affinity {diff['affinity']}: {exc}")
    if "nice" in diff:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, diff["nice"])
        except OSError as exc:
            problems.append(f"nice {diff['nice']}: {exc}")
    if "rlimits" in diff:
        import resource

        for number, (soft, hard) in diff["rlimits"].items():
            try:
                resource.setrlimit(number, (soft, hard))
            except (OSError, ValueError) as exc:
                problems.append(f"resource limit {number} = {(soft, hard)}: {exc}")
    if problems:
        print(
            "fastspawn: this worker keeps the zygote's setting for: " + "; ".join(problems),
            file=sys.stderr,
        )


def adopt_fork_limits(diff: dict[str, Any]) -> list[tuple[int, tuple[int, int]]]:
    """Fork the way the caller would: take on the caller's soft
    RLIMIT_NPROC (from ``diff``, see ``changed``) in this process, the
    zygote, for the forks of one launch.  The kernel checks the forking
    process's limit, so without this a caller that lowered its limit after
    the zygote started could start ranks past it (and one that raised it
    could not start what a fork of its own would).  Of the limits workers
    adopt, this is the only one fork(2) itself obeys: the others bind what a
    worker does later, under the limits it applied.  Returns what
    ``restore_limits`` puts back after the forks.

    Only the soft limit moves, and only as far as this process's hard
    limit: an unprivileged process that lowers its hard limit can never
    raise it again, so the zygote would keep the caller's limit for every
    later launch.  A lower hard limit of the caller's is applied by each
    worker (``apply``), not here.
    """
    import resource

    return _adopt_soft(diff, resource.RLIMIT_NPROC, raise_only=False)


def adopt_open_files_limit(diff: dict[str, Any]) -> list[tuple[int, tuple[int, int]]]:
    """Serve a launch, in this process (the zygote), under the caller's
    soft RLIMIT_NOFILE where it is higher than ours (from ``diff``, see
    ``changed``): the zygote receives the ranks' stdio fds and opens a
    pidfd per rank, and a caller that raised its limit for a launch after
    the zygote started (as the error for running out of fds tells it to)
    must not meet its old limit here again.  Only raised, and only as far
    as our hard limit; ``restore_limits`` puts it back after the launch,
    so later workers inherit the zygote's limit, as before."""
    import resource

    return _adopt_soft(diff, resource.RLIMIT_NOFILE, raise_only=True)


def raise_open_files(wanted: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE to ``wanted`` where it is
    lower, as far as the hard limit (never lowered; a refusal leaves it).
    The zygote's own, for the fds its ready workers hold: a desktop's
    default soft limit of 1024 holds half the default cap, 128 of 256
    (see fastspawn._zygote.ready).  Go raises its own
    soft limit the same way, to the hard one, and gives the original back
    to the processes it starts (golang/go#46279, #59063); so does the
    zygote, to every worker (``open_files_back``), raising no further
    than its workers need."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _at_most(wanted, hard)
    if _at_most(target, soft) == target:
        return  # ours is that high already
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        pass  # the kernel's own ceiling (fs.nr_open): we keep ours


def open_files_back(diff: dict[str, Any], started: dict[str, Any]) -> None:
    """Where ``raise_open_files`` raised this process's soft RLIMIT_NOFILE
    above the one it started with (``started``, from ``capture``: the
    caller's as the zygote started) and ``diff`` (a launch's, from
    ``changed``) has no limit of the caller's for it, add the one it
    started with to ``diff``: the launch's workers, which inherit ours,
    take it back (``apply``, or the C launcher for binaries) and run under
    the caller's limit, as a worker forked before the raise would."""
    import resource

    number = resource.RLIMIT_NOFILE
    limits = diff.get("rlimits", {})
    own = started["rlimits"].get(number)
    if own is None or number in limits or resource.getrlimit(number) == own:
        return
    diff["rlimits"] = {**limits, number: own}


def _adopt_soft(
    diff: dict[str, Any], number: int, raise_only: bool
) -> list[tuple[int, tuple[int, int]]]:
    """Take on the caller's soft limit ``number`` (from ``diff``) as far as
    our hard limit; with ``raise_only``, only where it is above ours.
    Returns what ``restore_limits`` puts back (nothing when unchanged, or
    when the kernel refuses: we go on under our own limit, as before)."""
    import resource

    wanted = diff.get("rlimits", {}).get(number)
    if wanted is None:
        return []
    own = resource.getrlimit(number)
    soft = _at_most(wanted[0], own[1])
    if soft == own[0] or (raise_only and _at_most(soft, own[0]) == soft):
        return []
    try:
        resource.setrlimit(number, (soft, own[1]))
    except (OSError, ValueError):
        return []
    return [(number, own)]


def restore_limits(saved: list[tuple[int, tuple[int, int]]]) -> None:
    """Put back the limits ``adopt_fork_limits`` changed (soft ones only,
    below the hard limit it left alone: always allowed)."""
    import resource

    for number, limits in saved:
        resource.setrlimit(number, limits)


def _at_most(value: int, bound: int) -> int:
    """``min(value, bound)`` for resource limits, RLIM_INFINITY the largest."""
    import resource

    if bound == resource.RLIM_INFINITY:
        return value
    if value == resource.RLIM_INFINITY:
        return bound
    return min(value, bound)
