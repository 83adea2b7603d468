"""Pieces the benchmark scripts share.  Imports only os and time: the
teardown measurements run in interpreters whose imports are the variable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any


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
