"""The caller's exit: the launches it leaves running are ended as
multiprocessing ends its children (daemonic workers stopped, the others
waited for), then the zygote is stopped and the warden let go."""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Protocol

from fastspawn._launch.methods import helpers
from fastspawn._worker import runner

log = logging.getLogger(__name__)


class _Launch(Protocol):
    """What the exit needs of a context (fastspawn._launch.context's)."""

    def _shutdown_at_exit(self) -> None: ...


# Contexts whose workers are not all reaped, held (as multiprocessing holds
# its children) so that a context dropped unjoined is still shut down at exit.
live_contexts: set[_Launch] = set()

# Launches under way, by a token each: their workers can be running before
# their context exists and joins live_contexts (a launch by another thread
# that the main thread's exit overtakes), so the exit waits for them to hand
# over rather than stop the zygote, and the workers with it, under them.
launches_under_way: set[object] = set()
HANDOVER_WAIT = 30.0  # seconds the exit waits for those, at most


def _forget_in_child() -> None:
    # A process forked from ours (os.fork(), a "fork" worker) must not shut
    # our workers down at its exit, nor read their reports.
    live_contexts.clear()
    launches_under_way.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def at_exit() -> None:
    _wait_for_handovers(HANDOVER_WAIT)
    for ctx in list(live_contexts):
        try:
            ctx._shutdown_at_exit()
        except Exception:
            log.exception("fastspawn: could not shut down %r at exit", ctx)
    helpers.stop_at_exit()


def _wait_for_handovers(timeout: float) -> None:
    """Wait for the launches other threads have under way to hand their
    workers to a context (or to fail and kill them)."""
    deadline = time.monotonic() + timeout
    while launches_under_way:
        if time.monotonic() >= deadline:
            log.warning(
                "fastspawn: a launch in another thread was still under way at exit "
                "after %.0f s; its workers are stopped with the zygote",
                timeout,
            )
            return
        time.sleep(0.01)


# A zygote worker, or one forked from the caller, runs no atexit handler it
# inherited: its end calls this one (see fastspawn._worker.runner.finish).
runner.launches_at_exit = at_exit
