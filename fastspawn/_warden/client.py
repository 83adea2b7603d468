"""The caller's side of the warden (see fastspawn._warden.main): its handle, and the record
of which process groups it is to kill should the caller die.

The groups are those of fork and spawn launches not yet reaped.  The warden
starts at the first such launch, and again, told every group, should it
have died.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterable, Sequence

from fastspawn._os import oscall
from fastspawn._os.helper import HelperClient
from fastspawn._warden import main as warden_main


class Warden(HelperClient):
    """The caller's handle on its warden: the transport alone (which groups
    to name is this module's record, see watch_group)."""

    def __init__(self) -> None:
        # No PR_SET_PDEATHSIG: it must outlive us.
        try:
            super().__init__(["-I", "-S", warden_main.__file__])
        except OSError as exc:
            # Named, or a fork launch (which runs no program of its own)
            # fails with a bare ENOENT for sys.executable.
            raise type(exc)(
                exc.errno,
                f"fastspawn: could not start the warden ({sys.executable!r} -I -S), which "
                f"kills a fork or spawn launch's leftovers should this process die: "
                f"{exc.strerror}; point sys.executable at a Python interpreter",
            ) from exc

    def send(self, words: Iterable[str]) -> None:
        """One message; OSError if the warden is gone (EPIPE: no SIGPIPE on
        a SOCK_SEQPACKET socket) or not keeping up."""
        self.control.send(" ".join(words).encode(), socket.MSG_DONTWAIT)

    def alive(self) -> bool:
        """Whether it runs (reaping it if not)."""
        try:
            return oscall.pidfd_wait(self.pidfd, nohang=True) is None
        except ChildProcessError:
            return False

    def close(self) -> None:
        """Stop the warden (it kills nothing) and reap it."""
        if not self.owned_here():
            return
        try:
            self.send(["stop"])
        except OSError:
            # Gone, or not reading: without "stop" it would wait for our
            # exit to kill what it was told of, which is no longer its to
            # kill (a new warden has it).
            self.control.close()
            self.kill_and_reap()
            return
        self.control.close()
        self.reap()


_warden_handle: Warden | None = None
# The groups of fork and spawn launches not yet reaped: what the warden kills
# should we die.  Reentrant: a finalizer that ends a context may run (in a
# garbage collection) while this thread holds it.
_watched: set[int] = set()
# Those of them the warden keeps until they are empty (see linger), dropped
# from the record once found empty.
_lingering: set[int] = set()
_lock = threading.RLock()


def watch_group(group: int) -> None:
    """Name a fork or spawn launch's process group to the warden, started
    on first use (or again, with every group, should it have died)."""
    global _warden_handle
    with _lock:
        words = [f"-{gone}" for gone in _prune_lingering()]
        _watched.add(group)
        try:
            if _warden_handle is not None:
                try:
                    _warden_handle.send([*words, f"+{group}"])
                    return
                except OSError:
                    _warden_handle.close()
                    _warden_handle = None
            _warden_handle = Warden()
            _warden_handle.send([f"+{watched}" for watched in sorted(_watched)])
        except BaseException:
            _watched.discard(group)
            raise


def forget_groups(groups: Sequence[int]) -> None:
    """These groups' workers are all reaped: the warden must not kill them."""
    with _lock:
        mine = [group for group in groups if group in _watched]
        if not mine:
            return
        _watched.difference_update(mine)
        if _warden_handle is not None:
            try:
                _warden_handle.send([f"-{group}" for group in mine])
            except OSError:
                pass  # gone: it kills nothing, and the next launch replaces it


def linger(groups: Sequence[int]) -> None:
    """These groups are to be killed at our death for as long as any
    process is in them, not only until their workers are reaped (a
    multiprocessing process's children outlive it): the warden drops a
    group once it finds it empty; this record drops it when a later launch
    finds it so (a new warden must not be told of a group whose id may be
    another's by then)."""
    with _lock:
        _lingering.update(group for group in groups if group in _watched)


def _prune_lingering() -> list[int]:
    """Drop the lingering groups that are empty (or no longer ours, the id
    taken by another user's group); the ones dropped."""
    dropped = []
    for group in list(_lingering):
        try:
            os.killpg(group, 0)
            continue
        except (ProcessLookupError, PermissionError):  # empty; or another user's now
            pass
        _lingering.discard(group)
        _watched.discard(group)
        dropped.append(group)
    return dropped


def release_at_exit() -> None:
    """At interpreter exit, once fastspawn's exit hook has ended the
    launches it could: let go of the warden's control socket without
    closing its fd.  The warden is to learn of our end only when this
    process ends (the socket's EOF, as at a death), so the fd stays open
    until then; but the socket object, left to the interpreter's shutdown,
    was finalized there still open, with a ResourceWarning (seen at the end
    of a test run)."""
    warden = _warden_handle
    if warden is not None and warden.owned_here() and warden.control.fileno() >= 0:
        warden.control.detach()


def current() -> Warden | None:
    """This process's warden handle, if it started one."""
    return _warden_handle


def warden_process() -> tuple[set[int], set[int]]:
    """(pids, fds) of this process's warden; leak checks leave these alone."""
    warden = _warden_handle
    if warden is None or not warden.owned_here():
        return set(), set()
    return {warden.pid}, warden.helper_fds()


def _reset_after_fork() -> None:
    global _warden_handle, _lock, _watched, _lingering
    if _warden_handle is not None:
        _warden_handle.forget_in_child()  # it watches the parent, not us
    _warden_handle = None
    _lock = threading.RLock()
    _watched = set()
    _lingering = set()


os.register_at_fork(after_in_child=_reset_after_fork)
