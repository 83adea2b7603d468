"""Pieces the benchmark scripts share.  Imports only os and time: the
teardown measurements run in interpreters whose imports are the variable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any


def fork_sleepers(n: int, setup: Callable[[], None] | None = None) -> list[int]:
    """Fork ``n`` children of this process in one process group (led by the
    first), each running ``setup`` and then sleeping; return their pids once
    every one is asleep.  The caller kills and reaps them."""
    r, w = os.pipe()
    pids: list[int] = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:
                try:
                    os.setpgid(0, pids[0] if pids else 0)
                    if setup is not None:
                        setup()
                    os.write(w, b"x")
                    time.sleep(600)
                finally:
                    os._exit(0)
            os.setpgid(pid, pids[0] if pids else pid)
            pids.append(pid)
        os.close(w)
        w = -1
        up = 0
        while up < n:
            up += len(os.read(r, n))
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    time.sleep(0.3)  # past the write: asleep
    return pids


def busy_s() -> float:
    """CPU time the whole machine has spent so far (user, nice, system,
    irq, softirq: all but idle, iowait and steal), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(value) for value in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_used_s(pids: Sequence[int]) -> float:
    """CPU time the live processes ``pids`` have used so far, summed."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def kill_and_reap(pids: Sequence[int], kill: Callable[[], None]) -> tuple[float, float]:
    """Run ``kill`` (which must kill every one of ``pids``), reap them all.

    Returns (seconds from ``kill`` to the last reap, CPU seconds the children
    spent from the kill on, summed: their teardown).  The latter is what
    wait4() reports for each minus what /proc/PID/schedstat said before.
    """
    before = cpu_used_s(pids)
    t0 = time.perf_counter()
    kill()
    total = 0.0
    for pid in pids:
        _, _, usage = os.wait4(pid, 0)
        total += usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, max(0.0, total - before)


def emit(report: dict[str, Any], path: str | None) -> None:
    """Print ``report`` as JSON, and write it to ``path`` if given."""
    import json

    text = json.dumps(report, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)
