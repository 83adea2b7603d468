"""Signals held across a step that must not be cut in two (held_signals),
helper threads that take no signal (start_quiet_thread), and the mask a
process started inside a held step must get (unheld_mask)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable

TYPE_CHECKING = False  # not typing's: the zygote and its workers skip typing
if TYPE_CHECKING:
    from typing import Any

# The C function signal.pthread_sigmask wraps: the wrapper turns each signal
# of the mask it returns into an enum, 80 us for a held mask (some 60
# signals) where the call itself costs 2 us (python -m timeit, one block and
# restore).  Like the wrapper, it runs the handlers of signals it unblocked
# before returning.
_pthread_sigmask: Callable[[int, Iterable[int]], set[int]] = sys.modules["_signal"].pthread_sigmask
# Likewise signal.getsignal and signal.signal, whose wrappers try to make an
# enum of a handler that is a function, and fail, at a cost: 22 us for a
# held block (12 handlers looked at, SIGINT's swapped and put back) against
# 6 without them (python -m timeit, Python 3.11, AMD EPYC), and a launch
# holds signals some 11 times.
_getsignal: Callable[[int], Any] = sys.modules["_signal"].getsignal
_setsignal: Callable[[int, Any], Any] = sys.modules["_signal"].signal

# Signals that report a fault of the thread that caused it: never blocked.
_SYNCHRONOUS = {
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGILL,
    signal.SIGABRT,
    signal.SIGTRAP,
    signal.SIGSYS,
}
# Every asynchronous signal: what held_signals() and start_quiet_thread()
# block.  Computed once: signal.valid_signals() alone costs about 80 us.
_ASYNCHRONOUS = frozenset(signal.valid_signals() - _SYNCHRONOUS - {signal.SIGKILL, signal.SIGSTOP})


def start_quiet_thread(thread: threading.Thread) -> None:
    """Start a helper thread (one that never forks or launches) with every
    asynchronous signal blocked in it.

    The kernel hands a signal sent to the process to any thread that does not
    block it, and takes another one than the main thread when the main thread
    has one pending already (a Ctrl-C followed at once by a SIGTERM).  Python
    runs handlers in the main thread only; if ours took the signal, the main
    thread, asleep in epoll_wait without a timeout, would never wake to run
    the handler.  The new thread inherits the mask in force at start().
    """
    previous = _pthread_sigmask(signal.SIG_BLOCK, _ASYNCHRONOUS)
    try:
        thread.start()
    finally:
        _pthread_sigmask(signal.SIG_SETMASK, previous)


# Per thread: the signal mask in force outside the outermost held_signals()
# block, which a process started inside it must get (not the held one).
_outside = threading.local()

# The signals whose Python handlers held_signals() defers in the main thread
# (see there): those programs handle.  Looked up per block (0.4 us each), so
# a short list; a handler of another signal still runs where it falls.
_DEFERRED = tuple(
    getattr(signal, name)
    for name in (
        "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2",
        "SIGCHLD", "SIGWINCH", "SIGVTALRM", "SIGPROF", "SIGXCPU",
    )
)  # fmt: skip


class _Deferral:
    """The Python handlers of the main thread, swapped for a recorder while
    an outermost held_signals() block runs there; what came meanwhile is
    handed to them when it ends (each signal once, as the kernel coalesces
    a pending one)."""

    active: _Deferral | None = None  # the main thread's, while one runs

    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}
        self.came: list[tuple[int, Any]] = []
        _Deferral.active = self
        try:
            for sig in _DEFERRED:
                handler = _getsignal(sig)
                if callable(handler):
                    self.handlers[sig] = handler  # known before it is swapped
                    _setsignal(sig, self._record)
        except BaseException:
            # A handler not yet swapped ran and raised (KeyboardInterrupt):
            # nothing stays swapped.
            self.restore()
            raise

    def _record(self, signum: int, frame: Any) -> None:
        if all(sig != signum for sig, _ in self.came):
            self.came.append((signum, frame))

    def restore(self) -> None:
        """Put the handlers back, whatever came: all of them, even if one
        put back runs at once and raises (its exception is raised after)."""
        _Deferral.active = None
        first: BaseException | None = None
        for sig, handler in self.handlers.items():
            try:
                _setsignal(sig, handler)
            except BaseException as exc:  # set, then its handler ran and raised
                first = first or exc
        if first is not None:
            raise first

    def replay(self) -> None:
        """Run the handler of each signal that came; the first exception
        raised is raised once all have run."""
        first: BaseException | None = None
        for signum, frame in self.came:
            try:
                self.handlers[signum](signum, frame)
            except BaseException as exc:  # KeyboardInterrupt above all
                if first is None:
                    first = exc
        self.came = []
        if first is not None:
            raise first


def _restore_in_child() -> None:
    # Forked inside a held block (the fork method's ranks): the child starts
    # with the caller's handlers, not the recorder; nothing is replayed.
    if _Deferral.active is not None:
        _Deferral.active.restore()


os.register_at_fork(after_in_child=_restore_in_child)


class held_signals:
    """``with held_signals():`` keeps asynchronous signals pending across a
    step whose result must reach the caller's records: a process started
    and its pid stored, say.  A Ctrl-C in between would raise
    KeyboardInterrupt after the process started and before anyone knew of
    it, leaving it running (and its pidfd open) beyond any cleanup.  Held,
    the signal is delivered when the block ends, and its exception raised
    there.  ``previous`` is the mask to restore in a child forked inside;
    :func:`launch` inside gives its child the mask from outside the block.

    The mask covers this thread alone, and the kernel gives a signal sent
    to the process to any thread that does not block it (a thread of the
    program's, one that ``import torch`` started); Python then runs the
    handler in the main thread, wherever it is.  So in the main thread the
    outermost block also swaps the Python handlers of the signals programs
    handle (SIGINT's raises KeyboardInterrupt) for a recorder, and runs the
    handlers of what came when the block ends.  A child forked inside gets
    the handlers back (``os.register_at_fork``).
    """

    def __init__(self) -> None:
        self.previous: set[int] = set()
        self.outermost = False
        self._deferral: _Deferral | None = None

    def __enter__(self) -> held_signals:
        outside = getattr(_outside, "mask", None)
        if outside is not None:
            # Inside another block: everything is held already, and that
            # block lets it through (no system call here, 0.3 us).
            self.previous = set(outside)
            self.outermost = False
            return self
        # The Python handlers first: from then on none of them raises here
        # (a signal another thread took runs its handler in this one, mask
        # or not).  A handler that raises before they are swapped leaves
        # nothing changed.
        if threading.current_thread() is threading.main_thread():
            try:
                self._deferral = _Deferral()
            except ValueError:  # not the main interpreter, or finalizing
                self._deferral = None
        try:
            # The mask as it is, then blocked: should a handler of a signal
            # not deferred raise as the block returns, __exit__ still knows
            # what to restore.
            self.previous = _pthread_sigmask(signal.SIG_BLOCK, ())
            self.outermost = True
            _outside.mask = self.previous
            _pthread_sigmask(signal.SIG_BLOCK, _ASYNCHRONOUS)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        deferral, self._deferral = self._deferral, None
        try:
            if self.outermost:
                self.outermost = False
                _outside.mask = None
                # Signals pending on this thread come now: to the recorder,
                # if the handlers are swapped.
                _pthread_sigmask(signal.SIG_SETMASK, self.previous)
        finally:
            if deferral is not None:
                try:
                    deferral.restore()
                finally:
                    deferral.replay()


def unheld_mask() -> set[int]:
    """This thread's signal mask as it is outside any held_signals() block."""
    outside = getattr(_outside, "mask", None)
    if outside is not None:
        return set(outside)
    return _pthread_sigmask(signal.SIG_BLOCK, ())


def import_held(name: str) -> Any:
    """The module ``name``, imported with signals held where this is its
    first use (then a dict lookup).

    A launch imports some modules only when it first needs them.  CPython
    ends each import in a weakref callback that drops the module's lock,
    and an exception raised there is printed ("Exception ignored in") and
    dropped: a Ctrl-C whose handler ran at that moment was lost, and the
    launch went on.  Held, the signal comes when the import is whole.
    """
    module = sys.modules.get(name)
    if module is None:
        with held_signals():
            __import__(name)
        module = sys.modules[name]
    return module
