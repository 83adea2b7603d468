"""The ranks' stacks on the command line: what ``fastspawn run`` shows when
a rank fails, on SIGUSR1 and when the job hangs (``--hang-timeout``), and
``fastspawn stacks PID``.

Where the stacks come from, and how, is fastspawn._launch.stacks'; this module decides when
to ask and where the text goes: a block on stderr, and with a log directory
a ``stacks.log`` per rank (appended to, one header per dump).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from fastspawn import elastic
from fastspawn._launch import stacks as _stacks
from fastspawn._os import children as _children
from fastspawn._os import oscall

HANG_EXIT = 124  # as timeout(1): the job was stopped for running too long without progress
STACKS_FILE = "stacks.log"


class DumpRequests:
    """SIGUSR1 while ``fastspawn run`` runs: a request to dump every rank's
    stacks, noted by the handler and served by the wait loop (RunWatch)
    within its poll period.  The handler only sets a flag: it may land
    anywhere in the launcher, a join's bookkeeping included."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: object = None

    def _handle(self, signum: int, frame: object) -> None:
        self.pending = True

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR1, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def take(self) -> bool:
        pending, self.pending = self.pending, False
        return pending


class DropStacksRecord(logging.Filter):
    """Drops the library's WARNING that carries the ranks' stacks at a
    failure: ``fastspawn run`` shows them itself, labelled with global
    ranks, and writes them to the log directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not hasattr(record, "rank_stacks")


class RankLabels:
    """How ``fastspawn run`` names a local rank, and where its files go."""

    def __init__(
        self, global_rank: Callable[[int], int], pids: Mapping[int, int], attempt_dir: str
    ) -> None:
        self.global_rank = global_rank
        self.pids = dict(pids)
        self.attempt_dir = attempt_dir  # os.devnull: no files

    def title(self, local: int) -> str:
        pid = self.pids.get(local)
        return f"rank {self.global_rank(local)} (local rank {local}, pid {pid})"

    def show(self, headline: str, stacks: Mapping[int, str]) -> None:
        """Print ``headline`` and the block on stderr; append each rank's
        stacks to its file in the attempt's log directory."""
        block = _stacks.format_block((self.title(rank), text) for rank, text in stacks.items())
        print(f"fastspawn run: {headline}:\n{block}", file=sys.stderr, flush=True)
        if self.attempt_dir == os.devnull:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for rank, text in stacks.items():
            path = os.path.join(self.attempt_dir, str(rank), STACKS_FILE)
            try:
                _append(path, f"=== {stamp}: {headline} ===\n{text.rstrip()}\n\n")
            except OSError as exc:
                print(f"fastspawn run: cannot write {path}: {exc.strerror}", file=sys.stderr)


def _append(path: str, text: str) -> None:
    """Append ``text`` to ``path``, made 0600 if new; never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def _descendants(pid: int) -> Iterator[int]:
    """The children of ``pid``, theirs, and so on."""
    todo = [pid]
    while todo:
        try:
            children = _children.children_of(todo.pop())
        except OSError:
            continue  # gone
        yield from children
        todo.extend(children)


def _written(pid: int) -> int | None:
    """Bytes the process has written, by the kernel's count (wchar of
    /proc/PID/io: write(2) and its kin, to any file, pipe or terminal);
    None once it is gone (or where unreadable)."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class Progress:
    """Whether ranks move: one exited, or one (or a process it started)
    wrote something, since the last look.

    The ranks' own counts are read at every look (one small file each);
    their descendants' only when those did not move, as a rank that runs
    its work in children (a shell script, a launcher of its own) shows
    nothing itself: walking every tree at every look would cost more than
    the ranks' threads (one file each) are worth while they run."""

    def __init__(self, pids: Mapping[int, int]) -> None:
        self.pids = dict(pids)
        self.own = self._own()
        self.trees: dict[int, list[tuple[int, int | None]]] | None = self._trees()

    def _own(self) -> dict[int, int | None]:
        return {rank: _written(pid) for rank, pid in self.pids.items()}

    def _trees(self) -> dict[int, list[tuple[int, int | None]]]:
        return {
            rank: [(child, _written(child)) for child in _descendants(pid)]
            for rank, pid in self.pids.items()
        }

    def moved(self) -> bool:
        own = self._own()
        if own != self.own:
            self.own, self.trees = own, None  # the trees' counts: at the next quiet look
            return True
        trees = self._trees()
        moved = self.trees is not None and trees != self.trees
        self.trees = trees
        return moved


class RunWatch:
    """Waits for an attempt's ranks as ``ctx.wait()`` does, meanwhile
    serving SIGUSR1 dumps and watching for a hang.

    A hang: ``hang_timeout`` seconds in which no rank exited and none (nor
    any process it started) wrote a byte, to its output or anywhere else.
    The ranks' stacks are then shown; with ``hang_action == "kill"``, wait
    returns None for the caller to stop the job, else the watch starts
    over (another full quiet period before the next dump).
    """

    def __init__(
        self,
        ctx: elastic.PContext,
        labels: RankLabels,
        requests: DumpRequests | None,
        hang_timeout: float | None,
        hang_action: str,
    ) -> None:
        self.ctx = ctx
        self.labels = labels
        self.requests = requests
        self.hang_timeout = hang_timeout
        self.hang_action = hang_action
        # How often to look for progress: a few looks per timeout, at most
        # every 5 s (a look reads a file per rank).
        self.look_every = 0.5 if hang_timeout is None else min(max(hang_timeout / 4, 0.1), 5.0)
        self.progress: Progress | None = None
        self.quiet_since = self.next_look = 0.0

    def wait(self) -> elastic.RunProcsResult | None:
        """The attempt's result; None when a hang stopped the watch
        (``hang_action == "kill"``)."""
        if self.requests is None and self.hang_timeout is None:
            return self.ctx.wait()
        if self.hang_timeout is not None:
            self.progress = Progress(self.ctx.pids())
            self.quiet_since = time.monotonic()
            self.next_look = self.quiet_since + self.look_every
        while True:
            result = self.ctx.wait(min(0.5, self.look_every))
            if result is not None:
                return result
            if self.requests is not None and self.requests.take():
                self.dump("where every rank is (SIGUSR1)")
            if self.hung() and self.hang_action == "kill":
                return None

    def hung(self) -> bool:
        """Look for progress when due; True (once the stacks are shown)
        when there was none for hang_timeout seconds."""
        now = time.monotonic()
        if self.progress is None or self.hang_timeout is None or now < self.next_look:
            return False
        self.next_look = now + self.look_every
        if self.progress.moved():
            self.quiet_since = now
            return False
        if now - self.quiet_since < self.hang_timeout:
            return False
        self.dump(
            f"no rank wrote anything or exited for {self.hang_timeout:g} s "
            "(--hang-timeout); where every rank is"
        )
        self.quiet_since = time.monotonic()
        return True

    def dump(self, headline: str) -> None:
        stacks = self.ctx.dump_stacks()
        if stacks:
            self.labels.show(headline, stacks)
        else:
            print(f"fastspawn run: {headline}: no rank is running", file=sys.stderr)


# ------------------------------------------------------- fastspawn stacks PID


def stacks_command(pid: int, timeout: float) -> int:
    """``fastspawn stacks PID``: print the stacks of every rank below
    process ``pid`` (see _stacks.ranks_below); the exit status."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        print(f"fastspawn stacks: no process {pid}", file=sys.stderr)
        return 1
    if owner != os.geteuid():
        print(f"fastspawn stacks: process {pid} is another user's", file=sys.stderr)
        return 1
    ranks = _stacks.ranks_below(pid)
    targets = []
    try:
        for rank, rank_pid in ranks:
            started = _stacks.start_time(rank_pid)
            try:
                pidfd = oscall.pidfd_open(rank_pid)
            except OSError:
                continue  # exited
            if _stacks.start_time(rank_pid) != started:  # the pid is another process's now
                os.close(pidfd)
                continue
            targets.append(_stacks.Target((rank, rank_pid), rank_pid, pidfd))
        found = _stacks.collect(targets, timeout)
    finally:
        for target in targets:
            os.close(target.pidfd)
    if not found:
        print(
            f"fastspawn stacks: no rank runs below process {pid} (it should be a "
            "`fastspawn run`, or a process that started ranks with fastspawn)",
            file=sys.stderr,
        )
        return 1
    order = sorted(found, key=lambda key: (key[0] is None, _number(key[0]), key[1]))
    entries = [(_title(rank, rank_pid), found[(rank, rank_pid)]) for rank, rank_pid in order]
    print(_stacks.format_block(entries))
    return 0


def _number(rank: str | None) -> int:
    return int(rank) if rank is not None and rank.isdigit() else -1


def _title(rank: str | None, pid: int) -> str:
    return f"pid {pid} (a rank of a zygote)" if rank is None else f"rank {rank} (pid {pid})"
