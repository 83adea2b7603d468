"""The thread that starts processes when the caller's thread may not last.

PR_SET_PDEATHSIG is tied to the *thread* that forks, so launches from any
thread but the main one run on a fastspawn thread that lives as long as the
process (the checkpoint client starts workers from a pool thread that may
exit right after).
"""

from __future__ import annotations

import collections
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fastspawn._os import oscall

T = TypeVar("T")


class _Outcome:
    """A job's result or exception, handed from the launcher thread to the
    thread waiting for it.  (Not concurrent.futures: that import costs a
    main module that imports fastspawn, and so the zygote, a few ms.)"""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


_jobs: collections.deque[tuple[Callable[[], Any], _Outcome]] = collections.deque()
_jobs_ready = threading.Condition()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()


def _launcher_loop(mask: set[int | signal.Signals]) -> None:
    # A thread starts with its creator's mask, which may be a held one
    # (every signal blocked, see oscall.held_signals): not for this thread,
    # whose forked workers and started programs inherit its mask.
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    while True:
        with _jobs_ready:
            while not _jobs:
                _jobs_ready.wait()
            job, outcome = _jobs.popleft()
        try:
            outcome.value = job()
        except BaseException as exc:
            outcome.error = exc
        outcome.done.set()
        del job, outcome  # hold nothing of a finished job while waiting


def on_launcher_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on a thread that outlives every caller: the main thread
    when we are on it, else fastspawn's own daemon launcher thread."""
    global _thread
    if threading.current_thread() is threading.main_thread():
        return fn(*args, **kwargs)
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(
                target=_launcher_loop,
                args=(oscall.unheld_mask(),),
                name="fastspawn-launcher",
                daemon=True,
            )
            _thread.start()
    outcome = _Outcome()
    with _jobs_ready:
        _jobs.append((lambda: fn(*args, **kwargs), outcome))
        _jobs_ready.notify()
    value: T = outcome.result()
    return value


def _reset_after_fork() -> None:
    global _thread, _jobs_ready, _thread_lock
    _thread = None  # the launcher thread does not exist in a forked child
    # A fork inside held_signals() (a "fork" worker's) leaves that block
    # behind: what this process launches gets its own mask, not the parent's.
    oscall._outside.mask = None
    # ...and it may have held these at the fork: fresh ones, no old jobs.
    _jobs.clear()
    _jobs_ready = threading.Condition()
    _thread_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
