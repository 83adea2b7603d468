"""Start method "zygote" (the default): workers forked from the zygote, a
clean fastspawn interpreter started once (see fastspawn._zygote for the process,
client for the caller's handle on it).

Spawn-safe, at fork speed: the zygote has none of the caller's threads,
locks or CUDA state, prepares like a spawned child (the caller's main module
imported as ``__mp_main__``), and forks every rank of a launch from one
unpickling of fn and args.  The workers are the zygote's children: it
reports their exit statuses on the launch's channel.
"""

from __future__ import annotations

import os
import socket
import sys

from fastspawn._launch.methods import common
from fastspawn._launch.methods.base import LaunchRequest, Started, StartMethod, kill_started
from fastspawn._launch.methods.helpers import forget_groups
from fastspawn._os import oscall
from fastspawn._wire import payload
from fastspawn._wire.channel import LaunchFailure, Receiver
from fastspawn._worker import stdio as worker_stdio
from fastspawn._zygote import client, link, protocol


class Zygote(StartMethod):
    name = "zygote"
    supports_preload = True
    caller_reaps = False
    spawn_accepts = True

    def launch(self, req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
        # On the caller's thread: the zygote does the forking.
        try:
            server = _send_launch(req, tx)
            if _receive_workers(req, rx, started, server, True):
                return
            # The zygote was killed before it took the launch (the channel
            # ended without its first word, see say_taken): none of its
            # ranks started.  Its watcher has seen it go (_death waited for
            # that): a new zygote takes the launch.
            tx = rx.renew()
            server = _send_launch(req, tx, again=True)
            _receive_workers(req, rx, started, server, False)
        finally:
            common.discard_work(req)

    def helper_pids(self) -> set[int]:
        return client.helper_processes()[0]


def _caller_stdio(keep_stdin: bool) -> tuple[list[int], list[int]]:
    """This process's fds 1 and 2 (0, 1 and 2 with ``keep_stdin``) as they
    are now, for the workers of a zygote launch: the zygote's own are the
    caller's as they were when it started, before any redirection since
    (pytest's capture, a dup2 onto a log file).  A closed one is sent as
    /dev/null.  Returns (the fds to send, those of them to close after)."""
    fds: list[int] = []
    opened: list[int] = []
    for fd in (0, 1, 2) if keep_stdin else (1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(null)
            fds.append(null)
    return fds, opened


def _per_rank_stdio(req: LaunchRequest) -> tuple[list[tuple[int, int]], list[int]]:
    """The ranks' own stdio fds: ``(rank, 1 or 2)`` slots and the fds."""
    slots: list[tuple[int, int]] = []
    fds: list[int] = []
    for rank, pair in sorted(req.stdio.items()):
        for stream, fd in zip((1, 2), pair, strict=True):
            if fd >= 0:
                slots.append((rank, stream))
                fds.append(fd)
    return slots, fds


def _send_launch(
    req: LaunchRequest, tx: socket.socket, again: bool = False
) -> client.ZygoteClient | link.RootLink:
    """Send the launch to the zygote (started if need be, and once more if
    it died meanwhile): the pickled fn and args in a memfd, then the
    launch's header; the fds they carry, the ranks' stdio and the caller's.
    Closes ``tx`` (our copy must go before we wait: if the zygote dies, the
    channel's EOF is how we learn it).  ``again``: the memfd went to a
    zygote that died before it took it, and its header goes.  Returns the
    handle of the zygote the launch went to."""
    opened: list[int] = []
    try:
        cwd = common.current_dir()
        payload_fd, user_fds = req.work or common.pickle_work(req)
        user_fds = list(user_fds)  # the request's stays as pickled
        if again:
            payload.drop_trailer(payload_fd)
        tracker = common.tracker_fd()
        tracker_index = None
        if tracker is not None:
            tracker_index = len(user_fds)
            user_fds.append(tracker)
        stdio_slots, stdio_fds = _per_rank_stdio(req)
        server = client.get_server()
        default_stdio, opened = _caller_stdio(req.keep_stdin)
        header = protocol.LaunchHeader(
            nprocs=req.nprocs,
            daemon=req.daemon,
            preload=req.preload,
            sys_path=sys.path,
            env=os.environ,
            cwd=cwd,
            envs=req.envs,
            process_group=req.process_group,
            process_state=server.process_state_now(),
            tracker_index=tracker_index,
            user_fds=len(user_fds),
            stdio_slots=stdio_slots,
            default_stdio=len(default_stdio),
            binary=req.binary,
            line_buffered=worker_stdio.stdout_shows_lines(),
            stacks=req.stacks,
            join_group=os.getpgrp() if req.caller_group else 0,
            mp_process=req.mp_process,
        )
        payload.append_trailer(payload_fd, header.encode())
        carried = [*user_fds, *stdio_fds, *default_stdio]
        try:
            server.send_launch(tx.fileno(), payload_fd, carried)
        except (BrokenPipeError, ConnectionResetError):
            # The zygote died after get_server() found it alive: once its
            # exit shows, the next get_server() starts a new one.
            server.wait_until_dead()
            server = client.get_server()
            server.send_launch(tx.fileno(), payload_fd, carried)
    finally:
        tx.close()
        for fd in opened:
            os.close(fd)
    return server


def _receive_workers(
    req: LaunchRequest,
    rx: Receiver,
    started: Started,
    server: client.ZygoteClient | link.RootLink,
    may_resend: bool,
) -> bool:
    """Read the workers' pidfds off the launch's channel into ``started``,
    naming their groups to the zygote's watcher as they come.  False, with
    ``may_resend``, if the channel ended before the zygote took the launch
    (nothing was said on it, nothing started) and something outside the
    zygote ended it; else True, or raise."""
    reports = rx.reports
    watched_ranks: set[int] = set()

    def watch_new_groups() -> None:
        # As they arrive, not once every pid has: should the zygote die in
        # the middle of the launch, the children of the ranks up already
        # must go too.  The zygote names the launch's group; a binary rank
        # leads a session of its own (a pid that never became a group: no
        # harm).
        if req.process_group:
            groups = [reports.group] if reports.group and not req.watched_groups else []
        else:
            new = [r for r in reports.pids if r not in watched_ranks]
            watched_ranks.update(new)
            groups = [reports.pids[r][0] for r in new]
        if groups:
            req.watched_groups += groups
            server.watch_groups(groups)

    try:
        while len(reports.pids) < req.nprocs and reports.launch_failed is None:
            if not rx.read_blocking(None) and reports.eof:
                break
            watch_new_groups()
        if may_resend and reports.eof and not reports.taken and _ended_from_outside(server):
            return False
        # Inside the try: a Ctrl-C raised as this call starts, before the
        # pidfds moved to ``started``, must not leave them open.
        _take_workers(req, rx, started, server)
        return True
    except BaseException:
        # Ctrl-C, say: kill what we heard of (pidfds already queued on the
        # channel included).  Ranks forked after this go when the zygote
        # finds the channel closed before their pidfds were through.
        try:
            rx.drain()
        finally:
            with oscall.held_signals():  # into the caller's list, which it kills too
                started += [reports.pids.pop(rank) for rank in sorted(reports.pids)]
            kill_started(started, reap=False)
            forget_groups(req.watched_groups)
        raise


def _death(server: client.ZygoteClient | link.RootLink) -> tuple[str, bool] | None:
    """How the zygote ended (ZygoteClient.how_it_died); None through a link,
    whose zygote's death is this process's own."""
    return server.how_it_died() if isinstance(server, client.ZygoteClient) else None


def _ended_from_outside(server: client.ZygoteClient | link.RootLink) -> bool:
    """Whether a SIGKILL (of the zygote or its guard) or stop_zygote() ended
    the zygote: a new one takes its launch.  One that ended itself (code
    of __main__'s at its start, a crash) would only end again."""
    death = _death(server)
    return death is not None and death[1]


def _take_workers(
    req: LaunchRequest,
    rx: Receiver,
    started: Started,
    server: client.ZygoteClient | link.RootLink,
) -> None:
    """Move the pidfds received into ``started``; raise if the launch failed."""
    reports = rx.reports
    with oscall.held_signals():  # the pidfds move from the reports to ``started``
        started += [reports.pids[rank] for rank in sorted(reports.pids)]
        reports.pids.clear()
    if reports.launch_failed is not None or len(started) < req.nprocs:
        common.end_group(req, started)
        raise _launch_error(reports.launch_failed, server)
    if req.process_group:
        req.group = reports.group


def _launch_error(
    failure: LaunchFailure | None, server: client.ZygoteClient | link.RootLink
) -> Exception:
    """What the caller raises for a launch the zygote could not start: the
    OSError subclass of the system call that failed there, as if it had
    failed here (BlockingIOError when fork met RLIMIT_NPROC); else a
    RuntimeError with the zygote's traceback, or why there is none."""
    if failure is not None and failure.errno:
        return oscall.oserror(failure.errno, failure.call)
    if failure is not None:
        return RuntimeError(f"fastspawn: the zygote could not start the workers:\n{failure.detail}")
    death = _death(server)
    why = "the zygote died during the launch"
    if death is not None:
        why += f": {death[0]}"
    if death is not None and death[1]:
        why += "; the next launch starts a new zygote"
    else:
        # Not a __main__ without the guard: that fails each rank, as under
        # spawn, and the zygote lives on (_zygote.main._failure_of).
        why += (
            "; what it printed on stderr says why. The zygote runs the code of __main__ "
            "outside `if __name__ == '__main__':`, as a spawned worker does: code there "
            "that ends the process (os._exit(), a crash in an extension) ends the zygote; "
            "move it under that guard"
        )
    return RuntimeError(f"fastspawn: the zygote could not start the workers:\n{why}")


METHOD = Zygote()
