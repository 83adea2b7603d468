"""The caller's side of the zygote (see fastspawn._zygote): its handle, started on
first use and held for the process's lifetime, and ``preload`` /
``stop_zygote``.

The caller starts the zygote's guard (which forks the zygote proper), says
Hello, then sends one LAUNCH message per launch (see .protocol).  A
watcher thread waits for the zygote's exit, to kill the process groups of
the launches still running then.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from fastspawn._os import hugepages, oscall, procstate
from fastspawn._os.children import children_of
from fastspawn._os.helper import HelperClient
from fastspawn._os.oscall import wait_readable
from fastspawn._worker import spawned as worker_spawned
from fastspawn._zygote import link, protocol
from fastspawn._zygote.ready import READY_NAME

log = logging.getLogger(__name__)

# The arenas' region is placed before the zygote imports anything else.
_ENTRY = worker_spawned.entry_code(
    f"{protocol.MAIN_MODULE}.main",
    first=f"from {hugepages.__name__} import place_arenas; place_arenas()",
)


class ZygoteClient(HelperClient, link.Sender):
    """The caller's handle on its zygote (one per caller process)."""

    def __init__(self, preload: Sequence[str] = ()) -> None:
        # What the zygote inherits now; a launch sends what changed since.
        self.process_state = procstate.capture()
        flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
        super().__init__([*flags, "-c", _ENTRY], pdeathsig=signal.SIGTERM)
        self.lock = threading.Lock()
        self.dead = threading.Event()
        # Set (under ``lock``) by close(): a launch that comes after finds
        # it, rather than a closed socket or a pidfd number reused since.
        self.closed = False
        self._zygote_pid: int | None = None  # see zygote_pid()
        self.zygote_fd = -1  # the watcher's pidfd of it
        # The guard's exit status, once the watcher reaped it: the zygote's
        # own exit code, 128 + the signal that killed it, or minus the
        # signal that killed the guard (see how_it_died).
        self.guard_status: int | None = None
        # Process groups of launches whose workers may still run (as the
        # zygote names them); added by the launcher, dropped when joined.
        self.groups: set[int] = set()
        try:
            hello = protocol.Hello(worker_spawned.preparation_data("fastspawn-zygote"), preload)
            self.control.sendall(hello.encode())
            self.watcher = threading.Thread(
                target=self._watch, name="fastspawn-zygote-watch", daemon=True
            )
            oscall.start_quiet_thread(self.watcher)
        except BaseException:
            # No one will hold this zygote: stop it now (a Ctrl-C while the
            # main module's preparation data is gathered, say).
            self.control.close()
            self.kill_and_reap()
            raise

    def zygote_pid(self, timeout: float = 10.0) -> int | None:
        """The pid of the zygote proper, the workers' parent: the only child
        of the process we started (its guard), once it has forked it.  None
        if it did not appear in ``timeout`` seconds (or is gone)."""
        if self._zygote_pid is None:
            deadline = time.monotonic() + timeout
            pause = 0.001
            while not (children := children_of(self.pid)):
                if time.monotonic() > deadline or self.dead.is_set():
                    return None
                # Backing off: the zygote's start is what this waits for,
                # and it needs the CPU more than this loop does.  The guard's
                # exit ends the wait (killed before it forked, or its start
                # failed): no zygote comes then, and the watcher, which
                # waits here first, must go on to reap it.
                if wait_readable([self.pidfd], pause):
                    return None
                pause = min(pause * 2, 0.02)
            self._zygote_pid = min(children)
        return self._zygote_pid

    def helper_fds(self) -> set[int]:
        return super().helper_fds() | ({self.zygote_fd} - {-1})

    def process_state_now(self) -> dict[str, Any]:
        """The caller's umask, CPU affinity, nice value and resource limits
        that differ from the zygote's (what it had when the zygote started)."""
        return procstate.changed(self.process_state, procstate.capture())

    def _watch(self) -> None:
        """Wait for the zygote to exit; then kill its process group (workers
        and their children) before reaping it, so the id cannot be reused."""
        self._open_zygote_fd()
        while not wait_readable([self.pidfd], None):
            pass
        if self.zygote_fd >= 0:
            # The guard died first (SIGKILLed): the zygote, told by
            # PR_SET_PDEATHSIG, stops every worker and adopts and kills their
            # children, daemons too.  Let it, before the groups' SIGKILL
            # takes it and leaves those to init.
            wait_readable([self.zygote_fd], 5.0)
        else:
            # The guard died before this thread learned the zygote's pid (a
            # start cut short, this thread slow to run): the zygote may be
            # shutting down all the same, in the guard's group.  The same
            # time for it, watching the group empty (a chaos round on 3.10
            # saw a launch's grandchildren left to init without this).
            deadline = time.monotonic() + 5.0
            while _group_has_live_members(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        with self.lock:
            groups = [self.pid, *self.groups]
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._reap_adopted_zygote()
        try:
            self.guard_status = oscall.pidfd_wait(self.pidfd, nohang=False)
        except ChildProcessError:
            pass
        self.dead.set()

    def how_it_died(self, timeout: float = 5.0) -> tuple[str, bool] | None:
        """Why the zygote is gone, once the watcher saw it go (None if that
        does not come within ``timeout`` seconds): what to say, and whether
        something outside it ended it (a SIGKILL of it or of its guard,
        stop_zygote()), not its own code."""
        if not self.dead.wait(timeout):
            return None
        if self.closed:
            return "fastspawn.stop_zygote() stopped it", True
        status = self.guard_status
        if status is None:
            return None
        if status < 0:
            return f"its guard, pid {self.pid}, was killed by {_signal_name(-status)}", True
        zygote = f"it, pid {self._zygote_pid}," if self._zygote_pid else "it"
        if status > 128 and status - 128 in signal.valid_signals():
            if status - 128 == signal.SIGKILL:
                return (
                    f"{zygote} was killed by SIGKILL, by the kernel's OOM killer when memory "
                    "ran out (`dmesg` says so) or by another process",
                    True,
                )
            return f"{zygote} was killed by {_signal_name(status - 128)}", False
        return f"{zygote} exited with status {status}", False

    def _open_zygote_fd(self) -> None:
        """A pidfd of the zygote proper, opened while its guard (our child,
        alive, unreaped) lists it as its child: the pid is still its."""
        zygote = self.zygote_pid()
        if zygote is None:
            return
        try:
            fd = oscall.pidfd_open(zygote)
        except OSError:
            return
        if zygote not in children_of(self.pid):
            os.close(fd)
            return
        self.zygote_fd = fd

    def _reap_adopted_zygote(self) -> None:
        """A caller that is a child subreaper (or a container's init)
        adopted the zygote as its guard died: reap it (it is in the guard's
        group, killed by the watcher), or it stays a zombie here."""
        if self.zygote_fd < 0:
            return
        try:
            oscall.pidfd_wait(self.zygote_fd, nohang=False)
        except ChildProcessError:
            pass  # not ours: init's, or the guard reaped it
        os.close(self.zygote_fd)
        self.zygote_fd = -1

    def forget_in_child(self) -> None:
        super().forget_in_child()
        try:
            os.close(self.zygote_fd)
        except OSError:
            pass

    def alive(self) -> bool:
        """Whether the zygote runs.  Its pidfd is checked directly: the
        watcher thread may not have run yet since the zygote died."""
        if not self.owned_here() or self.dead.is_set():
            return False
        if wait_readable([self.pidfd], 0):
            self.dead.wait(10)  # let the watcher kill the groups and reap
            return False
        return True

    def wait_until_dead(self) -> None:
        """After a failed send: once the zygote's exit shows on its pidfd,
        the next get_server() starts a new one.  (Stopped, its pidfd is
        closed, and get_server() knows.)"""
        with self.lock:
            if not self.closed:
                wait_readable([self.pidfd], 10.0)

    def watch_groups(self, groups: Sequence[int]) -> None:
        """Process groups of a launch to kill should the zygote die."""
        with self.lock:
            self.groups.update(groups)

    def forget_groups(self, groups: Sequence[int]) -> None:
        with self.lock:
            self.groups.difference_update(groups)

    def close(self) -> None:
        """Stop the zygote (EOF on its control socket) and reap it."""
        if not self.owned_here():
            return
        with self.lock:
            if self.closed:
                return  # once: the pidfd's number may be another fd's now
            self.closed = True
            self.control.close()
        self.dead.wait(30)
        if not self.dead.is_set():  # pragma: no cover - a wedged zygote
            os.kill(self.pid, signal.SIGKILL)
            self.dead.wait(30)
        self.watcher.join(5)
        os.close(self.pidfd)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _group_has_live_members(group: int) -> bool:
    """Whether a process that is not a zombie is in process group ``group``
    (a scan of /proc: for the rare case above only)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, _ppid, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == group and state != b"Z":
            return True
    return False


# ------------------------------------------------------------ the caller's one

_server: ZygoteClient | link.RootLink | None = None
# Held across a zygote's whole start by get_server().
_server_lock = threading.Lock()


def env_preload() -> list[str]:
    """Modules named by FASTSPAWN_PRELOAD (comma- or space-separated)."""
    raw = os.environ.get("FASTSPAWN_PRELOAD", "")
    return [name for name in raw.replace(",", " ").split() if name]


def get_server() -> ZygoteClient | link.RootLink:
    """The caller's zygote, started on first use or after it died; in a
    multiprocessing process of a zygote, the link to that one."""
    global _server
    with _server_lock:
        if _server is None:
            _server = link.take()  # a multiprocessing process's, from its zygote
        elif isinstance(_server, link.RootLink) and not _server.alive():
            _server = None  # closed (stop_zygote()): a zygote of our own from now on
        if isinstance(_server, ZygoteClient) and not _server.alive():
            log.warning(
                "fastspawn: the zygote (pid %d) died; starting a new one",
                _server.zygote_pid(0) or _server.pid,
            )
            _server.close()
            _server = None
        if _server is None:
            oscall.require_pidfds()
            with oscall.held_signals():  # a zygote started is a zygote held
                _server = ZygoteClient(env_preload())
        return _server


def preload(modules: Sequence[str]) -> None:
    """Start the zygote now, and import ``modules`` in it in the background.

    Nothing happens while this process is itself being prepared from the
    caller's main module (the zygote, a spawned worker): a script that calls
    preload() or patch_torch() at top level, outside its ``__main__`` guard,
    runs that call there too, and must not start a zygote of its own.
    """
    names = list(modules)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"preload takes module names (str), got {name!r}")
    from multiprocessing import process

    if getattr(process.current_process(), "_inheriting", False):
        return
    get_server().send(protocol.ControlMessage(protocol.PRELOAD, names))


def prefork(n: int, *, refill: bool = True) -> int:
    """Make ``n`` workers ready in the zygote (started now if need be), so
    that a launch's first ``n`` ranks need no fork; return once they are
    ready, with how many are (fewer than ``n`` only where the limits stop
    it: a quarter of RLIMIT_NPROC, memory running short, fds).

    ``refill``: keep at least ``n`` ready, making them again after each
    launch that took them, and make as many ready again as each ended
    launch had, up to FASTSPAWN_READY (default 256), in the background;
    that is what a zygote does by itself from its start.  False: ``n`` now
    and none made ready after; ``prefork(0, refill=False)`` turns ready
    workers off.  See docs/performance.md.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"prefork() takes a number of workers (int), got {n!r}")
    if n < 0:
        raise ValueError(f"prefork() takes a number of workers >= 0, got {n}")
    from multiprocessing import process

    if getattr(process.current_process(), "_inheriting", False):
        return 0  # being prepared from the caller's main module: see preload()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with theirs:
            message = protocol.ControlMessage(protocol.PREFORK, count=n, refill=refill)
            get_server().send(message, [theirs.fileno()])
        answer = ours.recv(16)
    if len(answer) != _READY_COUNT.size:
        raise RuntimeError(
            "fastspawn: the zygote ended before it had the workers ready; see its error "
            "above, if any, and try again (the next launch starts a new zygote)"
        )
    return int(_READY_COUNT.unpack(answer)[0])


_READY_COUNT = struct.Struct("=i")  # the zygote's answer to prefork (Zygote.prefork)


def stop_server() -> None:
    """Stop the zygote, if one runs; the next launch starts a new one."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def forget_groups(groups: Sequence[int]) -> None:
    """A launch's workers are all reaped: its groups need no cleanup now."""
    server = _server
    if server is not None:
        server.forget_groups(groups)


def helper_processes() -> tuple[set[int], set[int]]:
    """(pids, fds) of fastspawn's long-lived helpers in this process: the
    zygote (and its guard) and its control socket.  Leak checks leave these
    alone."""
    server = _server
    if server is None or not server.owned_here():
        return set(), set()
    if isinstance(server, link.RootLink):
        return set(), server.helper_fds()  # the zygote is not ours to count
    zygote = server.zygote_pid()
    if zygote is None:
        return {server.pid}, server.helper_fds()
    return {server.pid, zygote} | ready_workers(zygote), server.helper_fds()


def ready_workers(zygote: int) -> set[int]:
    """The zygote's ready workers (see fastspawn._zygote.ready) as they
    are now: its children waiting under their name."""
    return _children_named(zygote, READY_NAME)


def spare_group(zygote: int) -> set[int]:
    """The anchor of the zygote's spare process group, if it has made one
    (see Forker.make_spare_group): a zombie child, no helper (it runs
    nothing)."""
    return _children_named(zygote, oscall.ANCHOR_NAME)


def held_ahead(zygote: int) -> set[int]:
    """The zygote's children made ahead of launches, none a worker: its
    ready workers and its spare group's anchor.  Leak checks leave them
    alone."""
    return _children_named(zygote, READY_NAME, oscall.ANCHOR_NAME)


def _children_named(zygote: int, *names: str) -> set[int]:
    """The zygote's children that have one of ``names`` now."""
    wanted = {name.encode() for name in names}
    found = set()
    for pid in children_of(zygote):
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                if f.read().strip() in wanted:
                    found.add(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def zygote_pid() -> int | None:
    """The pid of this process's zygote proper (the workers' parent; its
    guard is the process this one started), if one runs."""
    server = _server
    if server is None or not server.owned_here():
        return None
    return server.zygote_pid()


def _reset_after_fork() -> None:
    global _server, _server_lock
    if _server is not None:
        # Nor is the zygote ours.  Its control socket must not stay open
        # here: the zygote stops at that socket's EOF, which a forked child
        # (a "fork" worker, say) holding a copy would delay until it exits.
        _server.forget_in_child()
    _server = None
    # Held across a zygote's whole start by get_server(): a fork while
    # another thread starts one must not leave the child waiting for ever.
    _server_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
