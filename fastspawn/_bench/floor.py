"""The floor: a bare ``os.fork()`` loop in a small helper interpreter
(``floor``), or in one the zygote's size (``floor-sized``), that forks the
ranks when the bench asks and reports on them; and the floor of ready
workers (``floor-preforked``, ``floor-preforked-sized``): the same helpers
fork the ranks ahead, untimed, and wake each with one write when asked."""

from __future__ import annotations

import os
import signal
import struct
from typing import TYPE_CHECKING

from fastspawn._bench import ranks as _ranks
from fastspawn._bench.common import BenchError
from fastspawn._bench.methods import Method, describe_exit
from fastspawn._bench.session import Launched, Session
from fastspawn._zygote.protocol import MAIN_MODULE

if TYPE_CHECKING:
    from fastspawn._bench.ranks import RankSpec
    from fastspawn._os.helper import HelperClient


class FloorLaunched(Launched):
    """The ranks that one request to the floor's helper forked.

    The helper reaps them and reports each exit, so ``join`` only reads its
    reports; a rank still unreaped is SIGKILLed by pid (ours to signal: same
    user), never after its exit was reported (its pid may be reused).
    """

    def __init__(self, helper: HelperClient, nprocs: int, preforked: bool = False) -> None:
        import select

        self.helper = helper
        self.preforked = preforked  # the ranks wait, forked ahead: woken, not forked
        self.expected = nprocs  # lowered to the ranks forked if a fork fails
        self.forked: list[int] = []  # pid by rank
        self.codes: dict[int, int] = {}  # rank -> exit code (-N: signal N), once reaped
        self.fork_errno = 0
        self.requested = False
        self.poller = select.poll()
        self.poller.register(helper.control, select.POLLIN)
        self.poller.register(helper.pidfd, select.POLLIN)

    def start(self, round_id: int, fail_rank: int) -> None:
        """Ask for the ranks and wait for their pids.

        Raises:
            OSError: a fork failed in the helper (the ranks before it run).
            BenchError: the helper is gone.
        """
        self.requested = True
        op = WAKE if self.preforked else FORK
        self.helper.control.send(_FLOOR_REQUEST.pack(op, round_id, self.expected, fail_rank))
        while len(self.forked) < self.expected:
            self._receive(None)
        if self.fork_errno:
            raise OSError(
                self.fork_errno,
                f"{os.strerror(self.fork_errno)} (from os.fork in the floor's helper, "
                f"rank {len(self.forked)})",
            )

    def _receive(self, timeout_ms: int | None) -> bool:
        """Take in one message of reports; False if none came in time.

        Raises:
            BenchError: the helper exited (its pidfd polls readable and it
                left nothing to read).
        """
        import socket

        if not self.poller.poll(timeout_ms):
            return False
        try:
            data = self.helper.control.recv(_FLOOR_CHUNK * _FLOOR_REPLY.size, socket.MSG_DONTWAIT)
        except OSError:
            data = b""  # only the pidfd is readable (or the socket broke)
        if not data:
            raise BenchError(f"the floor's helper (pid {self.helper.pid}) exited")
        for event, rank, value in _FLOOR_REPLY.iter_unpack(data):
            if event == FORKED:
                self.forked.append(value)
            elif event == ENDED:
                self.codes[rank] = value
            else:  # NOT_FORKED: the helper forks no further rank
                self.fork_errno, self.expected = value, rank
        return True

    def pids(self) -> list[int]:
        return list(self.forked)

    def problem(self) -> str | None:
        try:
            while self._receive(0):
                pass
        except BenchError as exc:
            return str(exc)
        if not self.codes:
            return None
        rank = min(self.codes)
        return describe_exit(rank, self.forked[rank], self.codes[rank])

    def _wait_all_reaped(self) -> None:
        while len(self.codes) < len(self.forked):
            self._receive(None)

    def _kill_unreaped(self) -> None:
        for rank, pid in enumerate(self.forked):
            if rank not in self.codes:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited; its report is on the way

    def join(self) -> None:
        self._wait_all_reaped()
        failed = sorted(rank for rank, code in self.codes.items() if code != 0)
        if failed:
            rank = failed[0]
            raise BenchError(
                f"rank {rank} (pid {self.forked[rank]}) ended with exit status "
                f"{self.codes[rank]} after its release"
            )

    def join_failure(self) -> None:
        # The least a caller can do: wait for a rank's failure, SIGKILL the
        # others, know them all reaped.
        while not any(code != 0 for code in self.codes.values()):
            if len(self.codes) == len(self.forked):
                raise BenchError(f"no rank failed as planned; exit codes {self.codes}")
            self._receive(None)
        self._kill_unreaped()
        self._wait_all_reaped()

    def kill(self) -> None:
        if not self.requested:
            return
        # Bounded waits: a report lost to an interruption must not hang the
        # clean-up (ranks nobody releases exit once the bench or helper is gone).
        try:
            while len(self.forked) < self.expected and self._receive(2000):
                pass
            self._kill_unreaped()
            while len(self.codes) < len(self.forked) and self._receive(2000):
                pass
        except BenchError:
            self._kill_unreaped()  # the helper is gone: whoever adopted them reaps them


# The floor's wire: the bench asks its helper for ranks, the helper reports
# on them.  The program below gets these formats and numbers in its argv.
# op, round id, nprocs, the rank that must fail or -1
_FLOOR_REQUEST = struct.Struct("<iiii")
# event, rank, pid (FORKED) / exit code (ENDED) / errno (NOT_FORKED, PREFORKED:
# the ranks forked ahead in its rank field, 0 when all were)
_FLOOR_REPLY = struct.Struct("<iii")
FORKED, ENDED, NOT_FORKED, PREFORKED = 1, 2, 3, 4
FORK, PREFORK, WAKE = 1, 2, 3  # fork the ranks now; fork them ahead; wake those
_FLOOR_CHUNK = 1024  # reports per message: far below a SOCK_SEQPACKET message's size limit

# The floor's helper: run as ``python -I -S -c`` (no site, no fastspawn, no
# multiprocessing), it imports os, select, signal, struct and time, and runs
# the source of the ranks' module (``ranks``, which imports no more) for its
# rank_main: the floor's ranks run the same ``fn`` as every method's.  Each
# FORK request forks the ranks in a bare loop; a rank runs rank_main (reports
# entry, waits for SIGUSR1, reports exit or fails) and _exits.  The helper
# then reaps them, reporting each exit status.  A PREFORK request (untimed)
# forks the ranks ahead instead, each waiting on a pipe of its own (the
# other ranks' ends closed), and says PREFORKED once all are forked; the
# WAKE request that follows writes the round's request to each pipe, one
# write a rank, and the ranks go on as forked ones.  It ends at the bench's
# EOF, or with the bench (PR_SET_PDEATHSIG); a rank ends by itself once the
# bench or the helper is gone.
_FLOOR_PROGRAM = """\
import os, select, signal, struct, sys, time

fifo, ranks_path, request_format, reply_format, *numbers = sys.argv[1:]
FORKED, ENDED, NOT_FORKED, PREFORKED, FORK, PREFORK, CHUNK, control, bench_pid = map(int, numbers)
request, reply = map(struct.Struct, (request_format, reply_format))
ranks = {"__name__": "fastspawn_floor_ranks"}
with open(ranks_path, encoding="utf-8") as source:
    exec(compile(source.read(), ranks_path, "exec"), ranks)
ranks["floor_helper"] = os.getpid()
bench = os.pidfd_open(bench_pid)


def rank_main(round_id, rank, fail_rank):
    try:
        ranks["rank_main"](rank, (fifo, bench_pid, round_id, (), b"", fail_rank))
    except RuntimeError:
        if rank != fail_rank:
            raise
        os._exit(1)  # the failure the round asked for (its record is written)
    os._exit(0)


def fork_ranks(round_id, nprocs, fail_rank):
    forked, reports = {}, []
    for rank in range(nprocs):
        try:
            pid = os.fork()
        except OSError as exc:
            reports.append(reply.pack(NOT_FORKED, rank, exc.errno or 0))
            break
        if pid == 0:
            try:
                rank_main(round_id, rank, fail_rank)
            except BaseException as exc:
                os.write(2, f"fastspawn bench: floor rank {rank}: {exc!r}\\n".encode())
            finally:
                os._exit(1)
        forked[pid] = rank
        reports.append(reply.pack(FORKED, rank, pid))
    for start in range(0, len(reports), CHUNK):
        os.write(control, b"".join(reports[start : start + CHUNK]))
    return forked


def reap(forked):
    while forked:
        pid, status = os.wait()
        os.write(control, reply.pack(ENDED, forked.pop(pid), os.waitstatus_to_exitcode(status)))


def wait_to_wake(wake, rank):
    poller = select.poll()
    poller.register(wake, select.POLLIN)
    poller.register(bench, select.POLLIN)
    if bench in dict(poller.poll()):
        os._exit(1)  # the bench is gone
    message = os.read(wake, request.size)
    if len(message) != request.size:
        os._exit(1)  # the helper is gone (or retired us)
    _op, round_id, _nprocs, fail_rank = request.unpack(message)
    rank_main(round_id, rank, fail_rank)


def prefork(nprocs, waiting):
    for pid, wake in waiting:  # retire those of a round that never came
        os.close(wake)
        os.waitpid(pid, 0)
    waiting, errno = [], 0
    for rank in range(nprocs):
        try:
            wake, wake_end = os.pipe()
            pid = os.fork()
        except OSError as exc:
            errno = exc.errno or 0
            break
        if pid == 0:
            try:
                os.close(wake_end)
                for _pid, other in waiting:
                    os.close(other)
                wait_to_wake(wake, rank)
            except BaseException as exc:
                os.write(2, f"fastspawn bench: floor rank {rank}: {exc!r}\\n".encode())
            finally:
                os._exit(1)
        os.close(wake)
        waiting.append((pid, wake_end))
    os.write(control, reply.pack(PREFORKED, len(waiting), errno))
    return waiting


def wake_ranks(waiting, message):
    forked, reports = {}, []
    for rank, (pid, wake) in enumerate(waiting):
        os.write(wake, message)
        os.close(wake)
        forked[pid] = rank
        reports.append(reply.pack(FORKED, rank, pid))
    for start in range(0, len(reports), CHUNK):
        os.write(control, b"".join(reports[start : start + CHUNK]))
    return forked


waiting = []
while message := os.read(control, request.size):  # b"": the bench closed its end
    op, round_id, nprocs, fail_rank = request.unpack(message)
    if op == FORK:
        reap(fork_ranks(round_id, nprocs, fail_rank))
    elif op == PREFORK:
        waiting = prefork(nprocs, waiting)
    else:  # WAKE
        reap(wake_ranks(waiting, message))
        waiting = []
"""


# The sized floor's helper makes itself the zygote's size before the same
# loop: the modules a zygote serving the bench holds (its own, the worker's,
# multiprocessing, this module, where the ranks' function lives: the same
# set, checked), with site, and the zygote's memory treatment: gc.freeze(),
# the object arenas in one region collapsed into huge pages where the
# zygote does that.  A fork costs more from a bigger process (more page
# tables to copy, more pages to fault in): this floor is what a rank forked
# from a process that size costs at the least.  The bench's --import modules
# (torch, say), which its zygote preloads, are imported where the
# placeholder stands.
_IMPORTS = "# the bench's --import modules\n"
_SIZED_PREFIX = f"""\
from fastspawn._os import hugepages
if hugepages.wanted():
    hugepages.place_arenas()
import gc, multiprocessing.spawn, pkgutil, resource, runpy, {MAIN_MODULE}, {_ranks.__name__}
{_IMPORTS}gc.freeze()
for address in hugepages.collapsible_ranges() if hugepages.wanted() else ():
    hugepages.collapse(address)
"""


class FloorMethod(Method):
    """The floor: a small helper interpreter, started untimed, forks the
    ranks in a bare ``os.fork()`` loop when asked (see ``_FLOOR_PROGRAM``);
    ``floor-sized`` the same from a helper the zygote's size.  The
    ``-preforked`` ones have the helper fork the round's ranks ahead, in
    ``prepare``, untimed, and wake each with one write when asked: the
    floor of ready, pre-forked workers.

    The request's round trip over the socketpair is part of what it measures,
    as a launch call is part of every other method's.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.helper: HelperClient | None = None
        self.sized = name.endswith("-sized")
        self.preforked = "-preforked" in name

    def setup(self, session: Session) -> None:
        from fastspawn._os.helper import HelperClient

        formats = [_FLOOR_REQUEST.format, _FLOOR_REPLY.format]
        numbers = [FORKED, ENDED, NOT_FORKED, PREFORKED, FORK, PREFORK, _FLOOR_CHUNK]
        if not self.sized:
            argv = ["-I", "-S", "-c", _FLOOR_PROGRAM]
        else:
            imports = "".join(f"import {name}\n" for name in session.imports)
            argv = ["-c", _SIZED_PREFIX.replace(_IMPORTS, imports) + _FLOOR_PROGRAM]
        argv += [session.reports.path, _ranks.__file__, *formats]
        # PR_SET_PDEATHSIG: a bench killed outright takes its helper along.
        self.helper = HelperClient([*argv, *map(str, numbers)], pdeathsig=signal.SIGKILL)

    def prepare(self, session: Session, nprocs: int) -> None:
        """For the pre-forked floors: have the round's ranks forked ahead.

        Raises:
            OSError: a fork failed in the helper (the ranks before it wait,
                and go at the next request).
            BenchError: the helper is gone.
        """
        if not self.preforked:
            return
        if self.helper is None:
            raise BenchError("the floor's helper is not started")
        self.helper.control.send(_FLOOR_REQUEST.pack(PREFORK, -1, nprocs, -1))
        data = self.helper.control.recv(_FLOOR_REPLY.size)
        if not data:
            raise BenchError(f"the floor's helper (pid {self.helper.pid}) exited")
        _event, forked, errno = _FLOOR_REPLY.unpack(data)
        if forked < nprocs:
            raise OSError(
                errno,
                f"{os.strerror(errno)} (from os.fork in the floor's helper, rank {forked}, "
                "forking ahead)",
            )

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        if self.helper is None:
            raise BenchError("the floor's helper is not started")
        launched = FloorLaunched(self.helper, nprocs, self.preforked)
        session.live.append(launched)
        _fifo, _bench_pid, round_id, _modules, _payload, fail_rank = spec
        launched.start(round_id, fail_rank)
        return launched

    def helper_pids(self) -> list[int]:
        return [self.helper.pid] if self.helper is not None else []

    def teardown(self) -> None:
        if self.helper is not None:
            self.helper.kill_and_reap()
            self.helper.control.close()
            self.helper = None
