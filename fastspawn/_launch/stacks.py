"""Where every rank is: the Python stacks of all the threads of running
ranks, taken without their cooperation.

Each Python worker is armed (see fastspawn._worker.stacks: forked ones are
born so, ForkStacks; spawned ones call ``arm_stacks``): faulthandler,
registered on STACKS_SIGNAL, writes every thread's stack to a memfd of the
worker's own, from the signal handler (no GIL needed, so a rank stuck in C
code answers too).  To read them, the launcher (or ``fastspawn stacks`` in
another process of the same user):

1. checks in /proc/PID/status that the rank catches the signal (SigCgt): a
   process that does not (a binary rank, a rank started with stacks off or
   still starting) would be killed by it, its default action;
2. finds the memfd among /proc/PID/fd by its name, and opens it through
   that path (same user: ptrace read access); its size then is where this
   dump will start;
3. sends the signal through a pidfd (never to a recycled pid), unless one
   sent earlier is still pending (the rank blocks it in every thread: a
   real-time signal queues, and each would count against the user's
   RLIMIT_SIGPENDING): that one gives the dump when it is unblocked;
4. waits until the dump is whole: the file grew and has stopped growing,
   the signal is no longer pending, and the main thread no longer blocks
   it (faulthandler registers without SA_NODEFER, so it does while the
   handler runs); or until the deadline, keeping what is there;
5. reads what was appended, and closes its fd.

Why a memfd: the launch's report channel is a SOCK_SEQPACKET socket, which
takes each write() as a message of its own, and faulthandler writes every
line in several; a socket or pipe that fills up would block the handler,
and so hang the rank; a file on disk is a name another user could plant,
and one to leave behind.  A memfd never blocks the writer, keeps what was
not read yet, lives exactly as long as the rank, and costs the launcher
nothing until it asks: no message at start, no fd held per rank.

Binary ranks have no Python to dump; they get a line on their kernel state
(``describe``).  ``fastspawn run`` starts a .py program through a small
bootstrap that arms the same dump (fastspawn._worker.stacks.python_rank_argv).
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from fastspawn._os import children as _children
from fastspawn._os import oscall
from fastspawn._worker import runner
from fastspawn._worker.stacks import STACKS_MEMFD, STACKS_SIGNAL
from fastspawn._zygote import protocol, ready

# How long a failure waits for the other ranks' stacks before stopping them.
FAILURE_TIMEOUT = 0.5
# CPython 3.12.0-3.12.7 and 3.13.0: faulthandler's dump kills the process it
# dumps (SIGSEGV) when that process's top-most frame is a trampoline frame,
# which it is for a moment whenever C code calls Python (imports at start-up
# most of all): CPython issue gh-123967, fixed in 3.12.8 and 3.13.1.  Seen
# here on 3.13.0: in 1 of 240 failures of a 3-rank spawn launch (test_spec's
# two such tests, 120 times) a rank still starting up ended with SIGSEGV
# instead of the SIGTERM that stopped it.  On those versions a failure does
# not take the other ranks' stacks (on demand, the caller's choice, it still
# does; see docs/stacks.md).
_VERSION = sys.version_info[:3]
DUMP_MAY_CRASH = (3, 12, 0) <= _VERSION < (3, 12, 8) or _VERSION == (3, 13, 0)
# How long an on-demand dump (dump_stacks(), fastspawn stacks) waits.
DEMAND_TIMEOUT = 2.0

_LINK = f"/memfd:{STACKS_MEMFD}:"  # + "RANK (deleted)"
_DELETED = " (deleted)"
# A worker's frame that calls fn: what lies below it is fastspawn's (and,
# forked from the caller, the caller's own launch), not the rank's.
_RUN_FRAME = f'  File "{os.path.abspath(runner.__file__)}", line '
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(runner.__file__)))
_PACKAGE_FRAME = f'  File "{_PACKAGE_DIR}{os.sep}'
# In the command line of a zygote and of its guard (whatever the install's
# path), and so of every worker forked from it.
_ZYGOTE_ENTRY = protocol.MAIN_MARK
# Below the caller, ranks are children (fork, spawn), grandchildren (the
# zygote's guard, then the zygote) or one level further (a forkserver
# inside a rank's own launch is a rank's business): the walk stops here.
_MAX_DEPTH = 6

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep",
    "T": "stopped",
    "t": "stopped by a debugger",
    "Z": "a zombie",
    "X": "dead",
    "I": "idle",
}


K = TypeVar("K", bound=Hashable)


class Target(Generic[K]):
    """A process to dump: ``key`` names it in the result (a rank, or a
    pid), ``pidfd`` is an open pidfd of ``pid`` that the caller owns."""

    __slots__ = ("key", "pid", "pidfd")

    def __init__(self, key: K, pid: int, pidfd: int) -> None:
        self.key = key
        self.pid = pid
        self.pidfd = pidfd


def _status(pid: int) -> dict[str, str] | None:
    """/proc/PID/status as a dict; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _has(fields: Mapping[str, str], mask: str, sig: int = STACKS_SIGNAL) -> bool:
    """Whether signal ``sig`` is in the hex signal set ``fields[mask]``."""
    try:
        return bool(int(fields.get(mask, "0"), 16) >> (sig - 1) & 1)
    except ValueError:
        return False


def _state(fields: Mapping[str, str]) -> str:
    return fields.get("State", "?")[:1]


def describe(pid: int) -> str:
    """What the kernel says of ``pid``: its state, where the main thread
    waits in the kernel, and its threads (for a rank with no Python
    stacks)."""
    fields = _status(pid)
    if fields is None:
        return "exited"
    state = _state(fields)
    text = f"{_STATES.get(state, 'state')} ({state})"
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        wchan = ""
    if wchan and wchan != "0":
        text += f" in the kernel at {wchan}"
    threads = fields.get("Threads", "1")
    return text + (f", {threads} threads" if threads != "1" else "")


def find_memfd(pid: int, hint: int | None = None) -> tuple[int, str] | None:
    """The fd number, in ``pid``, of the memfd its stack dump writes to,
    with the rank its name gives; None if it holds none (``hint``: an fd
    number to look at first, as ranks of one launch share theirs)."""

    def rank_at(fd: int) -> str | None:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            return None
        if link.startswith(_LINK) and link.endswith(_DELETED):
            return link[len(_LINK) : -len(_DELETED)]
        return None

    if hint is not None:
        rank = rank_at(hint)
        if rank is not None:
            return hint, rank
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        rank = rank_at(int(name))
        if rank is not None:
            return int(name), rank
    return None


def _fds_readable(pid: int) -> bool:
    """Whether /proc/PID/fd can be listed here (False: not ours, or not
    dumpable; True also once the process is gone)."""
    try:
        os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return False
    except OSError:
        pass
    return True


def dumped_bytes(pid: int, hint: int | None = None) -> tuple[int, int] | None:
    """``(fd, size)``: the stack memfd of ``pid`` (its number there, a
    ``hint`` to look at first) and how many bytes its dumps have written
    into it, which the kernel counts among the process's writes (wchar);
    None if it holds none, or cannot be looked at."""
    found = find_memfd(pid, hint)
    if found is None:
        return None
    try:
        return found[0], os.stat(f"/proc/{pid}/fd/{found[0]}").st_size
    except OSError:
        return None


class _Dump(Generic[K]):
    """One process's dump in progress."""

    def __init__(
        self, target: Target[K], fd: int, memfd: int, blocked: bool, pending: bool
    ) -> None:
        self.target = target
        self.fd = fd  # the memfd's number in the process
        self.memfd = memfd  # ours: opened through /proc/PID/fd/N
        self.start = os.fstat(memfd).st_size  # where this dump begins
        self.blocked_before = blocked  # the main thread blocked the signal already
        # An earlier request's signal is still pending (every thread blocks
        # it): this dump waits for that one, and sends none (step 3).
        self.pending_before = pending
        self.size = self.start
        self.done = False

    def finished(self) -> bool:
        """Whether the dump is whole (or the process gone); see the module
        docstring, step 4.  An fstat while the file has not grown, or still
        grows; /proc/PID/status only once it stopped growing."""
        size = os.fstat(self.memfd).st_size
        grew, self.size = size != self.size, size
        if size <= self.start:
            return _exited(self.target)  # not begun: gone, or still to come
        if grew:
            return False  # still writing
        fields = _status(self.target.pid)
        if fields is None or _state(fields) in "ZX":
            return True  # gone: what it wrote is all there is
        if _has(fields, "ShdPnd") or _has(fields, "SigPnd"):
            return False
        # The main thread blocks the signal while its handler runs there.
        return self.blocked_before or not _has(fields, "SigBlk")

    def text(self, timeout: float) -> str:
        data = b""
        while len(data) < self.size - self.start:
            chunk = os.pread(self.memfd, self.size - self.start - len(data), self.start + len(data))
            if not chunk:
                break
            data += chunk
        text = _tidy(data.decode("utf-8", "replace").rstrip("\n"))
        if self.done:
            return text
        why = f"the dump did not complete within {timeout:g} s"
        if self.pending_before:
            why += (
                f" (it has not answered an earlier request: signal {STACKS_SIGNAL} is still "
                "pending, blocked in every thread; none more was sent)"
            )
        state = describe(self.target.pid)
        if not text:
            return f"no Python stacks: {why} (the process is {state})"
        return f"{text}\n(cut short: {why}; the process is {state})"


def _prepare(target: Target[K], hint: int | None) -> _Dump[K] | str | None:
    """Open ``target``'s memfd for a dump; else why not (None: it exited)."""
    fields = _status(target.pid)
    if fields is None or _state(fields) in "ZX":
        return None
    if not _has(fields, "SigCgt"):
        return (
            f"no Python stacks: it does not handle signal {STACKS_SIGNAL}, fastspawn's "
            "stack signal (a binary, a rank started with stacks off, or one still "
            f"starting); it is {describe(target.pid)}"
        )
    if _state(fields) in "Tt":
        return f"no Python stacks: it is {describe(target.pid)}, so it cannot write them"
    found = find_memfd(target.pid, hint)
    if found is None and not _fds_readable(target.pid):
        return (
            f"no Python stacks: its /proc/{target.pid}/fd cannot be read here (a process "
            "that made itself non-dumpable, prctl(PR_SET_DUMPABLE, 0), as setgid programs and "
            f"hardening libraries do); it is {describe(target.pid)}"
        )
    if found is None:
        return (
            f"no Python stacks: it no longer holds its stack memfd (it closed the fd, "
            f"or runs code of its own on signal {STACKS_SIGNAL}); it is "
            f"{describe(target.pid)}"
        )
    try:
        memfd = os.open(f"/proc/{target.pid}/fd/{found[0]}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if _status(target.pid) is None:
            return None
        return f"no Python stacks: its stack memfd cannot be opened here ({exc.strerror})"
    try:
        pending = _has(fields, "ShdPnd") or _has(fields, "SigPnd")
        return _Dump(target, found[0], memfd, _has(fields, "SigBlk"), pending)
    except BaseException:
        os.close(memfd)
        raise


def collect(targets: Iterable[Target[K]], timeout: float) -> dict[K, str]:
    """The Python stacks of every thread of each of ``targets``, by key,
    waiting ``timeout`` seconds at most for all of them together.

    A process that cannot give them (no Python, stopped, stacks off) gets
    a line saying why, with what the kernel says of it; one that exited is
    left out.
    """
    stacks: dict[K, str] = {}
    dumps: list[_Dump[K]] = []
    told: list[Target[K]] = []  # why no stacks, in stacks[key]
    try:
        hint = None
        for target in targets:
            outcome = _prepare(target, hint)
            if isinstance(outcome, _Dump):
                dumps.append(outcome)
                hint = outcome.fd
            elif outcome is not None:
                stacks[target.key] = outcome
                told.append(target)
        for dump in list(dumps):
            if dump.pending_before:
                # A real-time signal queues: each request to a rank that
                # blocks it would take one more of the user's pending
                # signals (RLIMIT_SIGPENDING).  The one queued answers.
                continue
            try:
                oscall.pidfd_send_signal(dump.target.pidfd, STACKS_SIGNAL)
            except OSError:  # exited meanwhile (ESRCH), or its pidfd was closed
                dumps.remove(dump)
                os.close(dump.memfd)
        _wait(dumps, time.monotonic() + timeout)
        for dump in dumps:
            text = dump.text(timeout)
            if text and (dump.done or not _exited(dump.target)):
                stacks[dump.target.key] = text  # (nothing: it exited first)
        for target in told:
            if _exited(target):  # what was said of it was its exit under way
                del stacks[target.key]
    finally:
        for dump in dumps:
            os.close(dump.memfd)
    return stacks


def _exited(target: Target[K]) -> bool:
    """Whether the target has exited (its pidfd polls readable)."""
    poller = select.poll()
    poller.register(target.pidfd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


def _wait(dumps: Sequence[_Dump[K]], deadline: float) -> None:
    """Poll the dumps until each is whole or ``deadline`` passes: often at
    first (a dump takes well under a millisecond once its handler runs, and
    a look costs an fstat), then less (a rank that has not answered yet is
    busy, or will not)."""
    pending = list(dumps)
    pause = 0.0002
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(pause, left))
        pause = min(1.5 * pause, 0.005)
        for dump in list(pending):
            if dump.finished():
                dump.done = True
                pending.remove(dump)


def _tidy(text: str) -> str:
    """A dump less what is not the rank's own: in each thread, the frames
    from the worker's ``run`` down, then fastspawn frames left at the
    bottom (elastic's run_function), and the bootstrap's ``<string>``
    frames of a .py program under ``fastspawn run``."""
    threads = []
    for thread in text.split("\n\n"):
        lines = thread.split("\n")
        for i, line in enumerate(lines):
            if line.startswith(_RUN_FRAME) and line.endswith(" in run"):
                del lines[i:]
                break
        while len(lines) > 2 and (
            lines[-1].startswith(_PACKAGE_FRAME) or lines[-1].startswith('  File "<string>", ')
        ):
            lines.pop()
        threads.append("\n".join(lines))
    return "\n\n".join(threads)


def format_block(entries: Iterable[tuple[str, str]]) -> str:
    """``--- title ---`` then the text, for each (title, text)."""
    return "\n".join(f"--- {title} ---\n{text.rstrip()}" for title, text in entries)


# ------------------------------------------------- ranks of another process


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, it
    names one process, where a pid alone may be recycled."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def _own(fields: Mapping[str, str]) -> bool:
    """Whether the process runs as this user (real and effective uid)."""
    return fields.get("Uid", "").split()[:2] == [str(os.getuid()), str(os.geteuid())]


def _memfd_of(pid: int) -> tuple[str, int] | None:
    """(rank, inode) of the stack memfd ``pid`` holds, if any."""
    found = find_memfd(pid)
    if found is None:
        return None
    try:
        return found[1], os.stat(f"/proc/{pid}/fd/{found[0]}").st_ino
    except OSError:
        return None


def _ppid(pid: int) -> int | None:
    fields = _status(pid)
    try:
        return None if fields is None else int(fields.get("PPid", ""))
    except ValueError:
        return None


def _is_guard(pid: int) -> bool:
    """Whether ``pid`` is a zygote's guard: started with the zygote's entry
    (``python -c ... <control fd> <caller pid>``) by the caller its command
    line names, its parent.  The zygote proper and its workers, forked from
    it, show the same command line under another parent."""
    cmdline = _cmdline(pid)
    if _ZYGOTE_ENTRY not in cmdline:
        return False
    caller = cmdline.rstrip(b"\0").rpartition(b"\0")[2]
    return caller.isdigit() and int(caller) == _ppid(pid)


def _zygote_level(pid: int) -> int:
    """``ranks_below``'s level of a root: 1 for a zygote's guard, 2 for the
    zygote proper (the guard's child), else 0."""
    if _is_guard(pid):
        return 1
    parent = _ppid(pid)
    if parent is not None and _ZYGOTE_ENTRY in _cmdline(pid) and _is_guard(parent):
        return 2
    return 0


class _Walk:
    """One process on the way down from ``ranks_below``'s root: how deep,
    its level (a zygote's guard: 1, the zygote proper: 2, else 0), and the
    inode of the stack memfd it holds (its children inherit that one: it
    makes none of them a rank)."""

    __slots__ = ("pid", "depth", "level", "inode")

    def __init__(self, pid: int, depth: int, level: int, inode: int | None) -> None:
        self.pid = pid
        self.depth = depth
        self.level = level
        self.inode = inode


def ranks_below(root: int) -> list[tuple[str | None, int]]:
    """The ranks among the descendants of process ``root``, as (rank, pid):
    every process of this user that holds a stack memfd of its own and
    catches the signal (the rank its memfd names; the walk does not go
    below it: its children are its business), and every other child of a
    fastspawn zygote (a rank too: a binary, or started with stacks off; its
    rank None) but its ready workers.  Other processes (the zygote, its guard, the warden, the
    caller's other children) are walked through, never signalled.
    ``root`` may be a zygote, or its guard, itself."""
    found: list[tuple[str | None, int]] = []
    memfd = _memfd_of(root)
    todo = [_Walk(root, 0, _zygote_level(root), None if memfd is None else memfd[1])]
    while todo:
        parent = todo.pop()
        for pid in sorted(_children.children_of(parent.pid)):
            fields = _status(pid)
            if fields is None or not _own(fields) or _state(fields) in "ZX":
                continue
            if parent.level == 2 and fields.get("Name") == ready.READY_NAME:
                continue  # a zygote's ready worker: no rank yet
            zygote = _ZYGOTE_ENTRY in _cmdline(pid) and parent.level < 2
            memfd = None if zygote or not _has(fields, "SigCgt") else _memfd_of(pid)
            if memfd is not None and memfd[1] != parent.inode:
                found.append((memfd[0], pid))
            elif parent.level == 2:
                found.append((None, pid))
            elif parent.depth < _MAX_DEPTH:
                level = parent.level + 1 if zygote else 0
                inode = parent.inode if memfd is None else memfd[1]
                todo.append(_Walk(pid, parent.depth + 1, level, inode))
    return found
