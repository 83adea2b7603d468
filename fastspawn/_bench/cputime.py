"""What a launch cost the machine beside how long it took: the CPU time
of the processes it involved, from the call to the moment the bench has
every rank's entry (the ranks' and helpers': until they are off the CPUs
after it, below): each process's CPU clock (clock_gettime on the clock
the kernel keeps for any pid, in ns), found from /proc's children lists.

A snapshot is taken before the launch of the bench itself and of every
process below it (the zygote, its ready workers, a floor's pre-forked
children, a forkserver): a rank that was one of them counts from there,
from its wake; a rank forked or spawned in the launch counts whole (the
fork's own cost is its parent's: the zygote's, or the bench's for
multiprocessing's fork).  Processes gone by the second look are not
counted; a process's threads that ended are.

Each reading waits until the processes read are off the CPUs (settled):
the kernel adds a task's time on a CPU to what it shows (its clocks,
schedstat) at a scheduler tick or when the task stops running, so a rank
still running since its wake read as having spent up to a tick less, or
nothing (a pre-forked floor rank on a CI host: rank_cpu_s 0.0; a child
spinning on the other CPU read 4 ms steps at HZ 250).  The process clock
adds the reader's own slice only (thread_group_cputime), which is why the
bench's own time is exact without that wait."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Iterable


class Snapshot(NamedTuple):
    """CPU times (ns): the bench's, and each process's below it by pid."""

    bench: int
    processes: dict[int, int]


# The round's fields, in seconds: all of it, then its parts (the bench's is
# the caller's: the launch call, then reading the ranks' records).
FIELDS = ("cpu_s", "rank_cpu_s", "helper_cpu_s", "caller_cpu_s")


def process_ns(pid: int) -> int | None:
    """The CPU time of ``pid``'s threads so far, ended ones included (ns);
    None once it is gone (reaped) or where this kernel refuses the clock."""
    try:
        return time.clock_gettime_ns(_process_clock(pid))
    except OSError:
        return None


def _process_clock(pid: int) -> int:
    # The clockid clock_getcpuclockid(3) returns for pid: the kernel's
    # process CPU clock of the scheduler's kind (CPUCLOCK_SCHED, 2) for ~pid,
    # as include/linux/posix-timers.h makes it.
    return ((~pid) << 3) | 2


def descendants(pid: int) -> list[int] | None:
    """Every process below ``pid``; None where /proc does not list a
    thread's children (a kernel built without CONFIG_PROC_CHILDREN)."""
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as children:
                    kids = [int(kid) for kid in children.read().split()]
            except FileNotFoundError:
                if parent == pid:
                    return None
                continue
            except OSError:
                continue
            found += kids
            queue += kids
    return found


def available() -> bool:
    """Whether this kernel shows what the snapshots read."""
    return process_ns(os.getpid()) is not None and descendants(os.getpid()) is not None


def snapshot() -> Snapshot:
    """The bench's CPU time and every process's below it, now (call
    available() first)."""
    me = os.getpid()
    processes: dict[int, int] = {}
    below = descendants(me) or []
    settle(below)
    for pid in below:
        spent = process_ns(pid)
        if spent is not None:
            processes[pid] = spent
    return Snapshot(bench_ns(), processes)


# How long settle() waits for processes to leave the CPUs (s), and how
# often it looks.
SETTLE_WITHIN = 0.2
SETTLE_LOOK = 0.0002


def settle(pids: Iterable[int], within: float = SETTLE_WITHIN) -> None:
    """Return once none of ``pids``' threads is running or runnable (each
    in a sleep, stopped, exited or gone), so that what the kernel shows of
    their CPU time is whole, or after ``within`` s (a reading of one still
    running then lacks up to a tick of its current slice).

    A thread shows as sleeping a moment before the switch that adds its
    slice, so the last look is followed by one more pause."""
    deadline = time.monotonic() + within
    left = {pid for pid in pids if _running(pid)}
    while left and time.monotonic() < deadline:
        time.sleep(SETTLE_LOOK)
        left = {pid for pid in left if _running(pid)}
    time.sleep(SETTLE_LOOK)


def _running(pid: int) -> bool:
    """Whether a thread of ``pid`` is running or waits for a CPU (its state
    in /proc is R); False once it is gone."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]  # after the name
        except OSError:
            continue  # ended meanwhile
        if state == b"R":
            return True
    return False


def bench_ns() -> int:
    """The bench's own CPU time so far (ns)."""
    return process_ns(os.getpid()) or 0


def bench_now(before: Snapshot) -> Snapshot:
    """``before`` with the bench's own time read again: taken right before
    the launch, so that the snapshot's own reading is not the caller's."""
    return Snapshot(bench_ns(), before.processes)


def spent(
    before: Snapshot, bench: int, ranks: Iterable[int], helpers: Iterable[int]
) -> dict[str, float | None]:
    """The round's FIELDS since ``before``: the ranks', the method's helper
    processes' (the ranks not among them; None for a method without any),
    the bench's (``bench``: its CPU time read the moment it had every
    rank's entry) and their sum."""
    ranks = set(ranks)
    others = set(helpers) - ranks
    settle(ranks | others)
    shares = [_since(before, ranks), _since(before, others), bench - before.bench]
    seconds: list[float | None] = [sum(shares) / 1e9, *(share / 1e9 for share in shares)]
    if not others:
        seconds[2] = None
    return dict(zip(FIELDS, seconds, strict=True))


def _since(before: Snapshot, pids: set[int]) -> int:
    total = 0
    for pid in pids:
        now = process_ns(pid)
        if now is not None:
            total += now - before.processes.get(pid, 0)
    return total
