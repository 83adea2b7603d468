"""Python face of the C core: errno-honest wrappers, one helper for errors."""

from __future__ import annotations

import errno
import math
import os
import select
from collections.abc import Callable, Iterable, Mapping, Sequence

from fastspawn._os._core import ffi, lib

# The signal masks live in held; named here too, where callers find them.
from fastspawn._os.held import _outside as _outside
from fastspawn._os.held import held_signals as held_signals
from fastspawn._os.held import import_held as import_held
from fastspawn._os.held import start_quiet_thread as start_quiet_thread
from fastspawn._os.held import unheld_mask as unheld_mask

TYPE_CHECKING = False  # not typing's: the zygote and its workers skip typing
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _advice(err: int) -> str:
    """What to do about the errors that come from limits, not from bugs."""
    if err in (errno.EMFILE, errno.ENFILE):
        return "; raise the limit on open files (ulimit -n) or start fewer processes"
    if err == errno.EAGAIN:
        from fastspawn._os import limits as _limits  # only now: the zygote and its workers skip it

        return _limits.eagain_advice()
    return ""


def _error(err: int, call: str, filename: str | None = None) -> OSError:
    """The OSError for errno ``err`` from the C call ``call``.  ``filename``
    is what the call was about; left out where the errno is a limit of this
    process, not that file's fault."""
    advice = _advice(err)
    message = f"{os.strerror(err)} (from {call}){advice}"
    # OSError(errno, ...) picks the subclass itself (ProcessLookupError, ...).
    if filename is None or advice:
        return OSError(err, message)
    return OSError(err, message, filename)


def oserror(err: int, call: str) -> OSError:
    """The OSError subclass for errno ``err`` from ``call``, said as a failed
    C call is (for a system call that failed elsewhere: in the zygote, or
    in os.fork)."""
    return _error(err, call)


def _raise_errno(call: str) -> NoReturn:
    """Turn the errno of a failed C call into the matching OSError subclass."""
    raise _error(ffi.errno, call)


def set_pdeathsig(sig: int, expected_ppid: int) -> None:
    """Arm PR_SET_PDEATHSIG and re-check the parent.

    Raises:
        ProcessLookupError: the parent is no longer ``expected_ppid`` (it died
            before prctl ran); the caller must exit.
    """
    if lib.fs_set_pdeathsig(sig, expected_ppid) != 0:
        _raise_errno("fs_set_pdeathsig")


class ForkLoop:
    """The ranks of one launch, forked by the C loop (fs_fork_ranks): no
    Python runs in the forking process between two forks, nor in a child
    before its process group, PR_SET_PDEATHSIG (checked against ``parent``)
    and the interpreter's after-fork work are done.  A rank keeps the
    forking thread's signal mask: signals blocked for the loop stay blocked
    until the rank's own code, ready to handle what a handler raises, lets
    them through (a handler run at the return from :meth:`fork` would raise
    into the forking code's frames, in the child).  :meth:`fork` forks the
    ranks not yet forked; the pids so far are in :attr:`pids`.
    """

    # The steps of the loop that can fail (failure()'s first value).
    STEP_STACKS = lib.FS_FORK_STACKS
    STEP_FORK = lib.FS_FORK_FORK
    STEP_PDEATHSIG = lib.FS_FORK_PDEATHSIG

    # What a step of the loop is, for errors: the C call that failed.
    _CALLS = {
        lib.FS_FORK_STACKS: "fs_stacks_file",
        lib.FS_FORK_FORK: "fork(2)",
        lib.FS_FORK_SETPGID: "setpgid",
        lib.FS_FORK_CHILD_SETPGID: "setpgid in the rank",
        lib.FS_FORK_PDEATHSIG: "fs_set_pdeathsig",
    }

    def __init__(
        self,
        nprocs: int,
        parent: int,
        group: int,
        pdeathsig: int,
        started: Sequence[int] = (),
    ) -> None:
        """``started``: the pids of the first ranks, started otherwise (the
        zygote's ready workers): the loop forks the ranks after them."""
        self._plan = ffi.new("struct fs_fork_plan *")
        self._plan.nprocs = nprocs
        self._plan.parent = parent
        self._plan.group = group
        self._plan.pdeathsig = pdeathsig
        self._pids = ffi.new("pid_t[]", max(nprocs, 1))
        for rank, pid in enumerate(started):
            self._pids[rank] = pid
        self._plan.next = len(started)

    @property
    def nprocs(self) -> int:
        """How many ranks the loop is for, the started ones included."""
        return int(self._plan.nprocs)

    @property
    def next(self) -> int:
        """The rank to fork next (nprocs: all are forked)."""
        return int(self._plan.next)

    @property
    def pids(self) -> list[int]:
        """The pids of ranks 0 .. next - 1."""
        return list(self._pids[0 : self._plan.next])

    def fork(self, stacks_prefix: bytes | None = None, stacks_fd: int = -1) -> int:
        """Fork the ranks from :attr:`next` on, each with a stack file named
        ``stacks_prefix`` at ``stacks_fd`` if given (fs_stacks_file).
        Returns the rank in a child; -2 in a child whose set-up failed (its
        rank is :attr:`next`; see :meth:`failure`); -1 in the parent: all
        forked, or the loop stopped at a failure (see :meth:`failure`)."""
        keep = ffi.new("char[]", stacks_prefix) if stacks_prefix is not None else ffi.NULL
        self._plan.stacks_prefix = keep
        self._plan.stacks_fd = stacks_fd
        try:
            return int(lib.fs_fork_ranks(self._plan, self._pids))
        finally:
            self._plan.stacks_prefix = ffi.NULL

    def failure(self) -> tuple[int, OSError | None]:
        """How the last :meth:`fork` went, in the parent or a rank: (the
        step that failed, an FS_FORK_* value, its OSError), or (0, None)."""
        step = int(self._plan.failed_step)
        if step == lib.FS_FORK_OK:
            return 0, None
        return step, _error(int(self._plan.error), self._CALLS.get(step, "fs_fork_ranks"))


# fs_stacks_file(prefix, rank, fd) itself, for a Python fork loop that arms
# each rank's stack dump between two forks (start method fork): a Python
# wrapper there would write pages that every rank forked after it copies.
stacks_file: Callable[[bytes, int, int], int] = lib.fs_stacks_file


def set_child_subreaper() -> None:
    """Adopt orphaned descendants (PR_SET_CHILD_SUBREAPER)."""
    if lib.fs_set_child_subreaper() != 0:
        _raise_errno("prctl(PR_SET_CHILD_SUBREAPER)")


# Bound once, here: a ready worker's wake (fastspawn._zygote.wake) is its
# first call, and cffi would make the function object there, in every worker.
_set_name = lib.fs_set_name


def set_name(name: bytes) -> None:
    """Name this (single-threaded) process ``name``, its first 15 bytes:
    PR_SET_NAME, what a write to /proc/self/comm does, in one call."""
    if _set_name(name) != 0:
        _raise_errno("prctl(PR_SET_NAME)")


def collapse_hugepages(address: int, length: int) -> None:
    """Back ``[address, address + length)`` with huge pages now
    (MADV_COLLAPSE).  OSError(EINVAL) where the kernel cannot (before 6.1)."""
    if lib.fs_collapse_hugepages(address, length) != 0:
        _raise_errno("madvise(MADV_COLLAPSE)")


def pidfd_open(pid: int) -> int:
    """Return a close-on-exec pidfd for ``pid``."""
    fd = lib.fs_pidfd_open(pid, 0)
    if fd < 0:
        _raise_errno("pidfd_open")
    return int(fd)


# The name an anchor takes before it exits (csrc/group.c): its zombie's.
ANCHOR_NAME = "fastspawn-group"


def group_anchor() -> int:
    """Make a new process group whose leader has already exited; return its
    id.  The leader stays a zombie (holding the group and its id, named
    ANCHOR_NAME) until :func:`release_group_anchor`, to be called once the
    group's members have joined it (``os.setpgid(pid, group)``): no member
    leads the group, so each may still call ``setsid()``."""
    pid = lib.fs_group_anchor()
    if pid < 0:
        _raise_errno("fs_group_anchor")
    return int(pid)


def release_group_anchor(group: int) -> None:
    """Reap the anchor of ``group`` (a child no wait for any child sees)."""
    if lib.fs_group_anchor_release(group) != 0:
        _raise_errno("waitpid(__WALL)")


def same_file(a: int, b: int) -> bool | None:
    """Whether fds ``a`` and ``b`` share one open file description (kcmp);
    None where the kernel will not say (no kcmp, or a policy refusing it)."""
    r = lib.fs_same_file(a, b)
    return None if r < 0 else bool(r)


def fd_is(fd: int, dev: int, ino: int) -> bool:
    """Whether ``fd`` is open on the file with these device and inode
    numbers (False once closed); an fstat that builds no Python object."""
    return bool(lib.fs_fd_is(fd, dev, ino) == 1)


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    """Signal the process behind ``pidfd``.  ProcessLookupError once it exited."""
    if lib.fs_pidfd_send_signal(pidfd, sig) != 0:
        _raise_errno("pidfd_send_signal")


def signal_thread(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to thread ``tid`` of process ``pid`` and no other
    (tgkill(2); a process's main thread has ``tid == pid``).
    ProcessLookupError once it is gone."""
    if lib.fs_tgkill(pid, tid, sig) != 0:
        _raise_errno("tgkill")


def pidfd_wait(pidfd: int, nohang: bool) -> int | None:
    """Reap the child behind ``pidfd``.

    Returns:
        The exit status (exit code, or minus the signal number), or None when
        ``nohang`` is set and the child is still running.

    Raises:
        InterruptedError: a signal arrived during a blocking wait.
        ChildProcessError: not our child, or already reaped.
    """
    pid = ffi.new("pid_t *")
    status = ffi.new("int *")
    if lib.fs_pidfd_wait(pidfd, 1 if nohang else 0, pid, status) != 0:
        _raise_errno("waitid(P_PIDFD)")
    if pid[0] == 0:
        return None
    return int(status[0])


_pidfds_checked = False


def require_pidfds() -> None:
    """Check, once per process, that the kernel has what fastspawn waits
    with: pidfd_open (Linux 5.3) and waitid(P_PIDFD) (Linux 5.4).

    Raises:
        OSError: naming the missing call and the running kernel, where the
            kernel is older.
    """
    global _pidfds_checked
    if _pidfds_checked:
        return
    try:
        with held_signals():  # a Ctrl-C here must not leave the fd open
            fd = pidfd_open(os.getpid())
            try:
                pidfd_wait(fd, nohang=True)  # not our child: ECHILD where supported
            except ChildProcessError:
                pass
            finally:
                os.close(fd)
    except OSError as exc:
        if isinstance(exc, ChildProcessError):  # pragma: no cover - caught above
            raise
        import platform

        raise OSError(
            exc.errno,
            f"fastspawn needs Linux 5.4 or newer (pidfd_open, waitid P_PIDFD); "
            f"on this kernel ({platform.release()}): {exc.strerror}",
        ) from exc
    _pidfds_checked = True


# The longest wait that epoll_wait(2) and poll(2) take: their timeout is a
# C int of milliseconds (about 24.8 days).  A longer one (a grace period of
# years, say) would not fit; the waits that take it loop to their deadline,
# so it waits that long, then again.
MAX_WAIT_MS = 2**31 - 1


def wait_milliseconds(timeout: float | None) -> int:
    """``timeout`` seconds as the timeout of epoll_wait(2) and poll(2): -1
    (no limit) for None and inf, at most MAX_WAIT_MS, rounded up so that a
    short timeout does not become a busy poll; 0 when not positive."""
    if timeout is None or timeout == math.inf:
        return -1
    if timeout <= 0:
        return 0  # -inf too
    if timeout >= MAX_WAIT_MS / 1000:
        return MAX_WAIT_MS
    return math.ceil(timeout * 1000)


def wait_readable(fds: list[int], timeout: float | None) -> list[int]:
    """The fds among ``fds`` that poll readable within ``timeout`` seconds
    (None or inf: no limit).

    poll(2), not select(2): pidfds of large jobs are numbered past 1024.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    try:
        return [fd for fd, _ in poller.poll(wait_milliseconds(timeout))]
    except InterruptedError:
        return []


class Waiter:
    """An epoll set over many fds, each with an integer token.

    ``add`` and ``remove`` are O(1); ``wait`` returns the tokens of every fd
    that is ready, at a cost in ready entries, not in watched ones.
    """

    def __init__(self) -> None:
        self._epfd: int = -1  # for __del__, should epoll_create1 fail
        fd = lib.fs_waiter_new()
        if fd < 0:
            _raise_errno("epoll_create1")
        self._epfd = int(fd)
        self._count = 0
        self._buf: Any = ffi.new("uint64_t[]", 64)

    def fileno(self) -> int:
        return self._epfd

    def __len__(self) -> int:
        return self._count

    def add(self, fd: int, token: int) -> None:
        if lib.fs_waiter_add(self._epfd, fd, token) != 0:
            _raise_errno("epoll_ctl(EPOLL_CTL_ADD)")
        self._count += 1

    def remove(self, fd: int) -> None:
        if lib.fs_waiter_remove(self._epfd, fd) != 0:
            _raise_errno("epoll_ctl(EPOLL_CTL_DEL)")
        self._count -= 1

    def wait(self, timeout: float | None) -> list[int]:
        """Tokens of the ready fds; [] when ``timeout`` (seconds, None or
        inf: no limit) ran out.

        Raises:
            InterruptedError: a signal arrived; Python's handler has run.
        """
        want = max(self._count, 1)
        if len(self._buf) < want:
            self._buf = ffi.new("uint64_t[]", want)
        n = lib.fs_waiter_wait(self._epfd, self._buf, want, wait_milliseconds(timeout))
        if n < 0:
            _raise_errno("epoll_wait")
        return [int(self._buf[i]) for i in range(n)]

    def close(self) -> None:
        # Forgotten before closed: cut short between the two, the epoll set
        # leaks; the other way round, a later close() would close whatever
        # file took the number meanwhile.
        fd, self._epfd = self._epfd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def _cstrings(items: Iterable[bytes], keep: list[Any]) -> Any:
    cells = [ffi.new("char[]", item) for item in items]
    keep.extend(cells)
    array = ffi.new("char *[]", cells + [ffi.NULL])
    keep.append(array)
    return array


def _env_entry(key: str, value: str) -> Any:
    return ffi.new("char[]", os.fsencode(key) + b"=" + os.fsencode(value))


class Environ:
    """An environment for launch() whose entries are encoded once, for the
    ranks of a launch that share it but for a few variables of their own:
    encoding the whole environment again for each rank cost 22 us a rank
    with 35 variables, against 3 us for reusing the entries (timeit)."""

    __slots__ = ("_entries",)

    def __init__(self, env: Mapping[str, str]) -> None:
        self._entries = {key: _env_entry(key, value) for key, value in env.items()}

    def envp(self, extra: Mapping[str, str], keep: list[Any]) -> Any:
        """A NULL-terminated ``char *[]`` of this environment updated with
        ``extra`` (as ``{**env, **extra}``), alive as long as ``keep``."""
        if extra:
            cells = [
                _env_entry(key, extra[key]) if key in extra else cell
                for key, cell in self._entries.items()
            ]
            cells += [
                _env_entry(key, value) for key, value in extra.items() if key not in self._entries
            ]
        else:
            cells = list(self._entries.values())
        keep.append(cells)
        array = ffi.new("char *[]", cells + [ffi.NULL])
        keep.append(array)
        return array


def launch(
    path: str,
    argv: Sequence[str],
    env: Mapping[str, str] | Environ,
    *,
    env_extra: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: int = -1,
    stdout: int = -1,
    stderr: int = -1,
    keep_fds: Sequence[int] = (),
    pdeathsig: int = 0,
    new_session: bool = False,
    new_process_group: bool = False,
    process_group: int = 0,
    default_signals: Iterable[int] = (),
    signal_mask: Iterable[int] | None = None,
    process_state: Mapping[str, Any] | None = None,
) -> tuple[int, int]:
    """Start a binary without copying the caller's memory (clone + exec).

    ``env``: the program's environment, a mapping or an ``Environ``
    (shared by several launches), updated with ``env_extra``.
    ``default_signals`` go back to SIG_DFL in the child even where this
    process ignores them (caught ones always do, and SIGPIPE).
    ``signal_mask``: the signals the program starts with blocked (None:
    this thread's mask, as it was outside held_signals()).
    ``process_state``: settings for the child in place of this process's,
    as procstate.changed() gives them (umask, affinity, nice, rlimits);
    applied best effort, as procstate.apply() does in a forked worker.

    Returns:
        ``(pid, pidfd)``.

    Raises:
        OSError: the child could not be set up or exec'd; the subclass matches
            the errno (FileNotFoundError, PermissionError, ...) and the
            message names the step that failed.  The error's filename is
            ``path`` when the exec failed, ``cwd`` when the chdir to it did.
    """
    keep: list[Any] = []
    fsenc = os.fsencode
    c_path = ffi.new("char[]", fsenc(path))
    c_cwd = ffi.new("char[]", fsenc(cwd)) if cwd is not None else ffi.NULL
    c_fds = ffi.new("int[]", list(keep_fds)) if keep_fds else ffi.NULL
    spec = ffi.new(
        "struct fs_launch_spec *",
        {
            "path": c_path,
            "argv": _cstrings((fsenc(a) for a in argv), keep),
            "envp": (env if isinstance(env, Environ) else Environ(env)).envp(env_extra or {}, keep),
            "cwd": c_cwd,
            "stdin_fd": stdin,
            "stdout_fd": stdout,
            "stderr_fd": stderr,
            "keep_fds": c_fds,
            "n_keep_fds": len(keep_fds),
            "pdeathsig": pdeathsig,
            "new_session": 1 if new_session else 0,
            "new_process_group": 1 if new_process_group else 0,
            "process_group": process_group,
        },
    )
    spec.default_signals = _mask_bits(default_signals)
    if process_state:
        _set_process_state(spec, process_state, keep)
    outside = getattr(_outside, "mask", None) if signal_mask is None else signal_mask
    if outside is not None:  # given, or inside held_signals(): not the held mask
        spec.set_sigmask = 1
        spec.sigmask = _mask_bits(outside)
    pidfd = ffi.new("int *")
    step = ffi.new("int *")
    pid = lib.fs_launch(spec, pidfd, step)
    if pid < 0:
        err = ffi.errno
        raise _launch_error(err, int(step[0]), path, cwd, new_process_group, process_group)
    return int(pid), int(pidfd[0])


def _set_process_state(spec: Any, state: Mapping[str, Any], keep: list[Any]) -> None:
    """Fill ``spec``'s umask, nice, affinity and rlimits from ``state``
    (procstate's form); the C arrays made go into ``keep``."""
    if "umask" in state:
        spec.set_umask = 1
        spec.umask = state["umask"]
    if "nice" in state:
        spec.set_nice = 1
        spec.nice = state["nice"]
    if "affinity" in state:
        bits = ffi.sizeof("unsigned long") * 8
        words = [0] * (max(state["affinity"], default=0) // bits + 1)
        for cpu in state["affinity"]:
            words[cpu // bits] |= 1 << (cpu % bits)
        mask = ffi.new("unsigned long[]", words)
        keep.append(mask)
        spec.affinity = mask
        spec.affinity_size = ffi.sizeof(mask)
    limits = state.get("rlimits", {})
    if limits:
        array = ffi.new("struct fs_rlimit[]", len(limits))
        for item, (number, (soft, hard)) in zip(array, sorted(limits.items()), strict=True):
            item.resource = number
            item.soft = soft & 0xFFFFFFFFFFFFFFFF  # RLIM_INFINITY (-1 here) is ~0
            item.hard = hard & 0xFFFFFFFFFFFFFFFF
        keep.append(array)
        spec.rlimits = array
        spec.n_rlimits = len(limits)


# How an error names the steps of fs_launch (enum fs_launch_step) that are
# about neither the binary nor the cwd.
_LAUNCH_STEPS = {
    lib.FS_STEP_CLONE: "clone",
    lib.FS_STEP_PDEATHSIG: "prctl(PR_SET_PDEATHSIG) in the launched child",
    lib.FS_STEP_SETSID: "setsid in the launched child",
    lib.FS_STEP_STDIO: "dup2 of the launch's stdin, stdout or stderr",
    lib.FS_STEP_KEEP_FDS: "fcntl(F_SETFD) on the launch's keep_fds",
    lib.FS_STEP_SIGMASK: "sigprocmask in the launched child",
}


def _launch_error(
    err: int, step: int, path: str, cwd: str | None, new_process_group: bool, process_group: int
) -> OSError:
    """The error for a launch that failed at ``step`` with ``err``: it names
    the call that failed and, as its filename, what that call was about (the
    binary for the exec, the directory for the chdir), so that a missing cwd
    does not read as a missing binary."""
    if step == lib.FS_STEP_EXEC:
        return _error(err, "fs_launch", path)
    if step == lib.FS_STEP_CHDIR:
        return _error(err, "chdir to the launch's cwd", cwd)
    if step == lib.FS_STEP_SETPGID and new_process_group:
        return _error(err, "setpgid to a new process group")
    if step == lib.FS_STEP_SETPGID:
        return _error(err, f"setpgid to join process group {process_group}")
    return _error(err, _LAUNCH_STEPS.get(step, "fs_launch"))


def _mask_bits(mask: Iterable[int]) -> int:
    return sum(1 << (int(sig) - 1) for sig in mask if 0 < int(sig) <= 64)
