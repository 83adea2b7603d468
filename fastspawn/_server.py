"""The fork server: a fresh interpreter that forks workers on request.

The caller starts it once (a clean exec, so it inherits none of the caller's
threads, locks or CUDA state) and sends it one message per launch, whatever
the number of ranks: the payload (fn and args, pickled once) travels as a
memfd, the launch's report channel and any fds the arguments carry as
SCM_RIGHTS.  The server unpickles once and forks every rank from that state.

Chain of custody, so that nothing outlives the caller:
- the server has PR_SET_PDEATHSIG(SIGKILL) against the caller (armed before
  exec) and also watches its control socket: EOF means the caller is gone,
  and it kills every worker before exiting;
- each worker has PR_SET_PDEATHSIG(SIGKILL) against the single-threaded
  server, re-checked after prctl.

The control channel is an inherited socketpair: there is no name to connect
to.  Exit statuses go back on each launch's channel, sent without blocking
(the caller may not be reading) and queued until the caller drains it.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from fastspawn import _channel, _oscall, _pickling, _worker

log = logging.getLogger(__name__)

_ENTRY = "from fastspawn._server import main; main()"
_MAX_HEADER = 1 << 20


# ---------------------------------------------------------------- server side


class _Launch:
    """One launch inside the server: its channel and unsent reports."""

    def __init__(self, tx: socket.socket, nprocs: int) -> None:
        self.tx = tx
        self.live = nprocs
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.watching_out = False

    def queue(self, rank: int, kind: int, body: bytes, fds: Sequence[int] = ()) -> None:
        header = _channel.HEADER.pack(rank, kind, _channel.LAST)
        self.outbox.append((header + body, list(fds)))

    def flush(self) -> bool:
        """Send what the channel takes now; True when all is sent."""
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
                for _, pending in self.outbox:
                    for fd in pending:
                        os.close(fd)
                self.outbox.clear()
                return True
            self.outbox.popleft()
            for fd in fds:
                os.close(fd)
        return True

    @property
    def done(self) -> bool:
        return self.live == 0 and not self.outbox


class _Server:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.parent = os.getppid()
        self.me = os.getpid()
        self.epoll = select.epoll()
        self.epoll.register(control.fileno(), select.EPOLLIN)
        self.workers: dict[int, tuple[_Launch, int, int]] = {}  # pidfd -> (launch, rank, pid)
        self.channels: dict[int, _Launch] = {}  # tx fd -> launch

    def own_fds(self) -> list[int]:
        return [self.control.fileno(), self.epoll.fileno(), *self.workers, *self.channels]

    def serve(self) -> None:
        while True:
            try:
                events = self.epoll.poll()
            except InterruptedError:
                continue
            for fd, mask in events:
                if fd == self.control.fileno():
                    if not self.on_control():
                        return
                elif fd in self.workers:
                    self.on_exit(fd)
                elif fd in self.channels:
                    self.on_writable(self.channels[fd])

    def on_control(self) -> bool:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.control, _MAX_HEADER, 256)
        except (ConnectionResetError, OSError):
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        self.launch(pickle.loads(data), fds)
        return True

    def launch(self, header: Mapping[str, Any], fds: list[int]) -> None:
        tx = socket.socket(fileno=fds[0])
        payload_fd = fds[1]
        user_fds = fds[2:]
        nprocs = int(header["nprocs"])
        launch = _Launch(tx, nprocs)
        fn: Any = None
        args: Any = ()
        payload_error = None
        try:
            # Take on the caller's current environment and cwd before
            # unpickling: imports run here, and must see what a spawned
            # interpreter would.  The workers inherit both.
            os.environ.clear()
            os.environ.update(header["env"])
            os.chdir(header["cwd"])
            _pickling.inherited_fds[:] = user_fds
            if header["tracker_index"] is not None:
                from multiprocessing import resource_tracker

                tracker = user_fds[header["tracker_index"]]
                resource_tracker._resource_tracker._fd = os.dup(tracker)  # type: ignore[attr-defined]
            with _worker.read_payload(payload_fd) as payload:
                fn, args = pickle.load(payload)
        except BaseException:
            payload_error = traceback.format_exc()
        finally:
            for fd in user_fds:
                os.close(fd)  # unpickled objects hold their own dups
            _pickling.inherited_fds[:] = []

        envs: Mapping[int, Mapping[str, str]] = header["envs"]
        sys.stdout.flush()
        sys.stderr.flush()
        pids: list[int] = []
        pidfds: list[int] = []
        try:
            for rank in range(nprocs):
                pid = os.fork()
                if pid == 0:
                    _worker.reseed()
                    _worker.forked_child(
                        rank,
                        self.me,
                        fn,
                        args,
                        tx,
                        daemon=bool(header["daemon"]),
                        rank_env=envs.get(rank),
                        payload_error=payload_error,
                        close_fds=self.own_fds(),
                    )
                pidfd = _oscall.pidfd_open(pid)
                pids.append(pid)
                pidfds.append(pidfd)
                self.workers[pidfd] = (launch, rank, pid)
                self.epoll.register(pidfd, select.EPOLLIN)
        except BaseException:
            launch.queue(-1, _channel.LAUNCH_FAILED, traceback.format_exc().encode())
            for pidfd in pidfds:
                try:
                    _oscall.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launch.live = len(pidfds)
        del fn, args
        for start in range(0, len(pids), _channel.MAX_FDS):
            chunk = pidfds[start : start + _channel.MAX_FDS]
            body = _channel.pack_statuses(pids[start : start + _channel.MAX_FDS])
            launch.queue(start, _channel.PIDS, body, [os.dup(fd) for fd in chunk])
        self.channels[tx.fileno()] = launch
        self.on_writable(launch)

    def on_exit(self, pidfd: int) -> None:
        launch, rank, _pid = self.workers.pop(pidfd)
        self.epoll.unregister(pidfd)
        try:
            status = _oscall.pidfd_wait(pidfd, nohang=False)
        except ChildProcessError:  # pragma: no cover - nobody else reaps
            status = -signal.SIGKILL
        os.close(pidfd)
        launch.live -= 1
        launch.queue(rank, _channel.EXIT, _channel.pack_statuses([rank, status or 0]))
        self.on_writable(launch)

    def on_writable(self, launch: _Launch) -> None:
        fd = launch.tx.fileno()
        sent = launch.flush()
        if sent and launch.watching_out:
            self.epoll.modify(fd, 0)
            launch.watching_out = False
        elif not sent and not launch.watching_out:
            if fd in self.channels:
                try:
                    self.epoll.register(fd, select.EPOLLOUT)
                except FileExistsError:
                    self.epoll.modify(fd, select.EPOLLOUT)
            launch.watching_out = True
        if launch.done:
            if fd in self.channels:
                del self.channels[fd]
                try:
                    self.epoll.unregister(fd)
                except (FileNotFoundError, OSError):
                    pass
            launch.tx.close()

    def shutdown(self) -> None:
        """The caller is gone: kill every worker, reap, exit."""
        for pidfd in list(self.workers):
            try:
                _oscall.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pidfd in list(self.workers):
            try:
                _oscall.pidfd_wait(pidfd, nohang=False)
            except OSError:
                pass


def main() -> None:
    """Entry of the server process: ``python -c ... <control fd>``."""
    control = socket.socket(fileno=int(sys.argv[1]))
    # The first message is the caller's spawn preparation data and preloads.
    data = control.recv(_MAX_HEADER)
    if not data:
        return
    hello = pickle.loads(data)
    from multiprocessing import spawn

    spawn.prepare(hello["preparation"])
    for name in hello["preload"]:
        try:
            __import__(name)
        except Exception:
            traceback.print_exc()
    server = _Server(control)
    try:
        server.serve()
    finally:
        server.shutdown()


# ---------------------------------------------------------------- caller side


class ServerClient:
    """The caller's handle on its fork server (one per caller process)."""

    def __init__(self, preload: Sequence[str] = ()) -> None:
        from multiprocessing import spawn

        from fastspawn._launch import on_launcher_thread

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [
                sys.executable,
                *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
                "-c",
                _ENTRY,
                str(theirs.fileno()),
            ]
            # Launched from a thread that lives as long as the process, since
            # PR_SET_PDEATHSIG follows the launching thread.
            self.pid, self.pidfd = on_launcher_thread(
                _oscall.launch,
                sys.executable,
                argv,
                dict(os.environ),
                keep_fds=[theirs.fileno()],
                pdeathsig=signal.SIGKILL,
            )
        finally:
            theirs.close()
        self.control = mine
        self.owner = os.getpid()
        self.lock = threading.Lock()
        hello = {
            "preparation": spawn.get_preparation_data("fastspawn-server"),
            "preload": list(preload),
        }
        # The authkey inside pickles only while "spawning", as for spawn.
        self.control.sendall(_pickling.dumps([hello], _pickling.FdCollector()))

    def alive(self) -> bool:
        return os.getpid() == self.owner and _oscall.pidfd_wait(self.pidfd, nohang=True) is None

    def request(self, header: Mapping[str, Any], fds: Sequence[int]) -> None:
        data = pickle.dumps(dict(header), pickle.HIGHEST_PROTOCOL)
        with self.lock:
            socket.send_fds(self.control, [data], list(fds))

    def close(self) -> None:
        """Stop the server (EOF on its control socket) and reap it."""
        if os.getpid() != self.owner:
            return
        self.control.close()
        try:
            _oscall.pidfd_wait(self.pidfd, nohang=False)
        except ChildProcessError:
            pass
        os.close(self.pidfd)
