"""The zygote's ranks coming to life: forked (one C loop per launch) into
workers, or started as binaries with the C launcher."""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from fastspawn._os import oscall, procstate
from fastspawn._wire import channel as _channel
from fastspawn._wire import pickling
from fastspawn._worker import forked as worker_forked
from fastspawn._worker import runner
from fastspawn._worker import stacks as worker_stacks
from fastspawn._worker import stdio as worker_stdio
from fastspawn._zygote import link, protocol
from fastspawn._zygote.launch import Launch, LaunchStdio, report_failure
from fastspawn._zygote.signals import ZYGOTE_SIGNALS, Signals, let_signals_through, terminating

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn


class Forker:
    """Starts the ranks of the zygote's launches, recording each in
    ``workers`` (pid -> (launch, rank): the zygote reaps them)."""

    def __init__(self, me: int, workers: dict[int, tuple[Launch, int]], signals: Signals) -> None:
        self.me = me
        self.workers = workers
        self.signals = signals
        self.reseed_numpy = False  # the launch forking now: numpy.random is loaded
        # Our umask, affinity, nice value and limits: what a worker's own
        # launches through its link (Zygote.fork_links) start from.
        self.state = procstate.capture()
        # After a fork failed with EAGAIN: make room for it, True if there
        # is more now (the zygote's ready workers gone: ReadyPool.make_room).
        self.make_room: Callable[[], bool] = lambda: False
        # The next launch's process group, anchored ahead while the zygote
        # is idle (make_spare_group): its anchor, a clone that exits at
        # once, cost a launch 300-480 us before its first rank could start
        # (torch preloaded, Intel Xeon; 37 us in a loop).  0: none made.
        self.spare_group = 0
        # Whether to make one: set by each launch (Zygote.launch), after one
        # that took a group, unless its caller holds it to an RLIMIT_NPROC
        # of its own (the anchor, our child, would count against that).
        self.groups_ahead = False

    def fork_ranks(
        self,
        header: protocol.LaunchHeader,
        launch: Launch,
        stdio: LaunchStdio,
        prepare: Callable[[], tuple[Any, Any, str | None]],
        close_fds: Callable[[], list[int]],
        links: Sequence[socket.socket] = (),
        wake: Callable[[int], list[int]] | None = None,
    ) -> list[int]:
        """Fork every rank of a launch; the pids forked.  On a failure the
        launch reports it, and the ranks forked so far are killed (still
        counted live until reaped); the pids returned are then none.
        ``prepare``: (fn, args, payload error) for the forked ranks
        (Zygote.prepare), called once the ready workers took theirs, and only
        if ranks remain; ``close_fds``: the zygote's own fds, which no worker
        keeps (asked for once the wake and ``prepare`` closed and opened
        theirs); ``links``: each rank's link, our end then its
        (Zygote.fork_links); ``wake``: gives the first ranks to ready
        workers, once the launch's process group (its argument) is made
        (ReadyPool.wake); their pids."""
        stacks: worker_stacks.ForkStacks | None = None  # forked ranks' only
        pids: list[int] = []
        # Fork under the caller's RLIMIT_NPROC, not ours (the caller's as
        # the zygote started): past it, the launch fails with EAGAIN as the
        # caller's own fork would.  (A caller with a limit of its own gets
        # no ready workers, and its fn and args were unpickled before: no
        # code of the user's runs under its limit here.)
        saved_limits = procstate.adopt_fork_limits(header.process_state)
        group = 0
        lent = False
        call = "fs_group_anchor"  # what runs now, for the report of a failure
        try:
            # The launch's process group is led by an anchor that exits at
            # once (its zombie holds the group until every rank has joined),
            # so no rank leads it and each may still setsid(), as a spawned
            # worker can.  (Every signal is blocked in the anchor.)
            group = self.take_group() if header.process_group else 0
            launch.group = group or header.join_group or os.getpgrp()
            if group:
                launch.queue(-1, _channel.GROUP, _channel.pack_statuses([group]))
            call = "the wake of ready workers"
            pids = wake(group or header.join_group) if wake is not None else []
            for rank, pid in enumerate(pids):
                self.workers[pid] = (launch, rank)
            if len(pids) < header.nprocs:
                # What forked ranks need, made once ready workers took theirs
                # (a launch they all took waits for none of it).
                call = "the forked ranks' set-up"
                prepared = prepare()
                # Only now: it reads /proc/self/status (0.17 ms in a zygote
                # at rest), which a launch ready workers took whole need not
                # wait for.
                stacks = worker_stacks.ForkStacks(header.stacks)
                lent = True  # (from here on: taking back what was not lent undoes nothing)
                loop, spec, unlent = self.set_up_loop(
                    header, launch, stdio, prepared, close_fds(), stacks, pids, group
                )
                call = "the fork loop"
                call, error = self.fork_loop(loop, spec, stdio, unlent, links, launch, stacks)
                pids = loop.pids
                if error is not None:
                    raise error
        except BaseException as exc:
            end_if_forked(self.me)
            if terminating():
                raise  # our own shutdown (the guard died): no failure of the launch's
            report_failure(launch, pids, call, exc)
            pids = []
        finally:
            if group:
                oscall.release_group_anchor(group)
            if stacks is not None:
                stacks.end()
            if lent:
                self.signals.take_back()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, ZYGOTE_SIGNALS)
            stdio.close()
            procstate.restore_limits(saved_limits)
        return pids

    def take_group(self) -> int:
        """A new process group for a launch: the spare one if made (see
        make_spare_group), else one anchored now; its anchor's pid."""
        group, self.spare_group = self.spare_group, 0
        return group or oscall.group_anchor()

    def spare_group_due(self) -> bool:
        return self.groups_ahead and not self.spare_group

    def make_spare_group(self) -> None:
        """While idle: anchor the next launch's process group ahead.  Its
        anchor is our unreaped child, a zombie named oscall.ANCHOR_NAME,
        until a launch takes it, room is made for a fork (drop_spare_group)
        or we exit.  None is made where no process may start now (EAGAIN at
        a limit): the launch anchors its own, as before."""
        try:
            self.spare_group = oscall.group_anchor()
        except OSError:
            self.groups_ahead = False  # until the next launch with a group

    def drop_spare_group(self) -> bool:
        """Reap the spare group's anchor, if there is one (a process less);
        whether there was."""
        group, self.spare_group = self.spare_group, 0
        if group:
            oscall.release_group_anchor(group)
        return bool(group)

    def room_for_fork(self) -> bool:
        """After a fork's EAGAIN: free the processes held ahead (the spare
        group's anchor, the ready workers); whether any were."""
        dropped = self.drop_spare_group()
        return self.make_room() or dropped

    def set_up_loop(
        self,
        header: protocol.LaunchHeader,
        launch: Launch,
        stdio: LaunchStdio,
        prepared: tuple[Any, Any, str | None],
        close_fds: list[int],
        stacks: worker_stacks.ForkStacks,
        started: list[int],
        group: int,
    ) -> tuple[oscall.ForkLoop, worker_forked.ForkSpec, set[int]]:
        """Before fork_ranks' loop: the zygote's signals blocked and the
        workers' handlers lent (Signals.take_back and an unblock undo both),
        the loop (``started``: the ready workers' pids; ``group``: the
        launch's anchored process group or 0), the ranks' spec from
        ``prepared`` (fn, args, payload error), the stack dump registered;
        and the signals not lent."""
        # A signal landing between fork and the worker's own handling would
        # run the zygote's handlers in the worker (SIGTERM would make it act
        # as a zygote shutting down, and exit 0), or the lent ones in the
        # zygote's frames (a KeyboardInterrupt unwinding through them).
        # Block them across the loop; each worker unblocks them inside its
        # own handling (set_up_child).
        signal.pthread_sigmask(signal.SIG_BLOCK, ZYGOTE_SIGNALS)
        unlent = self.signals.lend()
        loop = oscall.ForkLoop(
            header.nprocs, self.me, group or header.join_group, signal.SIGKILL, started=started
        )
        spec = self.worker_spec(header, launch, stdio, *prepared, close_fds)
        spec.stacks = stacks.in_worker
        spec.parent_death_armed = True  # by the fork loop
        # Decided here, not in each worker (a call and a lookup there).
        self.reseed_numpy = "numpy.random" in sys.modules
        stacks.begin()
        return loop, spec, unlent

    def fork_loop(
        self,
        loop: oscall.ForkLoop,
        spec: worker_forked.ForkSpec,
        stdio: LaunchStdio,
        unlent: set[int],
        links: Sequence[socket.socket],
        launch: Launch,
        stacks: worker_stacks.ForkStacks,
    ) -> tuple[str, OSError | None]:
        """Fork the ranks ``loop`` has yet to, each into ``spec``: the step
        that failed and its error, or (the loop, None) once all are forked
        (their pids in ``loop.pids``, each recorded in ``workers``)."""
        nprocs = loop.nprocs
        while loop.next < nprocs:
            first = loop.next
            prefix = worker_stacks.STACKS_PREFIX if stacks.stacks_file is not None else None
            pickling.keep_tracker_at_fork(True)  # the launch's, adopted (adopt_tracker)
            try:
                rank = loop.fork(prefix, stacks.fd)
            finally:
                pickling.keep_tracker_at_fork(False)  # in the parent and each rank
            if rank != -1:
                self.in_worker(spec, rank, stdio, loop, unlent, links)
            for forked, pid in enumerate(loop.pids[first:], first):
                self.workers[pid] = (launch, forked)
            step, error = loop.failure()
            if step == oscall.ForkLoop.STEP_STACKS:
                stacks.failed()  # out of fds: the rest go without
            elif error is not None:
                if step == oscall.ForkLoop.STEP_FORK:
                    if error.errno == errno.EAGAIN and self.room_for_fork():
                        continue  # the ready workers' processes are free now
                    return f"fork of rank {loop.next} of {nprocs}", error
                return f"setpgid of rank {loop.next - 1}", error  # of the rank last forked
        return "the fork loop", None

    def worker_spec(
        self,
        header: protocol.LaunchHeader,
        launch: Launch,
        stdio: LaunchStdio,
        fn: Any,
        args: Any,
        payload_error: str | None,
        close_fds: list[int],
    ) -> worker_forked.ForkSpec:
        """What each rank of a launch runs, and what it leaves to the
        zygote; the zygote's output flushed, so no worker repeats it."""
        spec = worker_forked.ForkSpec(
            self.me,
            fn,
            args,
            launch.tx,
            daemon=header.daemon,
            envs=header.envs,
            payload_error=payload_error,
            close_fds=close_fds,
            stdin=-1 if stdio.caller_in is None else stdio.caller_in,
            process_state=header.process_state,
            from_zygote=True,
        )
        # The exit-time finalizers the workers must leave to the zygote.
        finalize = getattr(sys.modules.get("weakref"), "finalize", None)
        runner.zygote_finalizer_index = runner.next_finalizer_index(finalize)
        logging = sys.modules.get("logging")
        runner.zygote_handlers = len(getattr(logging, "_handlerList", ()))
        # Once here, not in every worker: the ranks share these streams.
        if header.line_buffered:
            worker_stdio.line_buffer_stdout()
        worker_stdio.whole_lines()
        sys.stdout.flush()
        sys.stderr.flush()
        return spec

    def take_link(self, links: Sequence[socket.socket], rank: int) -> None:
        """In a worker: keep this rank's end of its link, as the way its own
        launches come to this zygote (see fastspawn._zygote.link); close
        the rest."""
        own = links[2 * rank + 1]
        for other in links:
            if other is not own:
                other.close()
        link.use(own, self.me, self.state)

    def start_binaries(
        self, header: protocol.LaunchHeader, launch: Launch, stdio: LaunchStdio
    ) -> list[int]:
        """Start a launch whose ranks are a binary with the C launcher
        (clone + exec, no copy of our memory, no Python in the child), each
        in a session of its own with PR_SET_PDEATHSIG against us: what a
        forked worker running fastspawn._worker.elastic_rank.exec_binary would become, at
        the cost of a spawn.  Our children all the same: reaped and reported
        as forked workers are.  On a failure, as fork_ranks."""
        assert header.binary is not None
        path, argvs = header.binary
        base_env = oscall.Environ(os.environ)  # the caller's, taken on by prepare()
        stdin = -1 if stdio.caller_in is None else stdio.caller_in
        pids: list[int] = []
        # As in fork_ranks: our own SIGTERM (the guard died) must not land
        # in the middle, taken for a failed launch.  (The programs start
        # with no signal blocked: signal_mask below.)
        signal.pthread_sigmask(signal.SIG_BLOCK, ZYGOTE_SIGNALS)
        # Each start counts against RLIMIT_NPROC as a fork does (see fork_ranks).
        saved_limits = procstate.adopt_fork_limits(header.process_state)
        call = ""

        def start(rank: int) -> tuple[int, int]:
            rank_stdio, _unused = stdio.for_rank(rank)
            out, err = rank_stdio if rank_stdio is not None else (-1, -1)
            return oscall.launch(
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

        try:
            for rank in range(header.nprocs):
                call = f"start of rank {rank} of {header.nprocs} ({path})"
                try:
                    pid, pidfd = start(rank)
                except OSError as exc:
                    # The ready workers' processes freed, once more.
                    if exc.errno != errno.EAGAIN or not self.room_for_fork():
                        raise
                    pid, pidfd = start(rank)
                os.close(pidfd)  # send_pidfds opens the caller's
                pids.append(pid)
                self.workers[pid] = (launch, rank)
        except BaseException as exc:
            report_failure(launch, pids, call, exc)
            pids = []
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, ZYGOTE_SIGNALS)
            stdio.close()
            procstate.restore_limits(saved_limits)
        return pids

    def in_worker(
        self,
        spec: worker_forked.ForkSpec,
        rank: int,
        stdio: LaunchStdio,
        loop: oscall.ForkLoop,
        unlent: set[int],
        links: Sequence[socket.socket],
    ) -> NoReturn:
        """A freshly forked rank (its group, PR_SET_PDEATHSIG and the
        workers' handlers in place, see fork_ranks; -2: that failed): become
        the worker.  Never returns into the zygote's loop: a handler of the
        user's that raises may run as the signals are let through, before
        the worker's own handling starts."""
        try:
            set_up_child(loop, rank, unlent)
            if self.reseed_numpy:
                worker_forked.reseed()
            if links:
                self.take_link(links, rank)
            rank_stdio, unused = stdio.for_rank(rank)
            worker_forked.forked_child(spec, rank, rank_stdio, stdio.others(rank) + unused)
        except BaseException:
            runner.print_exc()
        finally:
            os._exit(1)


def set_up_child(loop: oscall.ForkLoop, index: int, unlent: set[int]) -> None:
    """In a child the C fork loop just forked (a rank, or a ready worker;
    ``index`` -2: its set-up failed, see ForkLoop.fork), inside the child's
    own handling: exit if the zygote died before PR_SET_PDEATHSIG was
    armed, raise if another step failed; else let the zygote's signals
    through (blocked since the fork), with the handlers not lent."""
    if index < 0:
        step, error = loop.failure()
        if step == oscall.ForkLoop.STEP_PDEATHSIG and isinstance(error, ProcessLookupError):
            os._exit(1)  # the zygote died before prctl: nobody wants us
        raise error or AssertionError(f"fs_fork_ranks failed at step {step}")
    let_signals_through(unlent)


def end_if_forked(zygote: int) -> None:
    """On an exception's way out of a fork loop: in a child of the loop
    (something raised there before the child took on its own handling),
    print it and end.  Unwound into the zygote's frames, the child would
    report the launch failed and kill its other ranks, then shut down as
    the zygote does, killing every worker."""
    if os.getpid() != zygote:
        runner.print_exc()
        os._exit(1)
