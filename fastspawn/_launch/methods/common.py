"""What more than one start method needs.

fork and spawn start the caller's own children (ChildrenOfCaller): they need
SIGCHLD not ignored, and put each launch's workers in a process group of its
own that the warden kills should the caller die.  spawn and the zygote send
fn and args as a private memfd, and start workers in the caller's current
directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from fastspawn._launch.methods.base import (
    LaunchRequest,
    Started,
    StartMethod,
    kill_started,
    release_anchor,
)
from fastspawn._launch.methods.helpers import forget_groups
from fastspawn._os import oscall
from fastspawn._warden import client
from fastspawn._wire import payload, pickling


class ChildrenOfCaller(StartMethod):
    """A method whose workers are the caller's own children."""

    caller_reaps = True

    def check(self, request: LaunchRequest) -> None:
        if children_discarded():
            raise RuntimeError(
                f"fastspawn: start_method={self.name!r} needs the workers' exit "
                "statuses, and this process ignores SIGCHLD (SIG_IGN), so the kernel "
                "discards them; restore the default first (signal.signal(signal.SIGCHLD, "
                "signal.SIG_DFL)), or use start_method='zygote', whose workers are the "
                "zygote's children"
            )


def children_discarded() -> bool:
    """Whether SIGCHLD is ignored here (children reaped by the kernel, their
    statuses lost), as the kernel says: signal.getsignal() misses a
    disposition set from C."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGCHLD - 1) & 1)
    except OSError:
        pass
    return signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN


def foreground_on_a_terminal() -> bool:
    """Whether this process's group is the foreground job of its
    controlling terminal."""
    with oscall.held_signals():  # opened and closed, whatever comes
        try:
            fd = os.open("/dev/tty", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            return False  # no controlling terminal
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            return False
        finally:
            os.close(fd)


def new_group(req: LaunchRequest) -> int:
    """A process group for a fork or spawn launch, named to the warden, or
    0 for none.  Its anchor, in ``req.anchor``, is for the caller's
    ``finally`` to release (release_anchor) once the ranks have joined:
    call this inside the ``try``, so that an interrupt delivered as it
    returns is cleaned up too.

    None when the caller is the foreground job of a terminal: a group of
    their own would be a background job there, stopped (SIGTTOU) by a write
    under ``stty tostop`` or by any change of the terminal's modes (getpass),
    where multiprocessing's workers, in the caller's group, are not.  There
    the workers stay in the caller's group, and a Ctrl-C reaches them too.
    A background job's get a group (and a warden, against an OOM kill of a
    `nohup ... &` run): there a worker stopped by SIGTTOU stays stopped when
    `fg` continues the job (docs/differences.md)."""
    if req.outlive_caller or foreground_on_a_terminal():
        return 0
    with oscall.held_signals():  # an anchor no one knows of stays a zombie
        group = req.anchor = req.group = oscall.group_anchor()
        req.watched_groups = [group]
        client.watch_group(group)
    return group


@contextlib.contextmanager
def launch_group(req: LaunchRequest, started: Started) -> Iterator[int]:
    """Around the loop that starts a fork or spawn launch's ranks: gives the
    launch's process group (new_group); if the loop raises, kills what
    started and drops the group (end_group); releases the anchor in any
    case (the loop releases it itself as the last rank starts)."""
    try:
        yield new_group(req)
    except BaseException:
        end_group(req, started)
        raise
    finally:
        release_anchor(req)


def end_group(req: LaunchRequest, started: Started) -> None:
    """A launch failed half-way: kill and reap what started (``started`` is
    emptied: its pidfds are closed), drop its group."""
    with oscall.held_signals():  # see kill_started
        try:
            kill_started(started, reap=req.method.caller_reaps)
        finally:
            forget_groups(req.watched_groups)
            req.group = 0
            req.watched_groups = []


def tracker_fd() -> int | None:
    """The resource tracker's fd if one is running (children then share it)."""
    resource_tracker = oscall.import_held("multiprocessing.resource_tracker")
    fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    return fd if isinstance(fd, int) else None


def pickle_work(req: LaunchRequest) -> tuple[int, list[int]]:
    """Pickle ``(fn, args)`` into a new payload memfd: ``req.work`` (see
    fastspawn._wire.payload), which holds it from its making on, for
    discard_work to close on every way out; returned too.  On failure
    nothing is kept and the error is raised as pickling raised it."""
    with oscall.held_signals():  # made and recorded
        fd = payload.new_memfd()
        req.work = (fd, [])
    collector = pickling.FdCollector()
    try:
        payload.write_work(fd, [(req.fn, req.args)], collector)
    except BaseException:
        discard_work(req)
        raise
    req.work = (fd, collector.fds)
    return req.work


def discard_work(req: LaunchRequest) -> None:
    """Close the request's payload memfd, if it has one (the workers, the
    zygote, hold their own)."""
    if req.work is None:
        return  # every launch's way out: no signal block for nothing to close
    with oscall.held_signals():  # closed and forgotten
        if req.work is not None:
            os.close(req.work[0])
            req.work = None


def current_dir() -> str:
    """os.getcwd(), or an error that says what to do when it is gone."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            2,
            "the current directory was deleted; workers start in the caller's current "
            "directory, so os.chdir() to one that exists before starting them",
        ) from None
