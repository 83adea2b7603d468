"""Start methods: how the workers of one launch come to life.

Every method returns, per rank, ``(pid, pidfd, is_child)`` and leaves the
workers reporting on the launch's channel.  PR_SET_PDEATHSIG is tied to the
*thread* that forks, so launches from any thread but the main one run on a
fastspawn thread that lives as long as the process (the checkpoint client
starts workers from a pool thread that may exit right after).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from fastspawn import _channel, _oscall, _pickling, _worker
from fastspawn._channel import Receiver
from fastspawn._process import wait_readable
from fastspawn._server import ServerClient
from fastspawn._warden import Warden

T = TypeVar("T")
log = logging.getLogger(__name__)

START_METHODS = ("zygote", "spawn", "fork", "forkserver")
SPAWN_LIKE = ("zygote", "spawn", "forkserver")
DEFAULT_START_METHOD = "zygote"

_SPAWN_ENTRY = _worker.entry_code("fastspawn._worker.spawn_main")


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
        start_method: str,
        envs: Mapping[int, Mapping[str, str]] | None = None,
        preload: Sequence[str] = (),
        stdio: Mapping[int, tuple[int, int]] | None = None,
        process_group: bool = True,
        keep_stdin: bool = False,
    ) -> None:
        self.fn = fn
        self.args = args
        self.nprocs = nprocs
        self.daemon = daemon
        self.start_method = start_method
        self.envs: Mapping[int, Mapping[str, str]] = envs if envs is not None else {}
        self.preload = preload
        # rank -> (stdout fd, stderr fd) the worker gets as its fd 1 and 2
        # (-1: the caller's).  The caller keeps ownership of these fds.
        self.stdio: Mapping[int, tuple[int, int]] = stdio if stdio is not None else {}
        # Workers read /dev/null, as multiprocessing's do; with keep_stdin
        # (binary ranks) the caller's stdin instead.
        self.keep_stdin = keep_stdin
        # zygote: put the launch's workers in a process group of their own
        # (binary ranks lead a session each instead).
        self.process_group = process_group
        # The process group of the workers (0: none), and while the ranks
        # join it in a fork or spawn launch, its anchor (see _new_group).
        self.group = 0
        self.anchor = 0
        # Set by the zygote launch: the process groups to kill should the
        # zygote die (the launch's group, or each binary rank's session).
        self.watched_groups: list[int] = []

    def __repr__(self) -> str:
        return (
            f"LaunchRequest(fn={self.fn!r}, nprocs={self.nprocs}, "
            f"start_method={self.start_method!r}, group={self.group})"
        )


Started = list[tuple[int, int, bool]]


# ------------------------------------------------------------ launcher thread


class _Outcome:
    """A job's result or exception, handed from the launcher thread to the
    thread waiting for it.  (Not concurrent.futures: that import costs a
    main module that imports fastspawn, and so the zygote, a few ms.)"""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


_jobs: collections.deque[tuple[Callable[[], Any], _Outcome]] = collections.deque()
_jobs_ready = threading.Condition()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()


def _launcher_loop(mask: set[int | signal.Signals]) -> None:
    # A thread starts with its creator's mask, which may be a held one
    # (every signal blocked, see _oscall.held_signals): not for this thread,
    # whose forked workers and started programs inherit its mask.
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    while True:
        with _jobs_ready:
            while not _jobs:
                _jobs_ready.wait()
            job, outcome = _jobs.popleft()
        try:
            outcome.value = job()
        except BaseException as exc:
            outcome.error = exc
        outcome.done.set()
        del job, outcome  # hold nothing of a finished job while waiting


def on_launcher_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on a thread that outlives every caller: the main thread
    when we are on it, else fastspawn's own daemon launcher thread."""
    global _thread
    if threading.current_thread() is threading.main_thread():
        return fn(*args, **kwargs)
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(
                target=_launcher_loop,
                args=(_oscall.unheld_mask(),),
                name="fastspawn-launcher",
                daemon=True,
            )
            _thread.start()
    outcome = _Outcome()
    with _jobs_ready:
        _jobs.append((lambda: fn(*args, **kwargs), outcome))
        _jobs_ready.notify()
    value: T = outcome.result()
    return value


def _reset_after_fork() -> None:
    global _thread, _server, _jobs_ready, _thread_lock, _server_lock
    global _warden, _warden_lock, _watched
    _thread = None  # the launcher thread does not exist in a forked child
    if _server is not None:
        # Nor is the zygote ours.  Its control socket must not stay open
        # here: the zygote stops at that socket's EOF, which a forked child
        # (a "fork" worker, say) holding a copy would delay until it exits.
        _server.forget_in_child()
    _server = None
    if _warden is not None:
        _warden.forget_in_child()  # it watches the parent, not us
    _warden = None
    _warden_lock = threading.RLock()
    _watched = set()
    # A fork inside held_signals() (a "fork" worker's) leaves that block
    # behind: what this process launches gets its own mask, not the parent's.
    _oscall._outside.mask = None
    # ...and it may have held these at the fork: fresh ones, no old jobs.
    _jobs.clear()
    _jobs_ready = threading.Condition()
    _thread_lock = threading.Lock()
    # Held across a zygote's whole start by get_server(): a fork while
    # another thread starts one must not leave the child waiting for ever.
    _server_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


# ------------------------------------------------------------------- helpers


def kill_started(started: Started) -> None:
    """Undo a launch that failed half-way: kill and reap what did start."""
    for _pid, pidfd, is_child in started:
        if pidfd < 0:
            continue  # its pidfd never arrived: the zygote kills it
        try:
            _oscall.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if is_child:
            try:
                _oscall.pidfd_wait(pidfd, nohang=False)
            except ChildProcessError:
                pass
        os.close(pidfd)


def _tracker_fd() -> int | None:
    """The resource tracker's fd if one is running (children then share it)."""
    from multiprocessing import resource_tracker

    fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    return fd if isinstance(fd, int) else None


def _payload_memfd(data: bytes) -> int:
    """An anonymous, private file holding ``data``: nothing on disk to plant."""
    fd = os.memfd_create("fastspawn-payload", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ------------------------------------------------------------------- methods


def _foreground_on_a_terminal() -> bool:
    """Whether this process's group is the foreground job of its
    controlling terminal."""
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


def _new_group(req: LaunchRequest) -> int:
    """A process group for a fork or spawn launch, named to the warden, or
    0 for none.  Its anchor, in ``req.anchor``, is for the caller's
    ``finally`` to release (_release_anchor) once the ranks have joined:
    call this inside the ``try``, so that an interrupt delivered as it
    returns is cleaned up too.

    None when the caller is the foreground job of a terminal: a group of
    their own would be a background job there, stopped (SIGTTOU) by a write
    under ``stty tostop`` or by any change of the terminal's modes (getpass),
    where multiprocessing's workers, in the caller's group, are not.  There
    the workers stay in the caller's group, and a Ctrl-C reaches them too.
    A background job's get a group (and a warden, against an OOM kill of a
    `nohup ... &` run): there a worker stopped by SIGTTOU stays stopped when
    `fg` continues the job (README, "Where fastspawn differs")."""
    if _foreground_on_a_terminal():
        return 0
    with _oscall.held_signals():  # an anchor no one knows of stays a zombie
        group = req.anchor = req.group = _oscall.group_anchor()
        req.watched_groups = [group]
        watch_group(group)
    return group


def _release_anchor(req: LaunchRequest) -> None:
    """Reap ``req``'s anchor, if not done yet: inside the held signals of
    the last rank's start, or in a ``finally`` when the launch failed."""
    anchor, req.anchor = req.anchor, 0
    if anchor:
        _oscall.release_group_anchor(anchor)


def _end_group(req: LaunchRequest, started: Started) -> None:
    """A launch failed half-way: kill and reap what started (``started`` is
    emptied: its pidfds are closed), drop its group."""
    try:
        kill_started(started)
        started.clear()
    finally:
        forget_groups(req.watched_groups)
        req.group = 0
        req.watched_groups = []


def _launch_fork(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    parent = os.getpid()
    channel = _worker.channel_identity(tx)
    match_threads = _worker.torch_threads_to_match(req.envs)
    _worker.flush_std_streams()
    try:
        group = _new_group(req)
        for rank in range(req.nprocs):
            held = _oscall.held_signals()
            with held:  # from the fork until the worker is in ``started``
                pid = os.fork()
                if pid == 0:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held.previous)
                    _in_fork_worker(req, rank, parent, tx, rx, group, channel, match_threads)
                if group:
                    try:
                        os.setpgid(pid, group)
                    except (PermissionError, ProcessLookupError):
                        pass  # it did already, and may have moved on
                try:
                    pidfd = _oscall.pidfd_open(pid)
                except BaseException:
                    os.kill(pid, signal.SIGKILL)  # unreaped: still ours
                    os.waitpid(pid, 0)
                    raise
                started.append((pid, pidfd, True))
                if rank == req.nprocs - 1:
                    _release_anchor(req)  # here, with the signals still held
    except BaseException:
        _end_group(req, started)
        raise
    finally:
        _release_anchor(req)


def _in_fork_worker(
    req: LaunchRequest,
    rank: int,
    parent: int,
    tx: socket.socket,
    rx: Receiver,
    group: int,
    channel: tuple[int, int],
    match_threads: bool,
) -> NoReturn:
    # Set in both processes, as shells do, so that neither order of running
    # leaves a gap.
    if group:
        try:
            os.setpgid(0, group)
        except OSError:
            pass  # the parent did; or a stranger reaped the anchor
    _worker.forked_child(
        rank,
        parent,
        req.fn,
        req.args,
        tx,
        daemon=req.daemon,
        rank_env=req.envs.get(rank),
        close_fds=[rx.fileno()],
        stdio=req.stdio.get(rank),
        stdin=None if req.keep_stdin else -1,
        channel=channel,
        match_torch_threads=match_threads,
    )


def _launch_spawn(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    collector = _pickling.FdCollector()
    preparation = _worker.preparation_data("fastspawn-worker")
    payload = _pickling.dumps([preparation, (req.fn, req.args)], collector)
    tracker = _tracker_fd()
    argv = [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        _SPAWN_ENTRY,
    ]
    base_env = dict(os.environ)
    _worker.flush_std_streams()
    payload_fd = -1
    try:
        with _oscall.held_signals():  # made and recorded, for the finally to close
            payload_fd = _payload_memfd(payload)
        del payload
        tail = [str(payload_fd), str(tx.fileno()), "1" if req.daemon else "0", str(tracker or -1)]
        tail += [str(fd) for fd in collector.fds]
        keep = [payload_fd, tx.fileno(), *collector.fds]
        keep += [tracker] if tracker is not None else []
        group = _new_group(req)
        for rank in range(req.nprocs):
            env = {**base_env, **req.envs.get(rank, {})}
            out, err = req.stdio.get(rank, (-1, -1))
            with _oscall.held_signals():  # until the worker is in ``started``
                pid, pidfd = _oscall.launch(
                    sys.executable,
                    argv + [str(rank)] + tail,
                    env,
                    stdout=out,
                    stderr=err,
                    keep_fds=keep,
                    pdeathsig=signal.SIGKILL,
                    process_group=group,
                )
                started.append((pid, pidfd, True))
                if rank == req.nprocs - 1:
                    _release_anchor(req)  # here, with the signals still held
    except BaseException:
        _end_group(req, started)
        raise
    finally:
        if payload_fd >= 0:
            os.close(payload_fd)
        _release_anchor(req)


_server: ServerClient | None = None
_server_lock = threading.Lock()
_warden: Warden | None = None
# The groups of fork and spawn launches not yet reaped: what the warden kills
# should we die.  Reentrant: a finalizer that ends a context may run (in a
# garbage collection) while this thread holds it.
_watched: set[int] = set()
_warden_lock = threading.RLock()


def watch_group(group: int) -> None:
    """Name a fork or spawn launch's process group to the warden, started
    on first use (or again, with every group, should it have died)."""
    global _warden
    with _warden_lock:
        _watched.add(group)
        try:
            if _warden is not None:
                try:
                    _warden.send([f"+{group}"])
                    return
                except OSError:
                    _warden.close()
                    _warden = None
            _warden = Warden()
            _warden.send([f"+{watched}" for watched in sorted(_watched)])
        except BaseException:
            _watched.discard(group)
            raise


def env_preload() -> list[str]:
    """Modules named by FASTSPAWN_PRELOAD (comma- or space-separated)."""
    raw = os.environ.get("FASTSPAWN_PRELOAD", "")
    return [name for name in raw.replace(",", " ").split() if name]


def get_server() -> ServerClient:
    """The caller's zygote, started on first use or after it died."""
    global _server
    with _server_lock:
        if _server is not None and not _server.alive():
            log.warning(
                "fastspawn: the zygote (pid %d) died; starting a new one",
                _server.zygote_pid(0) or _server.pid,
            )
            _server.close()
            _server = None
        if _server is None:
            _oscall.require_pidfds()
            with _oscall.held_signals():  # a zygote started is a zygote held
                _server = ServerClient(env_preload())
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
    get_server().send({"op": "preload", "modules": names})


def stop_server() -> None:
    """Stop the zygote, if one runs; the next launch starts a new one."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


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


def _launch_zygote(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    cwd = current_dir()
    collector = _pickling.FdCollector()
    work = _pickling.dumps([(req.fn, req.args)], collector)
    tracker = _tracker_fd()
    tracker_index = None
    if tracker is not None:
        tracker_index = collector.duplicate_for_child(tracker)
    header = {
        "preload": list(req.preload),
        "sys_path": list(sys.path),
        "nprocs": req.nprocs,
        "daemon": req.daemon,
        "env": dict(os.environ),
        "cwd": cwd,
        "envs": {rank: dict(env) for rank, env in req.envs.items()},
        "tracker_index": tracker_index,
        "process_group": req.process_group,
    }
    # Per-rank stdio fds follow the launch message, at most MAX_FDS a message.
    stdio_fds: list[int] = []
    stdio_slots: list[tuple[int, int]] = []  # (rank, 1 or 2), one per fd
    for rank, pair in sorted(req.stdio.items()):
        for stream, fd in zip((1, 2), pair, strict=True):
            if fd >= 0:
                stdio_slots.append((rank, stream))
                stdio_fds.append(fd)
    header["stdio_slots"] = stdio_slots
    server = get_server()
    header["process_state"] = server.process_state_now()
    default_stdio, opened = _caller_stdio(req.keep_stdin)
    header["default_stdio"] = len(default_stdio)
    # The fds the arguments carry, then the stdio fds, then the caller's
    # stdio, MAX_FDS a message at most (the kernel passes 253 a message; a
    # model shared for Hogwild training carries one per tensor).
    header["user_fds"] = len(collector.fds)
    # The header goes first in the payload memfd: a control message holds
    # about 200 KB, which a large environment or per-rank envs exceed.
    try:
        payload_fd = _payload_memfd(pickle.dumps(header, pickle.HIGHEST_PROTOCOL) + work)
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    try:
        for attempt in (1, 2):
            if attempt == 2:
                server = get_server()
            try:
                with server.lock:
                    if server.closed:  # fastspawn.stop_zygote() in another thread
                        raise BrokenPipeError("the zygote was stopped")
                    # One message for the launch, whatever nprocs is; fds
                    # beyond what it holds follow in messages of their own.
                    carried = [*collector.fds, *stdio_fds, *default_stdio]
                    first = _channel.MAX_FDS - 2
                    server.send(
                        {"op": "launch"}, [tx.fileno(), payload_fd, *carried[:first]], locked=True
                    )
                    if len(carried) > first:
                        # Once the launch message is out, the rest must follow:
                        # a Ctrl-C in between would leave the zygote waiting
                        # for fds and reading the next launch as those.
                        # Signals wait (pending) until they are sent.
                        masked = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
                        try:
                            for start in range(first, len(carried), _channel.MAX_FDS):
                                chunk = carried[start : start + _channel.MAX_FDS]
                                server.send({"op": "fds"}, chunk, locked=True)
                        finally:
                            signal.pthread_sigmask(signal.SIG_SETMASK, masked)
                break
            except (BrokenPipeError, ConnectionResetError):
                if attempt == 2:
                    raise
                # The zygote died after get_server() found it alive: once its
                # exit shows on the pidfd, the next call starts a new one.
                # (Stopped, its pidfd is closed, and get_server() knows.)
                with server.lock:
                    if not server.closed:
                        wait_readable([server.pidfd], 10.0)
    finally:
        os.close(payload_fd)
        for fd in opened:
            os.close(fd)
        # Our copy must go before we wait: if the zygote dies, the channel's
        # EOF is how we learn it.
        tx.close()
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
            with server.lock:
                server.groups.update(groups)

    try:
        while len(reports.pids) < req.nprocs and reports.launch_failed is None:
            if not rx.read_blocking(None) and reports.eof:
                break
            watch_new_groups()
    except BaseException:
        # Ctrl-C, say: kill what we heard of (pidfds already queued on the
        # channel included).  Ranks forked after this go when the zygote
        # finds the channel closed before their pidfds were through.
        try:
            rx.drain()
        finally:
            kill_started([reports.pids[rank] + (False,) for rank in sorted(reports.pids)])
            reports.pids.clear()
            forget_groups(req.watched_groups)
        raise
    with _oscall.held_signals():  # the pidfds move from the reports to ``started``
        started += [reports.pids[rank] + (False,) for rank in sorted(reports.pids)]
        reports.pids.clear()
    if reports.launch_failed is not None or len(started) < req.nprocs:
        _end_group(req, started)
        why = reports.launch_failed or (
            "the zygote died during the launch; what it printed on stderr says why "
            "(a __main__ that starts processes without an `if __name__ == '__main__':` "
            "guard is a common cause)"
        )
        raise RuntimeError(f"fastspawn: the zygote could not start the workers:\n{why}")
    if req.process_group:
        req.group = reports.group


_METHODS: dict[str, Callable[[LaunchRequest, socket.socket, Receiver, Started], None]] = {
    "fork": _launch_fork,
    "spawn": _launch_spawn,
    "forkserver": _launch_zygote,  # our forkserver is the zygote
    "zygote": _launch_zygote,
}


def launch(req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
    """Start every rank of ``req``, each entered in ``started`` as it starts
    (the caller's list: whatever interrupts us, the caller knows what to
    clean up); on failure nothing is left running, and ``started`` is empty."""
    _oscall.require_pidfds()
    if req.start_method in ("fork", "spawn") and _children_discarded():
        raise RuntimeError(
            f"fastspawn: start_method={req.start_method!r} needs the workers' exit "
            "statuses, and this process ignores SIGCHLD (SIG_IGN), so the kernel "
            "discards them; restore the default first (signal.signal(signal.SIGCHLD, "
            "signal.SIG_DFL)), or use start_method='zygote', whose workers are the "
            "zygote's children"
        )
    if req.start_method == "spawn":
        current_dir()  # its workers start there: a clear error if it is gone
        # (the zygote's launch reads it for its header, with the same check)
    method = _METHODS[req.start_method]
    if req.start_method in ("zygote", "forkserver"):
        method(req, tx, rx, started)  # the zygote does the forking
    else:
        on_launcher_thread(method, req, tx, rx, started)


def _children_discarded() -> bool:
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


def forget_groups(groups: Sequence[int]) -> None:
    """A launch's workers are all reaped: its groups need no cleanup now."""
    server = _server
    if server is not None and groups:
        with server.lock:
            server.groups.difference_update(groups)
    if not groups:
        return
    with _warden_lock:
        mine = [group for group in groups if group in _watched]
        if not mine:
            return
        _watched.difference_update(mine)
        if _warden is not None:
            try:
                _warden.send([f"-{group}" for group in mine])
            except OSError:
                pass  # gone: it kills nothing, and the next launch replaces it


def helper_processes() -> tuple[set[int], set[int]]:
    """(pids, fds) of fastspawn's long-lived helpers in this process: the
    zygote (and its guard) and its control socket.  Leak checks leave these
    alone."""
    server = _server
    if server is None or server.owner != os.getpid():
        return set(), set()
    fds = {server.control.fileno(), server.pidfd, server.zygote_fd} - {-1}
    zygote = server.zygote_pid()
    return {server.pid} | ({zygote} if zygote is not None else set()), fds


def zygote_pid() -> int | None:
    """The pid of this process's zygote proper (the workers' parent; its
    guard is the process this one started), if one runs."""
    server = _server
    if server is None or server.owner != os.getpid():
        return None
    return server.zygote_pid()


def warden_process() -> tuple[set[int], set[int]]:
    """(pids, fds) of this process's warden, as helper_processes()."""
    warden = _warden
    if warden is None or warden.owner != os.getpid():
        return set(), set()
    return {warden.pid}, {warden.control.fileno(), warden.pidfd} - {-1}
