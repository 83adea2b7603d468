"""The caller's end of a helper process: the zygote's guard or the warden.

Both are started the same way and talked to the same way: an inherited
SOCK_SEQPACKET socketpair (no name anyone could connect to), the helper's
stdin /dev/null, its own process group (a terminal's signals for the
caller's job are not for it), ``<control fd> <caller pid>`` as its last two
arguments, and a pidfd to watch and reap it by.  Only the process that
started a helper owns it: a process forked from the owner closes its copies
(see forget_in_child).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
from collections.abc import Sequence

from fastspawn._os import oscall
from fastspawn._os.launcher_thread import on_launcher_thread


class HelperClient:
    """A started helper process: ``pid``, ``pidfd`` (ours to reap),
    ``control`` (our end of the socketpair) and ``owner`` (our pid)."""

    def __init__(self, interpreter_args: Sequence[str], pdeathsig: int = 0) -> None:
        """Start ``sys.executable *interpreter_args <control fd> <our pid>``.

        With ``pdeathsig``, the helper gets it when this process dies; since
        PR_SET_PDEATHSIG follows the launching *thread*, it is then started
        from a thread that lives as long as the process.
        """
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The helper reads nothing; its stdin, /dev/null, is what the zygote's
        # function workers inherit (as multiprocessing gives its children).
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            argv = [sys.executable, *interpreter_args, str(theirs.fileno()), str(os.getpid())]
            start = functools.partial(
                oscall.launch,
                sys.executable,
                argv,
                dict(os.environ),
                stdin=null,
                keep_fds=[theirs.fileno()],
                pdeathsig=pdeathsig,
                new_process_group=True,
            )
            # Signals held: a Ctrl-C must not come between its start and our
            # record of it.
            with oscall.held_signals():
                self.pid, self.pidfd = on_launcher_thread(start) if pdeathsig else start()
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(null)
        self.control = mine
        self.owner = os.getpid()

    def owned_here(self) -> bool:
        """Whether this process started the helper (not a fork of it)."""
        return os.getpid() == self.owner

    def helper_fds(self) -> set[int]:
        """The fds this handle holds open (leak checks leave them alone)."""
        return {self.control.fileno(), self.pidfd} - {-1}

    def forget_in_child(self) -> None:
        """In a process forked from the owner: close the copies of the
        control socket and pidfd, which are not ours.  (A helper stops at
        its control socket's EOF, which a forked child holding a copy would
        delay until it exits.)"""
        self.control.close()
        try:
            os.close(self.pidfd)
        except OSError:
            pass

    def kill_and_reap(self) -> None:
        """SIGKILL the helper, wait for it and close the pidfd."""
        try:
            oscall.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.reap()

    def reap(self) -> None:
        """Wait for the helper's exit and close the pidfd."""
        try:
            oscall.pidfd_wait(self.pidfd, nohang=False)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
