"""ProcessContext: the workers of one launch, joined together (torch's
``ProcessContext``)."""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

from fastspawn._launch import exiting, kernel_output
from fastspawn._launch import stacks as _stacks
from fastspawn._launch.errors import (
    ProcessException,
    exited_exception,
    raised_exception,
)
from fastspawn._launch.methods import helpers
from fastspawn._launch.process import (
    Process,
    checked_seconds,
    pidfd_lock,
    running_among,
)
from fastspawn._os import oscall
from fastspawn._os.oscall import wait_readable
from fastspawn._wire.channel import Receiver

# The logger's name is the one the docs give (differences.md, stacks.md),
# which logging set-ups match: kept from before the package had floors.
LOGGER_NAME = "fastspawn._context"
log = logging.getLogger(LOGGER_NAME)


_CHANNEL = 1 << 62  # the waiter token of the report channel (ranks are the others)


def _in_group(pid: int, group: int) -> bool:
    """Whether ``pid`` is (still) in process group ``group``; a pid gone
    since counts as in it (nothing to signal)."""
    try:
        return os.getpgid(pid) == group
    except ProcessLookupError:
        return True


_noted_stacks_not_taken = False


def _note_stacks_not_taken() -> None:
    """Once a process, at a failure on a CPython whose stack dump may crash
    the rank it dumps (_stacks.DUMP_MAY_CRASH): say why there are none."""
    global _noted_stacks_not_taken
    if _noted_stacks_not_taken:
        return
    _noted_stacks_not_taken = True
    version = ".".join(map(str, sys.version_info[:3]))
    log.warning(
        "the other ranks' stacks are not taken at a failure on Python %s: its "
        "faulthandler may crash a process it dumps (CPython issue gh-123967); upgrade to "
        "3.12.8, 3.13.1 or later to have them",
        version,
    )


class ProcessContext:
    """The workers of one launch, joined together.

    Attributes:
        processes: one :class:`fastspawn.Process` per rank.
        rank_stacks: after a failure, ``{rank: text}``: the Python stacks
            of every thread of the ranks still running then, taken before
            they were stopped (see :meth:`dump_stacks`); empty until then,
            and with ``stacks=False``.
        return_values: ``{rank: value}`` of every rank that returned, once
            all are reaped (after a failure too: the ranks that finished
            before it keep their values).  Values arrive pickled and are
            unpickled at the first read of this attribute, not in ``join``:
            a caller that never reads them (torch code) never pays for it,
            and one that cannot be unpickled here (its class lives only in
            the workers) raises when read, naming the rank.
    """

    def __init__(
        self,
        processes: list[Process],
        receiver: Receiver,
        daemon: bool = False,
        group: int = 0,
        watched_groups: Sequence[int] = (),
        stacks: bool = False,
    ) -> None:
        if not isinstance(receiver, Receiver):
            # Not an AttributeError on .fileno() somewhere below.
            raise TypeError(
                "fastspawn.ProcessContext(processes, receiver) is made by start_processes; "
                "torch's ProcessContext(processes, error_files) is "
                "fastspawn.SpawnContext(processes, error_files)"
            )
        self.processes = processes
        self._stacks = stacks  # the workers armed the stack dump: take it at a failure
        self.rank_stacks: dict[int, str] = {}
        self._stacks_not_taken = False  # at a failure, see _stacks.DUMP_MAY_CRASH
        self._group = group  # process group of the workers (zygote), 0: none
        self._watched_groups = list(watched_groups)  # see LaunchRequest
        self._values: dict[int, Any] = {}  # see return_values
        self._pickled: dict[int, bytes] = {}  # rank -> value not yet unpickled
        self.daemon = daemon
        self._receiver = receiver
        self._waiter: oscall.Waiter | None = oscall.Waiter()
        self._pending: dict[int, Process] = {}  # rank -> not yet seen to exit
        self._watched: set[int] = set()  # ranks whose pidfd is in the waiter
        # Ranks reaped through their Process object (join, is_alive, ...):
        # the waiter no longer sees them, so join looks here first.
        self._reaped_elsewhere: list[int] = []
        # Seen to exit, out of _pending, not yet judged by _failure().
        self._unjudged: list[Process] = []
        self._waiter.add(receiver.fileno(), _CHANNEL)
        self._channel_watched = True
        # Weakly: a context dropped once its workers were reaped through
        # their Process objects is freed (and its fds closed) at once, not
        # when a cyclic collection comes round.  One reference for all (the
        # caller builds this while the ranks come up).
        forget = weakref.WeakMethod(self._forget)
        for proc in processes:
            self._waiter.add(proc.sentinel, proc.rank)
            self._watched.add(proc.rank)
            self._pending[proc.rank] = proc
            proc.on_close = forget
        self._open_pidfds = len(processes)  # closed by _forget, one by one
        self._join_lock = threading.Lock()
        self._join_owner: int | None = None  # the thread that holds it
        self._failed = False
        # After a failure: the other ranks that ended badly (stopped by the
        # signal, say), by rank, each raised by one more join() as torch does.
        self._unreported: list[int] = []
        if processes:
            exiting.live_contexts.add(self)

    def __repr__(self) -> str:
        return (
            f"<fastspawn.ProcessContext nprocs={len(self.processes)} "
            f"running={len(self._pending)} pids={self.pids()[:8]}>"
        )

    def pids(self) -> list[int]:
        """The workers' pids, by rank."""
        return [int(p.pid) for p in self.processes]

    def dump_stacks(self, timeout: float = _stacks.DEMAND_TIMEOUT) -> dict[int, str]:
        """The Python stacks of every thread of every rank still running,
        as faulthandler writes them (most recent call first), taken without
        the ranks' cooperation: a rank stuck in C code, a collective or a
        lock answers too.  The ranks go on running.

        Args:
            timeout: seconds to wait for the ranks' answers, all together.

        Returns:
            ``{rank: text}`` in rank order, for the ranks running now.  A
            rank that cannot answer (a binary, started with ``stacks=False``,
            stopped, or past ``timeout``) gets a line saying why and what the
            kernel says of it (its state, where it waits).  A Ctrl-C
            meanwhile is raised once the answers are in (``timeout`` at
            most): a file opened for them is never left open.
        """
        return self._take_stacks(self.processes, timeout)

    def _take_stacks(self, procs: Sequence[Process], timeout: float) -> dict[int, str]:
        """dump_stacks for ``procs``, through copies of their pidfds: another
        thread may reap them and close theirs meanwhile (see pidfd_lock).
        Signals held throughout (``timeout`` bounds it): the copies and the
        ranks' stack files are opened and closed here, and a Ctrl-C between
        an open and its record would leave one open."""
        targets = []
        with oscall.held_signals():
            try:
                with pidfd_lock:
                    for proc in procs:
                        if proc._exitcode is None and proc._pidfd >= 0:
                            pidfd = os.dup(proc._pidfd)
                            targets.append(_stacks.Target(proc.rank, proc.pid, pidfd))
                found = _stacks.collect(targets, timeout)
            finally:
                for target in targets:
                    os.close(target.pidfd)
        return {rank: found[rank] for rank in sorted(found)}

    def _forget(self, proc: Process) -> None:
        """A worker's pidfd is about to close (it was reaped): stop watching
        it.  Once all are, nothing is left to shut down at exit: the context
        need not be held (joined through its processes, say, never itself)."""
        if self._waiter is not None and proc.rank in self._watched:
            self._waiter.remove(proc.sentinel)
            self._watched.discard(proc.rank)
            self._reaped_elsewhere.append(proc.rank)
        self._open_pidfds -= 1
        if self._open_pidfds == 0:
            exiting.live_contexts.discard(self)
            helpers.forget_groups(self._watched_groups)

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for any worker to exit; on a failure, stop the rest and raise.

        Args:
            timeout: seconds to wait (None or ``inf``: until some worker exits).
            grace_period: after a failure, how long the others get to exit by
                themselves before SIGTERM, and again before SIGKILL
                (None: no wait before SIGTERM, 30 s before SIGKILL; ``inf``:
                as long as they take, never signalled).

        Returns:
            True once every worker exited successfully (and on every later
            call); False while some still run.  After a failure, as in torch,
            each later call raises for one more rank that ended badly (the
            ones stopped because of the failure, in rank order), and only
            then returns True.

        Raises:
            ProcessRaisedException: a worker raised; the message ends with its
                traceback.  Raised whatever goes wrong while the others are
                stopped: they are then killed, and none is left running.
            ProcessExitedException: a worker exited non-zero or was killed.
            TypeError, ValueError: ``timeout`` or ``grace_period`` is not a
                number, or nan (before anything else happens).
        """
        timeout = checked_seconds(timeout, "timeout")
        grace_period = checked_seconds(grace_period, "grace_period")
        if timeout == math.inf:
            timeout = None
        # One join at a time: two threads joining at once would close the
        # waiter and the channel under each other.  The wait for the lock
        # counts against the timeout.
        started = time.monotonic()
        me = threading.get_ident()
        try:
            if not self._lock_for_join(timeout):
                return False
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            return self._join(left, grace_period)
        finally:
            # Whatever cut the above short, even as the lock was taken.
            if self._join_owner == me:
                if not self._pending:
                    # In a notebook: the ranks' last lines show before
                    # whatever the caller prints next (a no-op elsewhere).
                    kernel_output.catch_up()
                with oscall.held_signals():
                    self._join_owner = None
                    self._join_lock.release()

    def _lock_for_join(self, timeout: float | None) -> bool:
        """Take the join lock within ``timeout``; False if another join
        holds it that long.  Taken and its owner recorded as one step (a
        Ctrl-C raised as acquire() returns would leave it taken for ever,
        by no one), so the wait goes in slices, each with signals held.
        Already this thread's: a join of its own was cut short before it
        let go (join() is not reentrant), and this one carries on."""
        if self._join_owner == threading.get_ident():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
            with oscall.held_signals():
                if self._join_lock.acquire(timeout=left):
                    self._join_owner = threading.get_ident()
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _join(self, timeout: float | None, grace_period: float | None) -> bool:
        if self._unreported:
            self._raise_unreported()
        deadline = None if timeout is None else time.monotonic() + timeout
        exited: list[Process] = []
        while self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            exited = self._collect(left)
            if exited or (deadline is not None and time.monotonic() >= deadline):
                break
        failed = self._failure()
        if failed is not None:
            self._fail(failed.rank, grace_period)
        self._unjudged.clear()  # cut short before this, judged again: no harm
        if self._pending:
            return False
        # A zygote rank judged by its report alone (it raised) has its exit
        # status on the way: take it before its pidfd is released.
        for proc in self.processes:
            if proc._exitcode is None:
                proc.join()
        self._finish()
        return True

    def _raise_unreported(self) -> NoReturn:
        """Raise for the next rank of ``_unreported``, which it leaves.  A
        Ctrl-C held meanwhile is raised as the block ends, the failure
        chained to it (its __context__): never popped and lost unseen."""
        with oscall.held_signals():
            raise self._exception(self._unreported.pop(0))

    def _failure(self) -> Process | None:
        """The rank whose failure this join raises: the first that ended
        badly of those seen to exit since the last judgement (in this join,
        or in one a Ctrl-C cut short before it judged them); None if none
        did, or a failure was raised already."""
        if self._failed:
            return None
        errors = self._receiver.reports.errors
        return next(
            (
                p
                for p in self._unjudged
                if p.rank in errors or (p._exitcode is not None and p._exitcode != 0)
            ),
            None,
        )

    def _fail(self, rank: int, grace_period: float | None) -> NoReturn:
        """Rank ``rank`` ended badly: stop the others, then raise for it.

        Whatever goes wrong while they stop, none is left running and the
        failure is not lost: an error is logged, every worker killed and
        reaped, and the failure raised; an interruption (Ctrl-C) kills and
        reaps them too and propagates, leaving the failure for the next
        join to raise.
        """
        try:
            # Cut short before this, nothing changed: the next join judges
            # the failure again (it stays in _unjudged).
            with oscall.held_signals():  # failed and to be raised: one step
                self._failed = True
                self._unreported = [rank]  # until raised below
            self._stop_all(grace_period, self.processes[rank])
        except Exception:
            log.exception(
                "fastspawn: stopping the other workers after rank %d failed went wrong; "
                "killing them",
                rank,
            )
            self._kill_all(rank)
        except BaseException:
            self._kill_all(rank)
            with oscall.held_signals():  # even if cut short before the first step
                self._failed = True
                self._unreported = [rank, *self._failed_besides(rank)]
            raise
        with oscall.held_signals():
            self._unreported = [rank, *self._failed_besides(rank)]
        self._raise_unreported()

    def _kill_all(self, rank: int) -> None:
        """A teardown's last resort: SIGKILL every worker still running,
        reap them all, release every fd (an error on the way is logged:
        the failure of ``rank`` is what the caller must see)."""
        try:
            self._end(signal.SIGKILL)
        except Exception:
            log.exception(
                "fastspawn: could not kill and reap every worker after rank %d failed", rank
            )

    def _failed_besides(self, rank: int) -> list[int]:
        """The ranks other than ``rank`` that ended badly, all reaped."""
        errors = self._receiver.reports.errors
        return [
            proc.rank
            for proc in self.processes
            if proc.rank != rank and (proc.rank in errors or proc.exitcode != 0)
        ]

    def _collect(self, timeout: float | None) -> list[Process]:
        """Wait up to ``timeout`` for ready pidfds (one epoll_wait: O(ready),
        not O(nprocs)); return the pending workers found exited, in the
        order seen, and forget them.  Drains the report channel on the way."""
        assert self._waiter is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._reaped_elsewhere:
            # Each leaves the list once seen below: their pidfds are closed,
            # and one dropped unseen would be waited for for ever.
            ready = list(self._reaped_elsewhere)
        else:
            try:
                ready = self._waiter.wait(timeout)
            except InterruptedError:
                return []  # a signal handler ran without raising: keep waiting
        # One held step for what is known now (a held step costs ~19 us in
        # the main thread: one per rank would make joining 256 ranks 10x
        # slower); a zygote rank whose exit status is still on its way is
        # waited for after it, signals not held.
        exited: list[Process] = []
        waiting: list[Process] = []
        with oscall.held_signals():
            # The channel read once for all of them, not once a rank (a
            # read that finds nothing costs ~8 us; 128 of them a launch of
            # 64): what a rank reported it sent before its exit, which the
            # wait has seen.
            self._drain()
            for token in ready:
                if token == _CHANNEL:
                    continue
                proc = self._pending.get(token)
                if proc is None:
                    self._seen_elsewhere(token)
                    continue
                raised = self._raised(proc)
                if not raised:
                    proc._poll(time.monotonic(), drained=True)  # what is in: no wait
                if raised or proc._exitcode is not None:
                    self._judged(proc, exited)
                else:
                    waiting.append(proc)
        reports = self._receiver.reports
        for proc in waiting:
            if proc.rank not in reports.exits:
                proc._poll(deadline)  # may wait for the zygote's word
            with oscall.held_signals():
                if proc.rank in reports.exits:
                    proc._poll()  # its word is in: recorded, no read, no wait
                if proc._exitcode is not None:
                    self._judged(proc, exited)
        return exited

    def _judged(self, proc: Process, exited: list[Process]) -> None:
        """``proc`` exited: out of _pending, into ``exited`` (signals held by
        the caller).  Cut short before this, its pidfd still polls readable
        (or it is in _reaped_elsewhere): the next join sees it again; after
        it, _failure() finds it."""
        del self._pending[proc.rank]
        exited.append(proc)
        self._unjudged.append(proc)
        self._seen_elsewhere(proc.rank)

    def _seen_elsewhere(self, rank: int) -> None:
        if rank in self._reaped_elsewhere:
            self._reaped_elsewhere.remove(rank)

    def _raised(self, proc: Process) -> bool:
        """Whether an exited zygote worker reported an exception (the
        channel read since its exit showed: _collect).  Its exit status
        (non-zero then) is still on its way from the zygote; the others can
        be stopped without waiting for it, one hop sooner."""
        if proc._is_child or proc._exitcode is not None:
            return False
        return proc.rank in self._receiver.reports.errors

    def _drain(self) -> None:
        """Read the report channel; at its EOF stop watching it (an fd at EOF
        polls readable for ever)."""
        self._receiver.drain()
        if self._receiver.reports.eof and self._channel_watched and self._waiter is not None:
            self._waiter.remove(self._receiver.fileno())
            self._channel_watched = False

    def _wait_all(self, timeout: float) -> None:
        """Wait up to ``timeout`` for every pending worker to exit."""
        deadline = time.monotonic() + timeout
        # Workers reaped already (through their Process objects, or seen in
        # the same wakeup as the failure) no longer poll through the waiter.
        for rank, proc in list(self._pending.items()):
            if proc._exitcode is not None:
                del self._pending[rank]
        self._reaped_elsewhere = []
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._collect(left)

    def _stop_all(self, grace_period: float | None, failed: Process) -> None:
        if grace_period is not None:
            self._wait_all(grace_period)
        if self._stacks:
            self._take_failure_stacks()
        # running_among(), not is_alive(): the latter would wait for the exit
        # status of each worker that just died, one after the other.
        # Signal first, log after: hundreds of log records would otherwise
        # delay the signal by milliseconds.
        live = running_among(self._pending.values())
        self._signal_all(live, signal.SIGTERM)
        for proc in live:
            log.warning("Terminating process %s via signal SIGTERM", proc.pid)
        # The stacks, taken before the signal, are logged after torch's
        # records: code and tests that read the first WARNING of a failure
        # (torch's test_terminate_exit) see torch's.
        self._log_failure_stacks(failed)
        self._wait_all(30 if grace_period is None else grace_period)
        live = running_among(self._pending.values())
        # The whole group, even with no rank left running: what the failed
        # launch's ranks left in it (a child of the rank that failed last,
        # or one that outlived its SIGTERM) goes too, whatever the timing.
        self._signal_all(live, signal.SIGKILL, whole_group=True)
        for proc in live:
            log.warning(
                "Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL",
                proc.pid,
            )
        self._end()

    def _take_failure_stacks(self) -> None:
        """Take the stacks of the ranks still running (``rank_stacks``),
        before they are stopped.  Bounded by _stacks.FAILURE_TIMEOUT; a
        failure here must not keep the ranks from being stopped."""
        live = running_among(self._pending.values())
        if not live:
            return
        if _stacks.DUMP_MAY_CRASH:
            self._stacks_not_taken = True  # said after torch's records
            return
        try:
            self.rank_stacks = self._take_stacks(live, _stacks.FAILURE_TIMEOUT)
        except Exception:
            log.exception("fastspawn: could not take the stacks of the other ranks")

    def _log_failure_stacks(self, failed: Process) -> None:
        """The stacks taken at the failure of ``failed``, in one WARNING."""
        if self._stacks_not_taken:
            _note_stacks_not_taken()
        if self.rank_stacks and log.isEnabledFor(logging.WARNING):
            block = _stacks.format_block(
                (f"rank {rank} (pid {self.processes[rank].pid})", text)
                for rank, text in self.rank_stacks.items()
            )
            log.warning(
                "process %d (pid %d) failed; where the other processes were "
                "(Python stacks, most recent call first), before they are stopped:\n%s",
                failed.rank,
                failed.pid,
                block,
                extra={"rank_stacks": self.rank_stacks},  # for handlers, and fastspawn run
            )

    def _end(self, sig: int | None = None) -> None:
        """Send ``sig`` (if given) to every worker still running, wait for
        them all, then release every fd: the last step of every way out."""
        if sig is not None:
            self._signal_all(running_among(self.processes), sig)
        for proc in self.processes:
            proc.join()
        self._pending.clear()
        self._finish()

    def _signal_all(self, procs: list[Process], sig: int, whole_group: bool = False) -> None:
        """Signal ``procs``: with one killpg when the launch has its own process
        group (a signal loop over hundreds of workers runs interleaved with
        the kernel tearing down each victim), else one by one.  The group id
        is safe to use while ``procs`` (members, still running) exist.

        ``whole_group``: signal the group even with no ``procs``, to reach
        what the ranks left in it.  The id is still the group's while any
        member lives (what this is for); with none left, the kill finds
        nothing, unless the pid counter wrapped round to that id in the
        moments since the last rank was reaped: the bound the warden and the
        zygote's watcher rely on too."""
        if self._group and (procs or whole_group):
            try:
                os.killpg(self._group, sig)
            except (ProcessLookupError, PermissionError):
                procs_left = procs
            else:
                # A worker may have left the group (setsid(), setpgid()):
                # those get it one by one, the others must not get it twice.
                procs_left = [proc for proc in procs if not _in_group(proc.pid, self._group)]
        else:
            procs_left = procs
        for proc in procs_left:
            proc._signal(sig)

    def _exception(self, rank: int) -> ProcessException:
        exc = self._torch_exception(rank)
        exc.rank_stacks = dict(self.rank_stacks)  # beside the message, which stays torch's
        return exc

    def _torch_exception(self, rank: int) -> ProcessException:
        proc = self.processes[rank]
        tb = self._receiver.reports.errors.get(rank)
        if tb is not None:
            return raised_exception(rank, proc.pid, tb)
        code = proc.exitcode
        assert code is not None
        return exited_exception(rank, proc.pid, code)

    @property
    def return_values(self) -> dict[int, Any]:
        """``{rank: value}`` of the ranks that returned, unpickled here at
        the first read (see the class docstring).

        Raises:
            Exception: what unpickling a rank's value raised (a
                ModuleNotFoundError, say), again at every read; the other
                ranks' values are kept.
        """
        error: Exception | None = None
        for rank in sorted(self._pickled):
            try:
                self._values[rank] = pickle.loads(self._pickled[rank])
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"(unpickling the return value of rank {rank})")
                error = error or exc
                continue
            del self._pickled[rank]  # the raw pickle is not kept beside the value
        if error is not None:
            raise error
        return self._values

    def _finish(self) -> None:
        """Every worker is reaped: take the return values (still pickled),
        release every fd; as one step (nothing here blocks), so that a Ctrl-C
        never leaves an fd closed and still recorded as open."""
        with oscall.held_signals():
            self._finish_held()

    def _finish_held(self) -> None:
        if self._waiter is None:
            return
        self._receiver.drain()
        reports = self._receiver.reports
        for rank in range(len(self.processes)):
            if rank in reports.results:
                self._pickled[rank] = reports.results.pop(rank)
            elif rank in reports.unpicklable:
                log.warning(
                    "rank %d returned a value that cannot be pickled (%s); "
                    "it is missing from return_values",
                    rank,
                    reports.unpicklable[rank],
                )
        for proc in self.processes:
            proc.on_close = None
            if proc._exitcode is not None:
                proc.close()
        waiter, self._waiter = self._waiter, None
        waiter.close()
        self._receiver.close()
        helpers.forget_groups(self._watched_groups)
        exiting.live_contexts.discard(self)

    def _shutdown_at_exit(self) -> None:
        """What multiprocessing does at interpreter exit: terminate daemonic
        workers, wait for the others."""
        # A join running in another thread finishes first; one that blocks
        # (a daemon thread waiting on daemonic workers, say) must not hold
        # up the exit.
        if not self._join_lock.acquire(timeout=1.0):
            # That join (a daemon thread's, blocked on these workers) owns
            # the pidfds and the channel: closing them here would pull them
            # from under it (EBADF there, or worse, a number reused).  Stop
            # daemonic workers and wait for the rest to exit, reaping and
            # closing nothing; the process is exiting anyway.
            try:
                running = running_among(self.processes)
                if self.daemon:
                    self._signal_all(running, signal.SIGTERM)
                for proc in running:
                    wait_readable([proc.sentinel], None)
            except (OSError, ValueError):
                pass  # that join reaped and closed one meanwhile
            # The workers are gone; that join ends once their statuses are
            # in, which a zygote sends after reaping them: let it, before
            # the zygote is stopped (its join would count them killed).
            if self._join_lock.acquire(timeout=5.0):
                self._join_lock.release()
            return
        try:
            self._end(signal.SIGTERM if self.daemon else None)
        finally:
            self._join_lock.release()
