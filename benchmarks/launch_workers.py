"""Rank functions of the launch benchmark.

They live in their own module, which imports nothing but the standard
library, so that a spawned worker of either launcher imports only what that
launcher itself needs (and so that they pickle by reference for spawn and
forkserver, whatever module runs the benchmark).
"""

from __future__ import annotations

import time
from typing import Any


def _sleep_until(deadline: float) -> None:
    # time.sleep may return early on a signal: loop until the deadline.
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


def timed_rank(rank: int, deadline: float) -> tuple[float, float]:
    """Record entry, wait for the common deadline, record the return.

    Returns (entry time, return time), both CLOCK_MONOTONIC, which Linux
    shares between processes, so the parent compares them with its own.
    """
    entry = time.monotonic()
    _sleep_until(deadline)
    return entry, time.monotonic()


def timed_rank_to_queue(rank: int, deadline: float, queue: Any) -> None:
    """:func:`timed_rank` for multiprocessing, which has no return values:
    the times go back through ``queue`` (a SimpleQueue of the same context)."""
    entry = time.monotonic()
    _sleep_until(deadline)
    done = time.monotonic()
    queue.put((entry, done))
