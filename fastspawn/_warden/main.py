"""The warden: kills the process groups of a caller's fork and spawn launches
once the caller is gone, however it died.

Workers of those start methods are the caller's children, with
PR_SET_PDEATHSIG(SIGKILL) against it; their own children are not, and
nothing that outlives a SIGKILL of the caller would otherwise be left to stop
them.  Each such launch puts its workers (and so, unless they move, their
children) in a process group of its own, and the caller names the group to
its warden: a small process of its own, started at the first fork or spawn
launch, that watches the caller through a pidfd and kills every group still
named when the caller exits.  (Zygote launches need none: the zygote watches
the caller, and adopts its workers' orphans.)

The warden runs this file as a script under ``python -I -S``: the standard
library alone, no site, no fastspawn import, so it starts in a few ms.  The
caller's side (its handle, the record of groups) is .client.  The
caller talks to it over an inherited socketpair: ``+<pgid>`` names a group,
``-<pgid>`` drops one whose workers are all reaped, ``stop`` ends it
(space-separated, several in one message).  A group still named when the
caller dies is killed; one dropped never is, nor one found gone meanwhile:
its id is free, and may come back as a stranger's group.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs the warden
if TYPE_CHECKING:
    from collections.abc import Iterable

stopped = False  # the caller said "stop": its EOF that follows kills nothing
PRUNE_S = 1.0  # how often the groups named are checked for any gone


def _apply(groups: set[int], data: bytes) -> None:
    global stopped
    for word in data.split():
        if word == b"stop":
            stopped = True
        elif word[:1] == b"+":
            groups.add(int(word[1:]))
        else:
            groups.discard(int(word[1:]))


def _drain(control: socket.socket, groups: set[int]) -> bool:
    """Apply every queued message; False at EOF."""
    while True:
        try:
            data = control.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        _apply(groups, data)


def _prune(groups: set[int]) -> None:
    """Drop the groups that no longer exist.  A group's id stays taken while
    any member does, reaped or not; once the last is gone, a new process may
    get that id as its pid and lead a group of it, which a kill of the old
    name would hit.  The caller drops a launch's group as it reaps the last
    worker, but cannot always: after an exec the workers live on, and the
    program it became reaps them (a shell does) knowing nothing of us.  (An
    empty group never fills again: only an existing group can be joined.)"""
    for group in list(groups):
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            groups.discard(group)
        except PermissionError:
            pass  # not ours to signal, nor to kill: _kill finds the same


def _kill(groups: Iterable[int]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone; or, if the id came back to another user's group, not ours


def main() -> None:
    """``python -I -S _warden/main.py <control fd> <caller pid>``."""
    # Not for us: a terminal's Ctrl-C (we lead a group of our own anyway) and
    # its hangup, after which the caller's groups still need their cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    control = socket.socket(fileno=int(sys.argv[1]))
    caller = int(sys.argv[2])
    groups: set[int] = set()
    try:
        pidfd = os.pidfd_open(caller)
    except ProcessLookupError:
        pidfd = -1
    # Our parent is the caller until it dies: if it is not, the pidfd (if
    # any) may name whoever got its pid since.
    if pidfd < 0 or os.getppid() != caller:
        _drain(control, groups)
        _kill(groups)
        return
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    while True:
        ready = {fd for fd, _event in poller.poll(int(PRUNE_S * 1000) if groups else None)}
        if not ready:
            _prune(groups)
            continue
        if pidfd in ready:
            _drain(control, groups)
            _kill(groups)
            return
        if not _drain(control, groups):
            if stopped:
                return
            # EOF unasked: the caller is dying, or exec'd another program
            # (the socket is close-on-exec; its workers run on, as its
            # children), or had the socket closed under it.  The groups
            # named are still unfinished launches: kill them when its pid
            # exits, as ever.  Nothing tells us of them any more: those that
            # end are dropped as they go, and with none left we are done.
            while groups:
                if select.select([pidfd], [], [], PRUNE_S)[0]:
                    _kill(groups)
                    return
                _prune(groups)
            return


if __name__ == "__main__":
    main()
