"""A multiprocessing process's way to the zygote that forked it, its link
(see fastspawn._zygote.server.Zygote.fork_links), and what sends on a
zygote's control socket, for the caller's client and for a link alike.

The zygote hands each multiprocessing process one end of a socketpair as it
forks it (use()); the process's first launch takes it (take(), from
fastspawn._zygote.client.get_server()), so the processes it starts come
from the same zygote, not from one of its own.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

from fastspawn._os import procstate
from fastspawn._wire import channel as _channel
from fastspawn._zygote import protocol

_INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


class Sender:
    """Sending on a zygote's control socket (``control``; ``lock`` keeps a
    launch and the messages that follow it together; ``closed`` once
    closed here)."""

    control: socket.socket
    lock: threading.Lock
    closed: bool

    def send(
        self, message: protocol.ControlMessage, fds: Sequence[int] = (), locked: bool = False
    ) -> None:
        """Send one control message (``locked``: the caller holds ``lock``,
        to keep a launch and the messages that follow it together)."""
        data = message.encode()
        if locked:
            socket.send_fds(self.control, [data], list(fds))
            return
        with self.lock:
            socket.send_fds(self.control, [data], list(fds))

    def send_launch(self, tx: int, payload: int, carried: Sequence[int]) -> None:
        """Send one launch, whatever its number of ranks: its channel's and
        payload's fds and as many ``carried`` fds as fit in the LAUNCH
        message; the rest follow in FDS messages of their own (the kernel
        passes 253 fds a message; a model shared for Hogwild training
        carries one per tensor).  BrokenPipeError if the zygote was stopped
        or died."""
        with self.lock:
            if self.closed:  # fastspawn.stop_zygote() in another thread
                raise BrokenPipeError("the zygote was stopped")
            first = _channel.MAX_FDS - 2
            launch = protocol.ControlMessage(protocol.LAUNCH)
            self.send(launch, [tx, payload, *carried[:first]], locked=True)
            if len(carried) <= first:
                return
            # Once the launch message is out, the rest must follow: a Ctrl-C
            # in between would leave the zygote waiting for fds and reading
            # the next launch as those.  Signals wait (pending) until they
            # are sent.
            masked = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
            try:
                for start in range(first, len(carried), _channel.MAX_FDS):
                    chunk = carried[start : start + _channel.MAX_FDS]
                    self.send(protocol.ControlMessage(protocol.FDS), chunk, locked=True)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, masked)


class RootLink(Sender):
    """In a multiprocessing process the zygote started (a fastspawn
    context's Process, Pool or DataLoader worker): the way to that zygote,
    its link (fastspawn._zygote.server.Zygote.fork_links), through which
    the processes this one starts come from the same zygote.  So they
    outlive this process, as multiprocessing's children outlive their
    parent, and die with the zygote, so with the caller.  Nothing to start
    or watch: this process is the zygote's worker and dies with it."""

    def __init__(self, control: socket.socket, zygote: int, state: dict[str, Any]) -> None:
        self.control = control
        self.lock = threading.Lock()
        self.closed = False
        self.zygote = zygote
        self.owner = os.getpid()
        self.process_state = state  # the zygote's, which its workers start from

    def zygote_pid(self, timeout: float = 10.0) -> int | None:
        return self.zygote

    def owned_here(self) -> bool:
        return os.getpid() == self.owner

    def alive(self) -> bool:
        return self.owned_here() and not self.closed

    def helper_fds(self) -> set[int]:
        return {self.control.fileno()} - {-1}

    def process_state_now(self) -> dict[str, Any]:
        return procstate.changed(self.process_state, procstate.capture())

    def wait_until_dead(self) -> None:
        """A send failed: the zygote is gone, and this process with it."""
        self.close()

    def watch_groups(self, groups: Sequence[int]) -> None:
        pass  # the workers die with the zygote (PR_SET_PDEATHSIG), as we do

    def forget_groups(self, groups: Sequence[int]) -> None:
        pass

    def forget_in_child(self) -> None:
        self.control.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.control.close()


_link: RootLink | None = None  # given by the zygote, not yet taken


def use(control: socket.socket, zygote: int, state: dict[str, Any]) -> None:
    """In a multiprocessing process the zygote just forked: its launches are
    to go through ``control`` to that zygote, whose pid is ``zygote`` and
    umask, affinity, nice value and limits ``state``."""
    global _link
    _link = RootLink(control, zygote, state)


def take() -> RootLink | None:
    """The link use() gave, once: the caller's client holds it from then."""
    global _link
    given, _link = _link, None
    return given


def _forget_after_fork() -> None:
    """A process forked from one with a link (a fork launch's worker, say)
    has none: the link is its parent's."""
    global _link
    if _link is not None:
        _link.forget_in_child()
    _link = None


os.register_at_fork(after_in_child=_forget_after_fork)
