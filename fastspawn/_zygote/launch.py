"""One launch inside the zygote: its report channel and what waits to be
sent on it, its stdio fds as received, the caller's state taken on before
its fn is unpickled, and how a failed launch is reported."""

from __future__ import annotations

import collections
import os
import signal
import socket
import stat
import sys
import traceback
from collections.abc import Callable, Sequence

from fastspawn._os import oscall
from fastspawn._wire import channel as _channel
from fastspawn._wire import pickling
from fastspawn._zygote import protocol


class Launch:
    """One launch inside the zygote: its channel and unsent reports."""

    def __init__(self, tx: socket.socket, nprocs: int, mp_process: bool = False) -> None:
        self.tx = tx
        self.size = nprocs
        self.live = nprocs
        # Its ranks are made ready again once they end (forked workers of a
        # caller without an RLIMIT_NPROC of its own).
        self.refills = True
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.exits: list[int] = []  # (rank, status) pairs not yet queued
        self.watching_out = False
        # The caller closed its end before everything was said: nobody is
        # left to report to, or to stop the workers (see Zygote.abandon).
        self.broken = False
        # multiprocessing processes (protocol.LaunchHeader.mp_process): they
        # outlive a caller that holds their pidfds, as multiprocessing's
        # children outlive their parent.
        self.mp_process = mp_process
        self.group = 0  # the workers' process group (set as they are forked)
        self.unsent_pids = 0  # PIDS messages queued, not yet on the channel
        self.pids_said = False  # send_pidfds ran: the workers' pidfds (or a failure) queued

    def queue(self, rank: int, kind: int, body: bytes, fds: Sequence[int] = ()) -> None:
        header = _channel.HEADER.pack(rank, kind, _channel.LAST)
        self.outbox.append((header + body, list(fds)))
        self.unsent_pids += kind == _channel.PIDS

    @property
    def kept_when_broken(self) -> bool:
        """Whether the workers stay when the caller closes the channel: they
        are multiprocessing processes and the caller had all their pidfds
        (one that gave up before, during the launch, never had them)."""
        return self.mp_process and self.unsent_pids == 0

    def flush(self) -> bool:
        """Send what the channel takes now; True when all is sent."""
        if self.exits:
            # One message for every exit seen in this round.
            for start in range(0, len(self.exits), 4096):
                body = _channel.pack_statuses(self.exits[start : start + 4096])
                self.queue(-1, _channel.EXIT, body)
            self.exits = []
        while self.outbox:
            data, fds = self.outbox[0]
            try:
                if fds:
                    socket.send_fds(self.tx, [data], fds, socket.MSG_DONTWAIT)
                else:
                    self.tx.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                # The caller closed its end (it is gone or gave up): drop it all.
                self.drop_outbox()
                self.broken = True
                return True
            self.outbox.popleft()
            self.unsent_pids -= _channel.HEADER.unpack_from(data)[1] == _channel.PIDS
            for fd in fds:
                os.close(fd)
        return True

    def drop_outbox(self) -> None:
        for _, pending in self.outbox:
            for fd in pending:
                os.close(fd)
        self.outbox.clear()
        self.exits = []

    @property
    def done(self) -> bool:
        return self.live == 0 and not self.outbox and not self.exits


def say_taken(tx: socket.socket) -> None:
    """The first message of a launch, before any rank of it can start: a
    caller whose channel ends without it knows that none did, and sends
    the launch to a new zygote (this one died as it came: its guard was
    SIGKILLed a moment before, say, and our SIGTERM had not landed yet)."""
    try:
        tx.send(_TAKEN, socket.MSG_DONTWAIT)
    except OSError:
        pass  # the caller closed its end: the launch finds out as it goes on


_TAKEN = _channel.HEADER.pack(-1, _channel.TAKEN, _channel.LAST)


def adopt_tracker(fd: int) -> None:
    """Share the caller's multiprocessing resource tracker (its pipe comes in
    with each launch) while the launch's fn and args are unpickled and its
    workers forked; release_tracker() gives it up after."""
    from multiprocessing import resource_tracker

    release_tracker()
    resource_tracker._resource_tracker._fd = os.dup(fd)  # type: ignore[attr-defined]


def release_tracker() -> None:
    """Close the zygote's copy of the caller's resource tracker pipe, once
    the workers have theirs.  The tracker runs until every copy of its pipe
    is closed: its owner stopping it waits for that (multiprocessing's own
    tests do, between start methods), and a zygote that kept a copy would
    keep that wait from ever ending."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    old, tracker._fd = getattr(tracker, "_fd", None), None  # type: ignore[attr-defined]
    if isinstance(old, int) and old >= 0:
        try:
            os.close(old)
        except OSError:
            pass


def _unless_same(fd: int, target: int) -> int:
    """``fd``, or -1 (closing it) when it writes where our ``target`` (1 or
    2) does already, as when the caller has not redirected it since the
    zygote started: its workers then skip a dup2 each (with the pages that
    copies).  The same open file description (kcmp), or, where the kernel
    will not compare, the same terminal, pipe or socket; a regular file is
    otherwise always taken, since two descriptions of it keep two offsets."""
    same = oscall.same_file(fd, target)
    if same is None:
        try:
            ours, theirs = os.fstat(target), os.fstat(fd)
        except OSError:
            return fd
        same = not stat.S_ISREG(theirs.st_mode) and (ours.st_dev, ours.st_ino) == (
            theirs.st_dev,
            theirs.st_ino,
        )
    if not same:
        return fd
    os.close(fd)
    return -1


class LaunchStdio:
    """A launch's stdio fds, as received: each rank's own (stdout, stderr;
    -1: none) and the caller's own fds 1 and 2 (0, 1 and 2 for binary
    ranks), which a rank without its own gets.  The zygote's copies are
    closed once the ranks are forked (close)."""

    def __init__(self, header: protocol.LaunchHeader, fds: Sequence[int]) -> None:
        slots = header.stdio_slots
        self.by_rank: dict[int, list[int]] = {}
        for (rank, stream), fd in zip(slots, fds[: len(slots)], strict=True):
            self.by_rank.setdefault(rank, [-1, -1])[stream - 1] = fd
        callers = fds[len(slots) :]
        self.caller_in = callers[0] if len(callers) == 3 else None
        self.caller_out, self.caller_err = (
            _unless_same(fd, target) for fd, target in zip(callers[-2:], (1, 2), strict=True)
        )

    def for_rank(self, rank: int) -> tuple[list[int] | None, list[int]]:
        """A rank's [stdout fd, stderr fd]: its own where it has one, else
        the caller's, None when it keeps ours for both; and the caller's it
        does not use, for it to close."""
        own = self.by_rank.get(rank)
        out, err = self.caller_out, self.caller_err
        pair = list(own) if own is not None else [-1, -1]
        chosen = [pair[0] if pair[0] >= 0 else out, pair[1] if pair[1] >= 0 else err]
        unused = [fd for fd in (out, err) if fd >= 0 and fd not in chosen]
        return (None if chosen == [-1, -1] else chosen), unused

    def others(self, rank: int) -> list[int]:
        """The stdio fds of every rank but ``rank``: a worker closes them, so
        that no rank (or binary it becomes) can write into another's log or
        pipe."""
        return [
            fd for other, pair in self.by_rank.items() if other != rank for fd in pair if fd >= 0
        ]

    def close(self) -> None:
        for pair in self.by_rank.values():
            for fd in pair:
                if fd >= 0:
                    os.close(fd)
        for caller_fd in (self.caller_in, self.caller_out, self.caller_err):
            if caller_fd is not None and caller_fd >= 0:
                os.close(caller_fd)


def send_pidfds(launch: Launch, pids: list[int]) -> bool:
    """Queue the workers' pidfds for the caller, MAX_FDS a message.  Opened
    only now, so no worker inherits its siblings'; none is reaped yet (that
    happens in the main loop), so each pid still names our worker.  Without
    pidfds (out of fds, say) the caller cannot have the workers: the launch
    fails and they are killed (False)."""
    launch.pids_said = True
    try:
        for start in range(0, len(pids), _channel.MAX_FDS):
            chunk = pids[start : start + _channel.MAX_FDS]
            pidfds: list[int] = []
            try:
                for pid in chunk:
                    pidfds.append(oscall.pidfd_open(pid))
            except BaseException:
                for fd in pidfds:
                    os.close(fd)
                raise
            launch.queue(start, _channel.PIDS, _channel.pack_statuses(chunk), pidfds)
    except OSError as exc:
        launch.drop_outbox()
        why = (
            f"the zygote could not open pidfds for the workers ({exc}); raise the "
            "limit on open files (ulimit -n) or start fewer ranks"
        )
        failure = _channel.LaunchFailure(exc.errno or 0, "pidfd_open in the zygote", why)
        launch.queue(-1, _channel.LAUNCH_FAILED, failure.encode())
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # unreaped: the pid is still theirs
        return False
    return True


def report_failure(launch: Launch, pids: list[int], call: str, exc: BaseException) -> None:
    """A launch failed at ``call`` (fork_ranks, start_binaries): report it
    on the launch's channel with its errno and traceback, and kill the
    ranks started so far (unreaped: their pids stay theirs until the
    zygote reaps them, counted live until then)."""
    err = exc.errno if isinstance(exc, OSError) and exc.errno else 0
    failure = _channel.LaunchFailure(err, f"{call} in the zygote", traceback.format_exc())
    launch.queue(-1, _channel.LAUNCH_FAILED, failure.encode())
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    launch.live = len(pids)


def take_on_caller(
    header: protocol.LaunchHeader, user_fds: Sequence[int], settle: Callable[[], None]
) -> bool:
    """Before a launch's fn and args are unpickled (by the zygote, or by a
    ready worker, fastspawn._zygote.wake): the caller's environment, cwd
    and sys.path as of the launch, its ``preload=`` imported, ``settle``
    called, the arguments' fds and the caller's resource tracker in place.
    What is equal already is not rewritten: a ready worker would copy the
    pages that writes.  Whether any of the three changed."""
    changed = False
    if not environ_is(header.env):
        changed = True
        os.environ.clear()
        os.environb.update(header.env)  # the same environment, in bytes
    try:
        here: str | None = os.getcwd()
    except OSError:
        here = None  # ours was deleted since
    if here != header.cwd:
        changed = True
    os.chdir(header.cwd)  # even if equal: the directory may be another by that name now
    if sys.path != header.sys_path:
        changed = True
        sys.path[:] = header.sys_path
    import_all(header.preload, strict=True)
    settle()
    pickling.inherited_fds[:] = user_fds
    if header.tracker_index is not None:
        adopt_tracker(user_fds[header.tracker_index])
    return changed


def holds_caller_state(header: protocol.LaunchHeader) -> bool:
    """Whether this process has the caller's environment, cwd and sys.path
    as the launch has them: take_on_caller would change none of them."""
    try:
        here: str | None = os.getcwd()
    except OSError:
        here = None
    return here == header.cwd and sys.path == header.sys_path and environ_is(header.env)


def environ_is(env: dict[bytes, bytes]) -> bool:
    """Whether os.environ is ``env`` (protocol.environ_bytes's form),
    compared as the bytes os.environ keeps (its ``_data``)."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return data == env
    return protocol.environ_bytes(os.environ) == env  # not CPython's os._Environ


class PreloadError(ImportError):
    """A module named in a launch's ``preload=`` could not be imported."""


def import_all(modules: Sequence[str], strict: bool = False) -> None:
    """Import ``modules``.  ``strict`` (a launch's ``preload=``): the first
    failure raises PreloadError naming the module; else (FASTSPAWN_PRELOAD,
    fastspawn.preload()) it is printed and the zygote goes on without it."""
    for name in modules:
        try:
            __import__(name)
        except Exception as exc:
            if strict:
                raise PreloadError(
                    f"fastspawn: preload={list(modules)!r}: the zygote could not import "
                    f"{name!r} before starting the workers ({type(exc).__name__}: {exc})"
                ) from exc
            print(
                f"fastspawn: could not preload {name!r} (FASTSPAWN_PRELOAD or "
                "fastspawn.preload()); workers will import it themselves if they need it:",
                file=sys.stderr,
            )
            traceback.print_exc()
