"""Rank functions for the zygote benchmark (standard library only, so that
spawned workers import nothing the launcher does not need)."""

from __future__ import annotations

import os
import time
from typing import Any


def entry_time(rank: int) -> float:
    """A trivial fn: report when it started."""
    return time.monotonic()


def entry_time_to_array(rank: int, times: Any) -> None:
    """The same for multiprocessing, which has no return values."""
    times[rank] = time.monotonic()


def exit_together(rank: int, deadline: float) -> float:
    """Wait for a common deadline, then return the time of return."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
    return time.monotonic()


def fail_one(rank: int, bad_rank: int, deadline: float, report: Any) -> None:
    """Once every rank is up (at ``deadline``), rank ``bad_rank`` fails,
    recording when; the others sleep on."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
    if rank == bad_rank:
        report.value = time.monotonic()
        raise RuntimeError("planned failure")
    time.sleep(600)


def idle(rank: int, release: Any) -> int:
    """Stay alive until the parent has measured memory."""
    release.wait(600)
    return os.getpid()
