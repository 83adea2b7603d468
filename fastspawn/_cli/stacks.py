"""The ranks' stacks on the command line: what ``fastspawn run`` shows when
a rank fails, on SIGUSR1 and when the job hangs (``--hang-timeout``), and
``fastspawn stacks PID``.

Where the stacks come from, and how, is fastspawn._launch.stacks'; this module decides when
to ask and where the text goes: a block on stderr, and with a log directory
a ``stacks.log`` per rank (appended to, one header per dump).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

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
    """Append ``text`` to ``path``: a new file (0600), or a regular file of
    this user's, made 0600 first; never through a link, never into a file
    another user planted there (elastic_rank.open_private)."""
    from fastspawn._worker import elastic_rank

    fd = elastic_rank.open_private(path, append=True)
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


class Reading(NamedTuple):
    """How far a process has got, by one measure: ``"written"``, the bytes
    it wrote less those its stack dumps wrote; ``"ran"``, the CPU time of
    its threads (ns), where its /proc/PID/io cannot be read; ``"unseen"``,
    where neither can."""

    measure: str
    value: int


def _written(pid: int) -> int:
    """Bytes the process has written, by the kernel's count (wchar of
    /proc/PID/io: write(2) and its kin, to any file, pipe or terminal).

    Raises:
        OSError: gone (FileNotFoundError, ProcessLookupError), or not to be
            read here (PermissionError: another user's process, or one that
            made itself non-dumpable, prctl(PR_SET_DUMPABLE, 0)).
        ValueError: no wchar there.
    """
    with open(f"/proc/{pid}/io", "rb") as f:
        for line in f:
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
    raise ValueError(f"no wchar in /proc/{pid}/io")


def _ran(pid: int) -> int:
    """The CPU time of all the process's threads, in ns (schedstat's first
    field: readable by anyone, non-dumpable processes included).

    Raises:
        OSError: gone, or no schedstat (a kernel without CONFIG_SCHED_INFO).
    """
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            raise
    return total


def _reading(pid: int, memfds: dict[int, int]) -> Reading | None:
    """How far ``pid`` has got (see Reading); None once it is gone.
    ``memfds``: the stack memfd's fd number by pid, kept from look to look."""
    try:
        written: int | None = _written(pid)
    except (OSError, ValueError):
        written = None  # not ours to read, no I/O accounting, or gone
    if written is not None:
        # Stack dumps write to the process's memfd, and count in wchar: a
        # dump is not progress.  The memfd is read after wchar, so that a
        # dump under way can only lower the difference, never raise it.
        dumped = _stacks.dumped_bytes(pid, memfds.get(pid))
        if dumped is None:
            return Reading("written", written)
        memfds[pid] = dumped[0]
        return Reading("written", written - dumped[1])
    try:
        return Reading("ran", _ran(pid))
    except (OSError, ValueError, IndexError):
        return Reading("unseen", 0) if os.path.exists(f"/proc/{pid}") else None


def _advanced(before: Reading | None, now: Reading | None) -> bool:
    """Whether a process moved from one reading to the next: a higher
    value by the same measure; a change of measure, or one that cannot
    be seen, counts (the watch never takes it for hung)."""
    if now is None or before is None:
        return before is not now
    if now.measure == "unseen" or now.measure != before.measure:
        return True
    return now.value > before.value


def _highest(before: Reading | None, now: Reading | None) -> Reading | None:
    """The reading to compare the next one with: the highest seen, so that
    a low one taken during a dump (see _reading) is not progress later."""
    if before is None or now is None or now.measure != before.measure:
        return now
    return now if now.value > before.value else before


UNSEEN_WHY = {
    "ran": "its /proc/PID/io cannot be read here (a process that made itself "
    "non-dumpable, prctl(PR_SET_DUMPABLE, 0), or a kernel without I/O accounting): "
    "the hang watch counts its CPU time instead of its writes",
    "unseen": "neither its /proc/PID/io nor its CPU time can be read here: the hang "
    "watch cannot see it, and never takes the job for hung",
}


class Progress:
    """Whether ranks move: one exited, or one (or a process it started)
    wrote something, since the last look; stack dumps do not count.

    The ranks' own counts are read at every look (one small file each);
    their descendants' only when those did not move, as a rank that runs
    its work in children (a shell script, a launcher of its own) shows
    nothing itself: walking every tree at every look would cost more than
    the ranks' threads (one file each) are worth while they run.

    A rank whose writes cannot be read (see UNSEEN_WHY) is told of once,
    through ``note(local rank, why)``.
    """

    def __init__(
        self, pids: Mapping[int, int], note: Callable[[int, str], None] | None = None
    ) -> None:
        self.pids = dict(pids)
        self.note = note
        self.noted: set[int] = set()
        self.memfds: dict[int, int] = {}
        self.own = self._own()
        self.trees: dict[int, Reading | None] | None = self._trees()

    def _own(self) -> dict[int, Reading | None]:
        own = {}
        for rank, pid in self.pids.items():
            own[rank] = reading = _reading(pid, self.memfds)
            if reading is not None and reading.measure in UNSEEN_WHY and rank not in self.noted:
                self.noted.add(rank)
                if self.note is not None:
                    self.note(rank, UNSEEN_WHY[reading.measure].replace("PID", str(pid)))
        return own

    def _trees(self) -> dict[int, Reading | None]:
        return {
            child: _reading(child, self.memfds)
            for pid in self.pids.values()
            for child in _descendants(pid)
        }

    def moved(self) -> bool:
        own = self._own()
        moved = any(_advanced(self.own.get(rank), now) for rank, now in own.items())
        self.own = {rank: _highest(self.own.get(rank), now) for rank, now in own.items()}
        if moved:
            self.trees = None  # the trees' counts: at the next quiet look
            return True
        trees = self._trees()
        before = self.trees
        if before is None:
            self.trees = trees
            return False
        moved = trees.keys() != before.keys() or any(
            _advanced(before[child], now) for child, now in trees.items()
        )
        self.trees = {child: _highest(before.get(child), now) for child, now in trees.items()}
        return moved


class HangStop(Exception):
    """A hang stopped the job (``--hang-action kill``), under torch's agent:
    raised from the worker group's wait, so that the agent stops its
    workers and leaves the rendezvous."""


class RunWatch:
    """Waits for an attempt's ranks as ``ctx.wait()`` does, meanwhile
    serving SIGUSR1 dumps and watching for a hang.

    A hang: ``hang_timeout`` seconds in which no rank exited and none (nor
    any process it started) wrote a byte, to its output or anywhere else
    (stack dumps aside).  The ranks' stacks are then shown; with
    ``hang_action == "kill"``, wait returns None for the caller to stop the
    job, else the watch starts over (another full quiet period before the
    next dump).

    Under torch's agent, which waits for the workers itself, ``look`` does
    the same at each of its looks (every --monitor-interval).
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
        if hang_timeout is not None:
            self.progress = Progress(ctx.pids(), self._unseen)
            self.quiet_since = time.monotonic()
            self.next_look = self.quiet_since + self.look_every

    def _unseen(self, local: int, why: str) -> None:
        print(f"fastspawn run: {self.labels.title(local)}: {why}", file=sys.stderr, flush=True)

    def wait(self) -> elastic.RunProcsResult | None:
        """The attempt's result; None when a hang stopped the watch
        (``hang_action == "kill"``)."""
        if self.requests is None and self.hang_timeout is None:
            return self.ctx.wait()
        while True:
            result = self.ctx.wait(min(0.5, self.look_every))
            if result is not None:
                return result
            if self.look():
                return None

    def look(self) -> bool:
        """Serve a pending SIGUSR1, look for a hang when due; True when a
        hang is to stop the job (``hang_action == "kill"``)."""
        if self.requests is not None and self.requests.take():
            self.dump("where every rank is (SIGUSR1)")
        return self.hung() and self.hang_action == "kill"

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


def agent_watch(
    requests: DumpRequests | None,
    hang_timeout: float | None,
    hang_action: str,
    keep_files: bool,
) -> Callable[[elastic.PContext, Mapping[int, Mapping[str, str]]], Callable[[], None]] | None:
    """What ``fastspawn run`` under torch's agent gives it to watch each
    worker group with (see fastspawn._torch.agent): for a group, a look
    that serves SIGUSR1 and watches for a hang as the static path's
    RunWatch does, and raises HangStop when a hang is to stop the job.
    ``keep_files``: whether the log directory stays (stacks.log there).
    None when there is nothing to watch."""
    if requests is None and hang_timeout is None:
        return None

    def watch(ctx: elastic.PContext, envs: Mapping[int, Mapping[str, str]]) -> Callable[[], None]:
        ranks = {local: int(env.get("RANK", local)) for local, env in envs.items()}
        error_file = ctx.error_files.get(0, os.devnull)
        attempt_dir = os.devnull
        if keep_files and error_file != os.devnull:
            attempt_dir = os.path.dirname(os.path.dirname(error_file))  # .../attempt_N/0/error.json
        labels = RankLabels(lambda local: ranks[local], ctx.pids(), attempt_dir)
        run_watch = RunWatch(ctx, labels, requests, hang_timeout, hang_action)

        def look() -> None:
            if run_watch.look():
                print("fastspawn run: stopping every rank (--hang-action kill)", file=sys.stderr)
                raise HangStop

        return look

    return watch


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


def process_id(text: str) -> int:
    """``fastspawn stacks``'s PID argument: a process id, a positive number.

    Raises:
        argparse.ArgumentTypeError: it is not one (argparse says so, with
            the text given).
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"PID must be a positive integer, got {text!r}")
    return value


def _number(rank: str | None) -> int:
    return int(rank) if rank is not None and rank.isdigit() else -1


def _title(rank: str | None, pid: int) -> str:
    return f"pid {pid} (a rank of a zygote)" if rank is None else f"rank {rank} (pid {pid})"
