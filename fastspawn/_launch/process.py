"""Process handles: what ``ProcessContext.processes`` holds, one per rank."""

from __future__ import annotations

import errno
import logging
import math
import numbers
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

from fastspawn._os import oscall
from fastspawn._os.oscall import wait_readable
from fastspawn._wire.channel import Receiver

log = logging.getLogger(__name__)

# Held while a worker's pidfd is closed, and while another thread copies
# pidfds to signal (ProcessContext.dump_stacks): a number closed under it
# and reused by a new pidfd would send the signal to another process.
pidfd_lock = threading.Lock()


def checked_seconds(value: object, name: str, none_allowed: bool = True) -> float | None:
    """A timeout argument (``timeout``, ``grace_period``), checked where it
    is given, before anything changes: None (where ``none_allowed``) stays
    None, any real number becomes a float; ``inf`` means no limit, and every
    wait takes it (and any huge value) as such.

    Raises:
        TypeError: not a number (a string, say), or None where not allowed.
        ValueError: nan, which is neither a limit nor none.
    """
    if value is None and none_allowed:
        return None
    if not isinstance(value, numbers.Real):
        none = " or None" if none_allowed else ""
        raise TypeError(
            f"{name} must be a number of seconds{none}, got {type(value).__name__} {value!r:.40}"
        )
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{name} must be a number of seconds (inf for no limit), got nan")
    return seconds


def running_among(procs: Iterable[Process]) -> list[Process]:
    """The workers among ``procs`` that still run, without waiting for (or
    collecting) exit statuses: what stopping hundreds of workers needs.  One
    poll(2) over their pidfds; a poll per worker took 1-4 ms for 255, on the
    path from a failure to the signal."""
    candidates = [proc for proc in procs if proc._exitcode is None and proc._pidfd >= 0]
    gone = set(wait_readable([proc._pidfd for proc in candidates], 0))
    return [proc for proc in candidates if proc._pidfd not in gone]


class Process:
    """One worker, driven through its pidfd.

    Offers what callers use on ``multiprocessing.Process``: ``pid``,
    ``exitcode``, ``is_alive()``, ``join(timeout)``, ``terminate()``,
    ``kill()``, ``sentinel`` (readable once the worker exited).

    A worker is either our child (its exit status comes from waitid on the
    pidfd) or the fork server's (the server reports it on the launch's
    channel).  Either way the channel is drained while waiting, so a worker
    blocked sending a large result is never left waiting on us.
    """

    def __init__(self, rank: int, pid: int, pidfd: int, receiver: Receiver, is_child: bool) -> None:
        self.rank = rank
        self.pid = pid
        self._pidfd = pidfd
        self._receiver = receiver
        self._is_child = is_child
        self._exitcode: int | None = None
        self._exited_at: float | None = None  # first seen exited, no status yet
        self.name = f"fastspawn-worker-{rank}"
        # A weak reference to what is called just before the pidfd is closed
        # (the context unregisters it).
        self.on_close: Callable[[], Callable[[Process], None] | None] | None = None

    def __repr__(self) -> str:
        if self._exitcode is None:
            state = "alive" if self.is_alive() else "exited"
        else:
            state = f"exitcode={self._exitcode}"
        return f"<fastspawn.ProcessHandle rank={self.rank} pid={self.pid} {state}>"

    @property
    def sentinel(self) -> int:
        """A file descriptor that polls readable once the worker has exited."""
        if self._pidfd < 0:
            raise ValueError(f"process {self.pid} was reaped and its pidfd closed")
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        """The exit code, minus the signal number, or None while running."""
        if self._exitcode is None:
            self._poll()
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _exited(self) -> bool:
        """Whether the pidfd polls readable (the worker is gone, maybe unreaped)."""
        return bool(wait_readable([self._pidfd], 0))

    def _poll(self, deadline: float | None = None, drained: bool = False) -> None:
        """Collect the exit status if the worker has exited.  Waits for the
        zygote's word of it until ``deadline`` (time.monotonic()) at most.
        ``drained``: the report channel was just read (by the caller's
        ProcessContext, for every worker it found exited)."""
        if self._exitcode is not None or self._pidfd < 0:
            return
        reports = self._receiver.reports
        # A zygote worker whose exit status is in: all it sent came before
        # (the zygote reaped it after its exit), no read is needed.
        if not drained and (self._is_child or self.rank not in reports.exits):
            self._receiver.drain()
        if self._is_child:
            # Reaped and recorded as one step: a Ctrl-C between the two
            # would lose the status, and every later wait would find no
            # child (ChildProcessError).
            with oscall.held_signals():
                status = oscall.pidfd_wait(self._pidfd, nohang=True)
                if status is not None:
                    self._set_exit(status)
            return
        if self.rank not in reports.exits and self._exited():
            # The zygote reaps at once and reports; wait for that word, or for
            # the channel's end if the zygote itself died (its workers then
            # die too, closing the channel).  The deadline only guards
            # against a wedged zygote.
            if self._exited_at is None:
                self._exited_at = time.monotonic()
            give_up = self._exited_at + 60.0  # across calls with short deadlines too
            until = give_up if deadline is None else min(deadline, give_up)
            while self.rank not in reports.exits and not reports.eof:
                left = until - time.monotonic()
                if left <= 0 or not self._receiver.read_blocking(left):
                    break
                self._receiver.drain()
            if self.rank not in reports.exits and until < give_up and not reports.eof:
                return  # the caller's time ran out first: still unknown
            if self.rank not in reports.exits:
                log.warning(
                    "no exit status came for worker %d (pid %d): the fastspawn zygote "
                    "was stopped (fastspawn.stop_zygote()), died or hangs; counting the "
                    "worker as killed by SIGKILL",
                    self.rank,
                    self.pid,
                )
                reports.exits[self.rank] = -signal.SIGKILL
        if self.rank in reports.exits:
            with oscall.held_signals():
                self._set_exit(reports.exits[self.rank])

    def _set_exit(self, status: int) -> None:
        """Record the exit status and release the pidfd (signals held by
        the caller)."""
        self._exitcode = status
        self.close()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the worker to exit, and reap it.

        Args:
            timeout: seconds; None or ``inf``: until it exits.

        Raises:
            TypeError, ValueError: ``timeout`` is not a number, or nan.
        """
        seconds = checked_seconds(timeout, "timeout")
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            self._poll(deadline)
            if self._exitcode is not None:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            fds = [self._pidfd]
            if not self._receiver.reports.eof:
                fds.append(self._receiver.fileno())
            wait_readable(fds, left)

    def _signal(self, sig: int) -> None:
        if self._exitcode is not None or self._pidfd < 0:
            return
        try:
            oscall.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            pass  # exited already: nothing to do

    def interrupt(self) -> None:
        """Send SIGINT, a Ctrl-C's signal (never to a process that reused
        the pid), as Python 3.14's multiprocessing ``Process.interrupt()``
        does: a rank it ends is reported as terminated by SIGINT."""
        self._signal(signal.SIGINT)

    def terminate(self) -> None:
        """Send SIGTERM (never to a process that reused the pid)."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL (never to a process that reused the pid)."""
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        """Release the pidfd.  Reaps first when the worker is our child."""
        if self._pidfd < 0:
            return
        if self._is_child and self._exitcode is None:
            raise ValueError(f"cannot close process {self.pid}: it has not been reaped")
        # Forgotten by the context, and the number given up before the fd
        # closes, in one step: cut short, a later close() must not close
        # the file that took the number meanwhile.
        with oscall.held_signals(), pidfd_lock:
            forget = self.on_close() if self.on_close is not None else None
            if forget is not None:
                forget(self)
            pidfd, self._pidfd = self._pidfd, -1
            if pidfd < 0:
                return  # another thread closed it meanwhile
            try:
                os.close(pidfd)
            except OSError as exc:  # pragma: no cover - EBADF would be our bug
                if exc.errno != errno.EBADF:
                    raise


# Its public name (fastspawn.ProcessHandle): fastspawn.Process is
# multiprocessing's Process, started by fastspawn (fastspawn._mp).
ProcessHandle = Process
