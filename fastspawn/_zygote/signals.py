"""The zygote's signals: its own handlers, those user code set in it (kept
for the workers), and the workers' handlers lent for a fork loop's length."""

from __future__ import annotations

import os
import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


ZYGOTE_SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}


def _on_sigchld(signum: int, frame: Any) -> None:
    """Nothing: the wakeup fd is what tells the zygote's loop."""


def let_signals_through(unlent: set[int]) -> None:
    """In a freshly forked rank: the handlers the fork loop could not lend
    (SIG_IGN, see Signals.lend) set, then the zygote's signals let through."""
    for sig in unlent:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ZYGOTE_SIGNALS)


_terminating = False


def terminating() -> bool:
    """Whether our own SIGTERM (the guard died, or the caller) has come:
    the zygote is shutting down."""
    return _terminating


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """PR_SET_PDEATHSIG: the caller died.  Leave the current work (a long
    preload import, say) for the shutdown, once: a second signal must not
    cut the shutdown itself short."""
    global _terminating
    if not _terminating:
        _terminating = True
        raise SystemExit(0)


# A worker's handlers for those signals, unless user code set its own
# (user_handlers): Python's defaults.
_WORKER_HANDLERS: dict[int, Any] = {
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGINT: signal.default_int_handler,
}

# The zygote's own handlers (SIGINT: Ctrl-C is for the caller).
_OWN_HANDLERS: dict[int, Any] = {
    signal.SIGCHLD: _on_sigchld,
    signal.SIGTERM: exit_on_sigterm,
    signal.SIGINT: signal.SIG_IGN,
}


class Signals:
    """The zygote's signal state: its wakeup pipe (SIGCHLD wakes the main
    loop through it) and the handlers user code set here for the workers."""

    def __init__(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, _on_sigchld)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        # Handlers that user code run here (the main module's import,
        # preloads, unpickling) set for the signals the zygote lives by:
        # the workers get them, as a spawn child would (see reclaim).
        self.user_handlers: dict[int, Any] = {}

    def reclaim(self) -> None:
        """Put the zygote's own handlers back where user code replaced them,
        keeping the user's for the workers.

        A main module that sets a SIGTERM handler at import (for a graceful
        shutdown) set it in the zygote, where it replaced the zygote's, and
        its workers were then given SIG_DFL; one that sets SIGCHLD to
        SIG_IGN made the kernel reap the workers before the zygote could
        report their exit, and joins hung.  Called after each stretch of
        user code."""
        for sig, own in _OWN_HANDLERS.items():
            current = signal.getsignal(sig)
            if current is not own:
                self.user_handlers[sig] = current
                signal.signal(sig, own)

    def lend(self) -> set[int]:
        """For the length of a fork loop (the zygote's signals blocked): the
        workers' handlers in place of the zygote's, so that each rank is
        born with them rather than setting them itself (three
        ``signal.signal()`` calls and the wakeup fd cost a rank some 45
        page copies, 0.18 ms, measured).  A handler SIG_IGN is not lent: set
        here, it would discard a SIGTERM pending for the zygote itself (its
        shutdown).  Returns the signals not lent, which each rank sets."""
        signal.set_wakeup_fd(-1)
        unlent = set()
        for sig, default in _WORKER_HANDLERS.items():
            handler = self.user_handlers.get(sig, default)
            if handler == signal.SIG_IGN:
                unlent.add(sig)
            else:
                signal.signal(sig, handler)
        return unlent

    def take_back(self) -> None:
        """After a fork loop, before the zygote's signals are unblocked:
        its own handlers back.  SIGCHLD at SIG_DFL for the loop dropped the
        one pending, if any, and those that came: look for exited workers
        as if one had come."""
        for sig, own in _OWN_HANDLERS.items():
            signal.signal(sig, own)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # full: the loop wakes for it already
