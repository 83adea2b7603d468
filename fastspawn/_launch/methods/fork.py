"""Start method "fork": each worker is an os.fork() of the caller.

No pickling and no new interpreter: the fastest start, with the caller's
whole state (threads excepted, locks as they were), as multiprocessing's
fork.  Forks run on the launcher thread (see fastspawn._os.launcher_thread), since
PR_SET_PDEATHSIG follows the forking thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from typing import NoReturn

from fastspawn._launch.methods import base, common
from fastspawn._launch.methods.base import LaunchRequest, Started
from fastspawn._os import oscall
from fastspawn._os.launcher_thread import on_launcher_thread
from fastspawn._wire import pickling
from fastspawn._wire.channel import Receiver
from fastspawn._worker import forked as worker_forked
from fastspawn._worker import runner
from fastspawn._worker import stacks as worker_stacks


class Fork(common.ChildrenOfCaller):
    name = "fork"
    pickles_arguments = False

    def launch(self, req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
        on_launcher_thread(_fork_ranks, req, tx, rx, started)


def _fork_ranks(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    stacks = worker_stacks.ForkStacks(req.stacks)
    spec = worker_forked.ForkSpec(
        os.getpid(),
        req.fn,
        req.args,
        tx,
        daemon=req.daemon,
        envs=req.envs,
        close_fds=[rx.fileno()],
        stdin=None if req.keep_stdin else -1,
        stacks=stacks.in_worker,
    )
    spec.die_with_parent = not req.outlive_caller
    runner.flush_std_streams()
    with common.launch_group(req, started) as group, _stacks_armed(stacks):
        # Each rank born with its own stack file (see fastspawn._worker.stacks.ForkStacks).
        stacks_file, stacks_fd, prefix = stacks.stacks_file, stacks.fd, worker_stacks.STACKS_PREFIX
        for rank in range(req.nprocs):
            held = oscall.held_signals()
            with held:  # from the fork until the worker is in ``started``
                if stacks_file is not None and stacks_file(prefix, rank, stacks_fd) != 0:
                    stacks.failed()
                    stacks_file = None
                pickling.keep_tracker_at_fork(True)
                try:
                    pid = _fork(rank)
                finally:
                    pickling.keep_tracker_at_fork(False)  # in the parent and the rank
                if pid == 0:
                    _in_worker(spec, rank, group, req.stdio.get(rank), held.previous)
                if group:
                    try:
                        os.setpgid(pid, group)
                    except (PermissionError, ProcessLookupError):
                        pass  # it did already, and may have moved on
                try:
                    pidfd = oscall.pidfd_open(pid)
                except BaseException:
                    os.kill(pid, signal.SIGKILL)  # unreaped: still ours
                    os.waitpid(pid, 0)
                    raise
                started.append((pid, pidfd))
                if rank == req.nprocs - 1:
                    base.release_anchor(req)  # here, with the signals still held


@contextlib.contextmanager
def _stacks_armed(stacks: worker_stacks.ForkStacks) -> Iterator[None]:
    """For the fork loop: registered during it, not after, whatever
    interrupts it.  end() undoes whatever part of begin() ran, and runs
    twice: a Ctrl-C that arrived after the loop's last held block is raised
    as the first call starts, before it did anything; the second, a no-op
    otherwise, then closes the last rank's file."""
    try:
        stacks.begin()
        yield
    finally:
        try:
            stacks.end()
        finally:
            stacks.end()


def _fork(rank: int) -> int:
    """os.fork(), whose error says which rank failed and, for EAGAIN, which
    limit it met and what to do (as the zygote's and spawn's do)."""
    try:
        return os.fork()
    except OSError as exc:
        if not exc.errno:
            raise
        raise oscall.oserror(exc.errno, f"fork of rank {rank}") from None


def _in_worker(
    spec: worker_forked.ForkSpec,
    rank: int,
    group: int,
    stdio: tuple[int, int] | None,
    mask: set[int | signal.Signals],
) -> NoReturn:
    """A freshly forked rank, its signals still held: join the group, let
    the signals through (``mask``: the caller's), become the worker.  Never
    returns into the caller's code: a handler the caller installed (one
    that raises, as fastspawn.elastic's SignalException does) runs as the
    signals are let through, before the worker's own handling starts, when
    a signal came early (a stop right after another rank failed)."""
    # Set in both processes, as shells do, so that neither order of running
    # leaves a gap.
    if group:
        try:
            os.setpgid(0, group)
        except OSError:
            pass  # the parent did; or a stranger reaped the anchor
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        worker_forked.forked_child(spec, rank, stdio)
    except BaseException:
        runner.print_exc()
    finally:
        os._exit(1)


METHOD = Fork()
