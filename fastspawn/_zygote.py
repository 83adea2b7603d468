"""The zygote: a fresh interpreter that forks workers on request.

The caller starts it once (a clean exec, so it inherits none of the caller's
threads, locks or CUDA state; it prepares like a spawn child: the caller's
sys.path and cwd, ``__main__`` imported as ``__mp_main__``, plus preloaded
modules) and sends it one message per launch, whatever the number of ranks:
the payload (fn and args, pickled once) travels as a memfd, the launch's
report channel and any fds the arguments carry as SCM_RIGHTS.  The zygote
unpickles once and forks every rank from that state.  Start methods "zygote"
and "forkserver" are both served by it.

Orphan safety, as a chain with no gaps:
- the zygote watches the caller *process* with a pidfd (and its control
  socket's EOF); PR_SET_PDEATHSIG(SIGTERM), armed before exec (on the guard,
  below, which passes it on), backs that up.  When the caller is gone it
  kills every worker and every descendant, then exits;
- each worker has PR_SET_PDEATHSIG(SIGKILL) against the single-threaded
  zygote, re-checked after prctl;
- the zygote is a child subreaper: a worker's orphaned children are
  reparented to it, and it kills them;
- the process the caller starts forks the zygote proper and stays behind as
  its guard (a subreaper too): if the zygote is SIGKILLed, the guard adopts
  what the dying workers leave, daemons included, and kills it; if the guard
  is, the zygote's PR_SET_PDEATHSIG(SIGTERM) shuts it down in order;
- the workers of a launch share a process group of their own (its leader,
  an anchor process, exits at once: no rank leads it, so each may still
  call setsid()), and so do their children: the caller stops a launch with
  one killpg, and once the zygote is gone, the caller kills every live
  launch's group (and the zygote's own, whose id cannot be recycled while
  the guard is its unreaped child).

The control channel is an inherited socketpair: there is no name to connect
to.  Exit statuses go back on each launch's channel, sent without blocking
(the caller may not be reading) and queued until the caller drains it.
"""

from __future__ import annotations

import collections
import gc
import io
import os
import pickle
import select
import signal
import socket
import stat
import sys
import time
import traceback
from collections.abc import Sequence

from fastspawn import _channel, _hugepages, _oscall, _pickling, _procstate, _worker
from fastspawn import _zygote_protocol as protocol
from fastspawn._children import children_of, kill_children
from fastspawn._core import lib

# Every import here is one the zygote (and each worker, its copy) carries:
# typing only for annotations.  traceback stays: a failing worker formats its
# traceback at once (0.2 ms) instead of importing it first (3.5-4.8 ms more,
# on the path from a failure to the caller's exception).  So does ast, which
# traceback imports (Python 3.11+) to mark the failing expression in each
# frame: 1.3-1.8 ms here, once, against 4.5-5.2 ms in every failing worker.
if sys.version_info >= (3, 11):
    import ast  # noqa: F401
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


# From this many ranks on, a launch first collapses what the zygote has not
# collapsed yet (see _Zygote.collapse_now).
_COLLAPSE_BEFORE_FORKING = 128


# ---------------------------------------------------------------- zygote side


class _Launch:
    """One launch inside the zygote: its channel and unsent reports."""

    def __init__(self, tx: socket.socket, nprocs: int) -> None:
        self.tx = tx
        self.live = nprocs
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.exits: list[int] = []  # (rank, status) pairs not yet queued
        self.watching_out = False
        # The caller closed its end before everything was said: nobody is
        # left to report to, or to stop the workers (see _Zygote.abandon).
        self.broken = False

    def queue(self, rank: int, kind: int, body: bytes, fds: Sequence[int] = ()) -> None:
        header = _channel.HEADER.pack(rank, kind, _channel.LAST)
        self.outbox.append((header + body, list(fds)))

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


def _adopt_tracker(fd: int) -> None:
    """Share the caller's multiprocessing resource tracker (its pipe comes in
    with each launch), closing our copy of the previous launch's."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    old = getattr(tracker, "_fd", None)
    tracker._fd = os.dup(fd)  # type: ignore[attr-defined]
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
    same = _oscall.same_file(fd, target)
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


class _LaunchStdio:
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


def _send_pidfds(launch: _Launch, pids: list[int]) -> None:
    """Queue the workers' pidfds for the caller, MAX_FDS a message.  Opened
    only now, so no worker inherits its siblings'; none is reaped yet (that
    happens in the main loop), so each pid still names our worker.  Without
    pidfds (out of fds, say) the caller cannot have the workers: the launch
    fails and they are killed."""
    try:
        for start in range(0, len(pids), _channel.MAX_FDS):
            chunk = pids[start : start + _channel.MAX_FDS]
            pidfds: list[int] = []
            try:
                for pid in chunk:
                    pidfds.append(_oscall.pidfd_open(pid))
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


class _Zygote:
    def __init__(self, control: socket.socket, parent: int, parent_fd: int) -> None:
        self.control = control
        self.me = os.getpid()
        self.parent_fd = parent_fd
        # multiprocessing.parent_process() is the caller, here and so in
        # every worker (made once: each worker making its own would copy
        # the pages that takes); its sentinel is our pidfd of the caller,
        # which workers keep.
        from multiprocessing import process

        process._parent_process = process._ParentProcess(  # type: ignore[attr-defined]
            "MainProcess", parent, self.parent_fd
        )
        _oscall.set_child_subreaper()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, _on_sigchld)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        # Handlers that user code run here (the main module's import,
        # preloads, unpickling) set for the signals the zygote lives by:
        # the workers get them, as a spawn child would (see reclaim_signals).
        self.user_handlers: dict[int, Any] = {}
        self.epoll = select.epoll()
        for fd in (control.fileno(), self.parent_fd, self.wake_r):
            self.epoll.register(fd, select.EPOLLIN)
        self.workers: dict[int, tuple[_Launch, int]] = {}  # pid -> (launch, rank)
        self.channels: dict[int, _Launch] = {}  # tx fd -> launch
        # Channel fds closed while handling the current batch of events: a
        # later event of the batch for that number is stale, even if a new
        # launch got the number since (its hang-up must not end the new one).
        self.closed_in_batch: set[int] = set()
        self.settled_modules = 0  # len(sys.modules) at the last settle()
        # How preparing like a spawn child (importing the caller's main
        # module) failed, if it did: ("exit", code) or ("error", traceback).
        # Every launch's workers then fail as spawned ones would.
        self.prepare_failure: tuple[str, Any] | None = None
        self.to_collapse: list[int] = []  # stretches for collapse_when_idle
        self.reseed_numpy = False  # the launch forking now: numpy.random is loaded

    def reclaim_signals(self) -> None:
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

    def settle(self) -> None:
        """Prepare the memory that workers share, once imports changed it.

        gc.freeze() moves every object to the permanent generation, as the
        gc docs advise before fork(): collections (here and in workers) then
        skip them instead of writing to every page that holds one, which
        would copy the page.  The heap and arenas are queued for collapsing
        into huge pages (see collapse_when_idle).
        """
        if len(sys.modules) == self.settled_modules:
            return
        gc.freeze()
        self.settled_modules = len(sys.modules)
        if _hugepages.wanted():
            self.to_collapse = _hugepages.collapsible_ranges()

    def collapse_when_idle(self) -> None:
        """Collapse one queued stretch into a huge page (serve() calls this
        when nothing else is to be done and no worker runs).

        Forking a torch-sized zygote and tearing its workers down then costs
        one page-table entry per 2 MiB instead of one per 4 KiB (with torch
        loaded: fork 3.6x, teardown 3.3x cheaper, benchmarks/README.md).  Each
        stretch is copied (a few ms), so it happens only while the zygote is
        idle, one stretch at a time between polls, and only while no worker
        runs: a worker still sharing the old pages would keep them alive
        beside the new ones.
        """
        # Failures are mostly quick (a stretch nothing was written to yet):
        # go on to the next one, for up to 5 ms.
        deadline = time.monotonic() + 0.005
        while self.to_collapse and not _hugepages.collapse(self.to_collapse.pop()):
            if time.monotonic() > deadline:
                break

    def collapse_now(self) -> None:
        """Collapse what is still queued, before a large launch forks.

        Each fork copies one page-table entry per 4 KiB page left, and each
        worker's exit clears them, so with enough ranks collapsing first
        pays for itself.  With torch preloaded and no idle time before the
        launch, until all ranks run: 64 ranks about even (385-409 ms against
        336-410), 128 ranks 424-489 ms against 724-746, 256 ranks 1145-1243
        ms against 1578-1865 (benchmarks/collapse_first.py has the rest).
        """
        while self.to_collapse:
            _hugepages.collapse(self.to_collapse.pop())

    def own_fds(self) -> list[int]:
        # Not parent_fd: the workers keep it (multiprocessing's
        # parent_process() sentinel); it is close-on-exec.
        fixed = [
            self.control.fileno(),
            self.epoll.fileno(),
            self.wake_r,
            self.wake_w,
        ]
        return fixed + list(self.channels)

    def serve(self) -> None:
        collapsing = False
        while True:
            # Idle time (nothing for 10 ms) goes to collapsing memory, one
            # stretch at a time with a look at the fds in between, until
            # something happens.
            idle_work = bool(self.to_collapse) and not self.workers
            timeout = (0 if collapsing else 0.01) if idle_work else -1
            events = self.epoll.poll(timeout)
            collapsing = not events and idle_work
            if collapsing:
                self.collapse_when_idle()
                continue
            self.closed_in_batch.clear()
            for fd, mask in events:
                if fd in self.closed_in_batch:
                    continue
                if fd == self.control.fileno():
                    if not self.on_control():
                        return
                elif fd == self.parent_fd:
                    return
                elif fd == self.wake_r:
                    self.on_sigchld()
                elif fd in self.channels:
                    launch = self.channels[fd]
                    if mask & (select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP):
                        launch.broken = True
                    self.on_writable(launch)

    def on_control(self) -> bool:
        try:
            data, fds, _flags = _channel.recv_fds(self.control, protocol.MAX_MESSAGE, 256)
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        message = protocol.ControlMessage.decode(data)
        if message.op == protocol.PRELOAD:
            _import_all(message.modules)
            self.reclaim_signals()
            self.settle()
        else:
            self.launch(fds)
        return True

    def launch(self, fds: list[int]) -> None:
        """One launch: ``fds`` are its report channel, its payload memfd
        (the launch's header, then fn and args), then the fds the arguments
        carry and the ranks' stdio fds, those that did not fit following in
        messages of their own."""
        tx = socket.socket(fileno=fds[0])
        # The header (environment, sys.path, per-rank envs) travels in the
        # memfd, not in the control message, whose size is capped (~200 KB).
        payload = _worker.read_payload(fds[1])
        header = protocol.LaunchHeader.decode(payload)  # plain data: no import, no fd
        carried = fds[2:]
        carried += self.receive_fds(header.fd_count() - len(carried))
        user_fds = carried[: header.user_fds]
        stdio = _LaunchStdio(header, carried[header.user_fds :])
        launch = _Launch(tx, header.nprocs)
        fn, args, payload_error = self.prepare(header, payload, user_fds, tx)
        if header.binary is not None and payload_error is None:
            pids = self.start_binaries(header, launch, stdio)
        else:
            pids = self.fork_ranks(header, launch, stdio, fn, args, payload_error)
        del fn, args
        # Arguments in a reference cycle (an object that refers to itself)
        # would wait for a collection, or be frozen by settle(), holding the
        # fds they carry open for every later worker: collect them now.
        # Frozen objects are not traversed, so this is cheap (0.2 ms with
        # torch preloaded) except once after unpickling imported a large
        # module (torch not preloaded: 150k new objects, 93 ms, beside the
        # import's 1.8 s); only a full collection is sure to reach arguments
        # that a large unpickling pushed into the old generation.
        gc.collect()
        self.settle()  # what unpickling imported (the module of fn, say)
        _send_pidfds(launch, pids)
        self.channels[tx.fileno()] = launch
        self.epoll.register(tx.fileno(), select.EPOLLRDHUP)
        self.on_writable(launch)

    def prepare(
        self,
        header: protocol.LaunchHeader,
        payload: io.BytesIO,
        user_fds: list[int],
        tx: socket.socket,
    ) -> tuple[Any, Any, str | None]:
        """Take on the caller's state and unpickle fn and args: ``(fn, args,
        None)``, or ``(None, (), traceback)`` when that failed (every rank
        then reports the traceback, as a spawned worker would)."""
        fn: Any = None
        args: Any = ()
        payload_error = None
        try:
            # Take on the caller's current environment, cwd and sys.path
            # before unpickling: imports run here and must see what a spawned
            # interpreter would.  The workers inherit all three.
            os.environ.clear()
            os.environ.update(header.env)
            os.chdir(header.cwd)
            sys.path[:] = header.sys_path
            _import_all(header.preload, strict=True)
            # Before unpickling: fn and args are the launch's, not lasting
            # zygote state, and must stay collectable in the workers.
            self.settle()
            _pickling.inherited_fds[:] = user_fds
            if header.tracker_index is not None:
                _adopt_tracker(user_fds[header.tracker_index])
            if self.prepare_failure is None:
                fn, args = pickle.load(payload)
            elif self.prepare_failure[0] == "exit":
                fn, args = _worker.exit_during_prepare, (self.prepare_failure[1],)
            else:
                payload_error = self.prepare_failure[1]
        except BaseException:
            if _terminating:
                # Our own SIGTERM (the guard died), landed in an import or
                # the unpickling: shut down, not a payload error for the
                # workers while the zygote serves on.
                tx.close()
                raise
            payload_error = traceback.format_exc()
        finally:
            self.reclaim_signals()  # imports and unpickling ran user code
            for fd in user_fds:
                os.close(fd)  # unpickled objects hold their own dups
            _pickling.inherited_fds[:] = []
            payload.close()
        return fn, args, payload_error

    def fork_ranks(
        self,
        header: protocol.LaunchHeader,
        launch: _Launch,
        stdio: _LaunchStdio,
        fn: Any,
        args: Any,
        payload_error: str | None,
    ) -> list[int]:
        """Fork every rank of a launch; the pids forked.  On a failure the
        launch reports it, and the ranks forked so far are killed (still
        counted live until reaped); the pids returned are then none."""
        if header.nprocs >= _COLLAPSE_BEFORE_FORKING and not self.workers:
            self.collapse_now()
        stacks = _worker.ForkStacks(header.stacks)
        spec = self.worker_spec(header, launch, stdio, fn, args, payload_error)
        spec.stacks = stacks.in_worker
        spec.parent_death_armed = True  # by the fork loop
        # Decided here, not in each worker (a call and a lookup there).
        self.reseed_numpy = "numpy.random" in sys.modules
        pids: list[int] = []
        # A signal landing between fork and the worker's own handling would
        # run the zygote's handlers in the worker (SIGTERM would make it act
        # as a zygote shutting down, and exit 0).  Block them across the
        # loop; each worker unblocks them with its own handlers in place.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ZYGOTE_SIGNALS)
        # Fork under the caller's RLIMIT_NPROC, not ours (the caller's as
        # the zygote started): past it, the launch fails with EAGAIN as the
        # caller's own fork would.
        saved_limits = _procstate.adopt_fork_limits(header.process_state)
        group = 0
        call = "fs_group_anchor"  # what runs now, for the report of a failure
        stacks.begin()
        try:
            unlent = self.lend_signals()
            # The launch's process group is led by an anchor that exits at
            # once (its zombie holds the group until every rank has joined),
            # so no rank leads it and each may still setsid(), as a spawned
            # worker can.
            group = _oscall.group_anchor() if header.process_group else 0
            if group:
                launch.queue(-1, _channel.GROUP, _channel.pack_statuses([group]))
            loop = _oscall.ForkLoop(
                header.nprocs, self.me, group, signal.SIGKILL, () if unlent else _ZYGOTE_SIGNALS
            )
            while loop.next < header.nprocs:
                first = loop.next
                prefix = _worker.STACKS_PREFIX if stacks.stacks_file is not None else None
                rank = loop.fork(prefix, stacks.fd)
                if rank != -1:
                    self.in_worker(spec, rank, stdio, loop, unlent)
                pids = loop.pids
                for forked, pid in enumerate(pids[first:], first):
                    self.workers[pid] = (launch, forked)
                step, error = loop.failure()
                if step == lib.FS_FORK_STACKS:
                    stacks.failed()  # out of fds: the rest go without
                elif error is not None:
                    if step == lib.FS_FORK_FORK:
                        call = f"fork of rank {loop.next} of {header.nprocs}"
                    else:  # FS_FORK_SETPGID, of the rank last forked
                        call = f"setpgid of rank {loop.next - 1}"
                    raise error
        except BaseException as exc:
            _abandon(launch, pids, call, exc)
            pids = []
        finally:
            if group:
                _oscall.release_group_anchor(group)
            stacks.end()
            self.take_back_signals()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _ZYGOTE_SIGNALS)
            stdio.close()
            _procstate.restore_limits(saved_limits)
        return pids

    def lend_signals(self) -> set[int]:
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

    def take_back_signals(self) -> None:
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

    def worker_spec(
        self,
        header: protocol.LaunchHeader,
        launch: _Launch,
        stdio: _LaunchStdio,
        fn: Any,
        args: Any,
        payload_error: str | None,
    ) -> _worker.ForkSpec:
        """What each rank of a launch runs, and what it leaves to the
        zygote; the zygote's output flushed, so no worker repeats it."""
        spec = _worker.ForkSpec(
            self.me,
            fn,
            args,
            launch.tx,
            daemon=header.daemon,
            envs=header.envs,
            payload_error=payload_error,
            close_fds=self.own_fds(),
            stdin=-1 if stdio.caller_in is None else stdio.caller_in,
            process_state=header.process_state,
            from_zygote=True,
        )
        # The exit-time finalizers the workers must leave to the zygote.
        finalize = getattr(sys.modules.get("weakref"), "finalize", None)
        _worker.zygote_finalizer_index = _worker.next_finalizer_index(finalize)
        logging = sys.modules.get("logging")
        _worker.zygote_handlers = len(getattr(logging, "_handlerList", ()))
        if header.line_buffered:
            _worker.line_buffer_stdout()  # once here, not in every worker
        sys.stdout.flush()
        sys.stderr.flush()
        return spec

    def start_binaries(
        self, header: protocol.LaunchHeader, launch: _Launch, stdio: _LaunchStdio
    ) -> list[int]:
        """Start a launch whose ranks are a binary with the C launcher
        (clone + exec, no copy of our memory, no Python in the child), each
        in a session of its own with PR_SET_PDEATHSIG against us: what a
        forked worker running _elastic_worker.exec_binary would become, at
        the cost of a spawn.  Our children all the same: reaped and reported
        as forked workers are.  On a failure, as fork_ranks."""
        assert header.binary is not None
        path, argvs = header.binary
        base_env = _oscall.Environ(os.environ)  # the caller's, taken on by prepare()
        stdin = -1 if stdio.caller_in is None else stdio.caller_in
        pids: list[int] = []
        # As in fork_ranks: our own SIGTERM (the guard died) must not land
        # in the middle, taken for a failed launch.  (The programs start
        # with no signal blocked: signal_mask below.)
        signal.pthread_sigmask(signal.SIG_BLOCK, _ZYGOTE_SIGNALS)
        # Each start counts against RLIMIT_NPROC as a fork does (see fork_ranks).
        saved_limits = _procstate.adopt_fork_limits(header.process_state)
        call = ""
        try:
            for rank in range(header.nprocs):
                call = f"start of rank {rank} of {header.nprocs} ({path})"
                rank_stdio, _unused = stdio.for_rank(rank)
                out, err = rank_stdio if rank_stdio is not None else (-1, -1)
                pid, pidfd = _oscall.launch(
                    path,
                    argvs[rank],
                    base_env,
                    env_extra=header.envs.get(rank),
                    stdin=stdin,
                    stdout=out,
                    stderr=err,
                    pdeathsig=signal.SIGKILL,
                    new_session=True,
                    # Ignored here (SIGINT) or by Python (SIGXFSZ): a
                    # program expects them at their defaults.
                    default_signals=(signal.SIGINT, signal.SIGXFSZ),
                    signal_mask=(),
                    process_state=header.process_state,
                )
                os.close(pidfd)  # _send_pidfds opens the caller's
                pids.append(pid)
                self.workers[pid] = (launch, rank)
        except BaseException as exc:
            _abandon(launch, pids, call, exc)
            pids = []
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _ZYGOTE_SIGNALS)
            stdio.close()
            _procstate.restore_limits(saved_limits)
        return pids

    def in_worker(
        self,
        spec: _worker.ForkSpec,
        rank: int,
        stdio: _LaunchStdio,
        loop: _oscall.ForkLoop,
        unlent: set[int],
    ) -> NoReturn:
        """A freshly forked rank (its group, PR_SET_PDEATHSIG and the
        workers' handlers in place, see fork_ranks; -2: that failed): become
        the worker.  Never returns into the zygote's loop: a handler of the
        user's that raises may run as the signals are let through, before
        the worker's own handling starts."""
        try:
            if rank < 0:
                step, error = loop.failure()
                if step == lib.FS_FORK_PDEATHSIG and isinstance(error, ProcessLookupError):
                    os._exit(1)  # the zygote died before prctl: nobody wants us
                raise error or AssertionError(f"fs_fork_ranks failed at step {step}")
            if unlent:
                _in_worker(unlent)
            if self.reseed_numpy:
                _worker.reseed()
            rank_stdio, unused = stdio.for_rank(rank)
            _worker.forked_child(spec, rank, rank_stdio, stdio.others(rank) + unused)
        except BaseException:
            _worker.print_exc()
        finally:
            os._exit(1)

    def receive_fds(self, count: int) -> list[int]:
        """Read ``count`` fds from the messages (MAX_FDS at most each) that
        follow a launch message."""
        fds: list[int] = []
        while len(fds) < count:
            data, more, _flags = _channel.recv_fds(
                self.control, protocol.MAX_MESSAGE, _channel.MAX_FDS
            )
            fds.extend(more)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise EOFError("the caller went away in the middle of a launch")
        return fds

    def on_sigchld(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        touched: set[_Launch] = set()
        worker_died = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            entry = self.workers.pop(pid, None)
            if entry is None:
                continue  # an orphaned descendant we adopted and killed
            worker_died = True
            launch, rank = entry
            launch.live -= 1
            launch.exits += [rank, os.waitstatus_to_exitcode(status)]
            touched.add(launch)
        if worker_died:
            self.kill_orphans()
        for launch in touched:
            self.on_writable(launch)

    def kill_orphans(self) -> None:
        """Kill children that are not our workers: descendants whose worker
        died, reparented to us.  Unreaped, so their pids cannot be reused."""
        for pid in children_of(self.me) - set(self.workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_writable(self, launch: _Launch) -> None:
        """Send what a launch has queued; end it once all is said, or once
        its caller has gone from the channel."""
        if launch.tx.fileno() < 0:
            return  # ended already; its last workers are being reaped
        fd = launch.tx.fileno()
        sent = launch.broken or launch.flush()
        if launch.broken:
            self.abandon(launch)
        if launch.done or launch.broken:
            if fd in self.channels:
                del self.channels[fd]
                self.epoll.unregister(fd)
            launch.tx.close()
            self.closed_in_batch.add(fd)
            return
        if sent == launch.watching_out:
            # Always watched for the caller hanging up; for room to write
            # only while something waits to be sent.
            launch.watching_out = not sent
            events = select.EPOLLRDHUP | (select.EPOLLOUT if launch.watching_out else 0)
            self.epoll.modify(fd, events)

    def abandon(self, launch: _Launch) -> None:
        """The caller closed a launch's channel while workers of it still
        ran (it gave up during the launch, or could not take the workers'
        pidfds): nobody can wait for them or stop them now, so kill them.
        Unreaped children of ours, so the pids are theirs; what they started
        goes as reparented orphans do (kill_orphans)."""
        launch.drop_outbox()
        for pid, (owner, _rank) in self.workers.items():
            if owner is launch:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def shutdown(self) -> None:
        """The caller is gone: kill every worker and descendant, reap, exit."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # The workers first, from our own records: listing children in /proc
        # takes fds, which may have run out.  Then free what fds we can.
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for launch in self.channels.values():
            launch.drop_outbox()
            launch.tx.close()
        self.channels.clear()
        kill_children(self.me)


_ZYGOTE_SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}


def _on_sigchld(signum: int, frame: Any) -> None:
    """Nothing: the wakeup fd is what tells the zygote's loop."""


def _in_worker(unlent: set[int]) -> None:
    """In a freshly forked rank: the handlers the fork loop could not lend
    (SIG_IGN, see lend_signals) set, then the zygote's signals let through."""
    for sig in unlent:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _ZYGOTE_SIGNALS)


def _abandon(launch: _Launch, pids: list[int], call: str, exc: BaseException) -> None:
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


class PreloadError(ImportError):
    """A module named in a launch's ``preload=`` could not be imported."""


def _import_all(modules: Sequence[str], strict: bool = False) -> None:
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


_terminating = False


def _exit_on_sigterm(signum: int, frame: Any) -> None:
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
    signal.SIGTERM: _exit_on_sigterm,
    signal.SIGINT: signal.SIG_IGN,
}


def _failure_of(exc: BaseException) -> tuple[str, Any]:
    """What a spawned worker would have done had importing the main module
    raised ``exc``: exit (SystemExit: an argparse error at import, say) or
    die with the traceback."""
    if isinstance(exc, SystemExit):
        return ("exit", _worker._exit_code(exc))
    return (
        "error",
        "the main module could not be imported in the zygote, as a spawned worker "
        "imports it (code outside `if __name__ == '__main__':` runs there too):\n"
        + traceback.format_exc(),
    )


def _guard(zygote: int) -> NoReturn:
    """The process the caller started, once it has forked the zygote proper:
    wait for it; once it is gone, kill what it left.

    The zygote is a child subreaper, so a worker's orphaned descendants come
    to it, and it kills them; had it been SIGKILLed, they would go to init,
    out of everyone's reach (the launch's process group reaches only those
    still in it, not a daemon that started a session of its own).  As the
    zygote's parent and a subreaper itself, this process adopts them then,
    and kills them until no child is left.  The zygote has
    PR_SET_PDEATHSIG(SIGTERM) against it: if this one is SIGKILLed, the
    zygote shuts down in order, adopting and killing the same way.
    """
    zygote_fd = _oscall.pidfd_open(zygote)  # ours and unreaped: no reuse

    def pass_on(signum: int, frame: Any) -> None:
        try:
            _oscall.pidfd_send_signal(zygote_fd, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, pass_on)  # PR_SET_PDEATHSIG: the caller died
    while True:
        pid, status = os.waitpid(-1, 0)  # retried after pass_on (PEP 475)
        if pid == zygote:
            break
    kill_children(os.getpid())
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    """Entry of the zygote process: ``python -c ... <control fd> <caller pid>``."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A caller that ignores SIGCHLD passed that on through exec: the kernel
    # would reap our children, and the guard's wait and ours find none.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    control_fd = int(sys.argv[1])
    parent = int(sys.argv[2])
    parent_fd = _oscall.pidfd_open(parent)
    if os.getppid() != parent:
        return  # the caller died before we could watch it (the pidfd may be another's)
    # This process stays behind as the zygote's guard (see _guard); the
    # zygote proper is its child.
    _oscall.set_child_subreaper()
    guard = os.getpid()
    pid = os.fork()
    if pid:
        os.close(control_fd)
        os.close(parent_fd)
        _guard(pid)
    _oscall.set_pdeathsig(signal.SIGTERM, guard)  # ProcessLookupError: gone already
    control = socket.socket(fileno=control_fd)
    zygote = None
    try:
        zygote = _Zygote(control, parent, parent_fd)
        # The first message: the caller's spawn preparation data and preloads.
        data = control.recv(protocol.MAX_MESSAGE)
        if not data:
            return
        hello = protocol.Hello.decode(data)
        _worker.capture_worker_exit_handlers()
        try:
            _worker.prepare(hello.preparation)
        except BaseException as exc:
            if _terminating:
                raise  # the caller died: our own SIGTERM
            zygote.prepare_failure = _failure_of(exc)
        _import_all(hello.preload)
        zygote.reclaim_signals()
        zygote.settle()
        zygote.serve()
    finally:
        while zygote is not None:
            try:
                zygote.shutdown()
                break
            except SystemExit:
                continue  # SIGTERM landed inside the shutdown: run it again
        control.close()
