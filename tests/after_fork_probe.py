"""A multiprocessing after-fork callable (``util.register_after_fork``),
registered when this module is imported, that notes each process it runs
in: a child must run it once, as multiprocessing's fork and forkserver
children do (test_mp_context.py)."""

from __future__ import annotations

import os
from multiprocessing import util

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _Holder:
    """What the callable is registered for (the registry keeps it weakly)."""


HOLDER = _Holder()
RAN_IN: list[int] = []  # the pid of each process the callable ran in, each time


def _after_fork(_holder: _Holder) -> None:
    RAN_IN.append(os.getpid())


util.register_after_fork(HOLDER, _after_fork)


def runs_here(_rank: int = 0) -> int:
    """How many times the callable ran in this process."""
    return RAN_IN.count(os.getpid())


def runs_in_target(queue: Any) -> None:
    queue.put(runs_here())


def runs_in_a_forked_rank(_rank: int) -> int:
    """runs_here() of a rank this rank forks itself (fastspawn's fork
    method): the callable runs in that grandchild too."""
    import fastspawn

    return fastspawn.start_processes(runs_here, nprocs=1, start_method="fork").return_values[0]
