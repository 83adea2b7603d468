"""A launch as every start method sees it: what to start (LaunchRequest),
the surface each method offers (StartMethod; see registry for the names),
starting a request through its method, and undoing a launch that failed."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastspawn._os import oscall
from fastspawn._wire.channel import Receiver


class LaunchRequest:
    """What to start.  (A plain class, not a dataclass: a main module that
    imports fastspawn's launcher is imported by the zygote too, and
    dataclasses brings inspect, ast and dis, 11 ms, into it and every
    worker.)"""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        nprocs: int,
        daemon: bool,
        method: StartMethod,
        envs: Mapping[int, Mapping[str, str]] | None = None,
        preload: Sequence[str] = (),
        stdio: Mapping[int, tuple[int, int]] | None = None,
        process_group: bool = True,
        keep_stdin: bool = False,
        binary: tuple[str, Mapping[int, Sequence[str]]] | None = None,
        stacks: bool = True,
        caller_group: bool = False,
        mp_process: bool = False,
        outlive_caller: bool = False,
    ) -> None:
        self.fn = fn
        self.args = args
        self.nprocs = nprocs
        self.daemon = daemon
        self.method = method
        self.envs: Mapping[int, Mapping[str, str]] = envs if envs is not None else {}
        self.preload = preload
        # rank -> (stdout fd, stderr fd) the worker gets as its fd 1 and 2
        # (-1: the caller's).  The caller keeps ownership of these fds.
        self.stdio: Mapping[int, tuple[int, int]] = stdio if stdio is not None else {}
        # Workers read /dev/null, as multiprocessing's do; with keep_stdin
        # (binary ranks) the caller's stdin instead.
        self.keep_stdin = keep_stdin
        # (path, {rank: argv}) when every rank is that binary, exec'd: a
        # method that can start it without a Python worker first (the
        # zygote, with the C launcher) does; the others run fn, which execs.
        self.binary = binary
        # Python workers arm the stack dump (fastspawn._worker.stacks): the
        # caller can then show where each rank was (see fastspawn._launch.stacks).
        self.stacks = stacks
        # zygote: put the launch's workers in a process group of their own
        # (binary ranks lead a session each instead).
        self.process_group = process_group
        # zygote, without process_group: the workers join the caller's
        # process group (a terminal's Ctrl-C then reaches them, as it
        # reaches multiprocessing's).
        self.caller_group = caller_group
        # zygote: the ranks are multiprocessing processes, which start their
        # own through the same zygote and outlive the process that started
        # them (see fastspawn._zygote.protocol.LaunchHeader.mp_process).
        self.mp_process = mp_process
        # fork, spawn: the workers are not bound to the caller (no
        # PR_SET_PDEATHSIG against it, no process group of their own): they
        # stay in its group, which the warden of the program's first process
        # watches, and die with that process, not with this one (a
        # multiprocessing process's children outlive it: see fastspawn._mp).
        self.outlive_caller = outlive_caller
        # The payload memfd with (fn, args) pickled, and the fds they carry:
        # made by start_processes, which pickles them once, as its check
        # (common.pickle_work), or by the method; closed by
        # common.discard_work once sent.
        self.work: tuple[int, list[int]] | None = None
        # The process group of the workers (0: none), and while the ranks
        # join it in a fork or spawn launch, its anchor (see
        # common.new_group).
        self.group = 0
        self.anchor = 0
        # The process groups to kill should the caller (warden) or the
        # zygote die: the launch's group, or each binary rank's session.
        self.watched_groups: list[int] = []

    def __repr__(self) -> str:
        return (
            f"LaunchRequest(fn={self.fn!r}, nprocs={self.nprocs}, "
            f"start_method={self.method.name!r}, group={self.group})"
        )


# (pid, pidfd) per rank started, in rank order.
Started = list[tuple[int, int]]


def launch(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    """Start every rank of ``req``, each entered in ``started`` as it starts
    (the caller's list: whatever interrupts us, the caller knows what to
    clean up); on failure nothing is left running, and ``started`` is empty."""
    oscall.require_pidfds()
    req.method.check(req)
    req.method.launch(req, tx, rx, started)


def kill_started(started: Started, reap: bool) -> None:
    """Undo a launch that failed half-way: kill what did start, and reap it
    when ``reap`` (the workers are our children).

    Signals are held throughout: a Ctrl-C pressed again and again while a
    launch it cut short is undone must not leave workers running.  (The
    waits are for processes just SIGKILLed.)  Each worker leaves ``started``
    as its pidfd closes, so a call after one cut short never signals or
    closes a pidfd twice (a number closed here may be another file's by
    then)."""
    with oscall.held_signals():
        while started:
            _pid, pidfd = started[-1]
            if pidfd >= 0:  # else its pidfd never arrived: the zygote kills it
                try:
                    oscall.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    if reap:
                        oscall.pidfd_wait(pidfd, nohang=False)
                except ChildProcessError:
                    pass
                finally:
                    os.close(pidfd)
            started.pop()


def release_anchor(req: LaunchRequest) -> None:
    """Reap ``req``'s process-group anchor (see common.new_group), if not
    done yet: inside the held signals of the last rank's start, in the
    launch's ``finally`` when it failed, or, should a Ctrl-C have cut that
    short, in the caller's cleanup."""
    with oscall.held_signals():  # taken from req and reaped as one step
        anchor, req.anchor = req.anchor, 0
        if anchor:
            oscall.release_group_anchor(anchor)


class StartMethod:
    """How the workers of one launch come to life.

    A method is a module-level instance of a subclass, registered by name
    (``registry.register``).  Its class attributes answer what the rest of
    fastspawn asks of a method:

    Attributes:
        name: what ``start_method=`` says.
        pickles_arguments: fn and args travel pickled, so they are checked
            for picklability before anything starts.
        supports_preload: ``preload=`` applies (modules imported once by a
            long-lived process the workers are forked from).
        caller_reaps: the workers are the caller's own children, reaped
            with waitid on their pidfds; else another process's (the
            zygote's), whose exit statuses come on the launch's channel.
        spawn_accepts: ``fastspawn.spawn()`` takes it as it is; any other
            method gets torch's FutureWarning and the default method.
    """

    name = ""
    pickles_arguments = True
    supports_preload = False
    caller_reaps = True
    spawn_accepts = False

    def __repr__(self) -> str:
        return f"<fastspawn start method {self.name!r}>"

    def check(self, request: LaunchRequest) -> None:
        """Refuse, with an error that says what to do, a request this
        method cannot start here; called before anything starts."""

    def launch(
        self, request: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started
    ) -> None:
        """Start every rank of ``request``, each appended to ``started`` as
        ``(pid, pidfd)`` as it starts, reporting on ``tx`` (the caller's
        copy of it is closed by the caller); on failure nothing is left
        running, ``started`` is empty, and the error is raised.  Sets
        ``request.group`` and ``request.watched_groups`` where the workers
        get a process group."""
        raise NotImplementedError

    def helper_pids(self) -> set[int]:
        """The long-lived processes this method keeps for the caller (the
        zygote and its guard), if any runs."""
        return set()
