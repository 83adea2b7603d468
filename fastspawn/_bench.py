"""``fastspawn bench``: measure launch overhead on this machine.

Run as ``fastspawn bench [options]`` or ``python -m fastspawn bench``; the
methods, phases, options and exit statuses are in ``fastspawn bench --help``
(:data:`DESCRIPTION`).

How a round is measured
-----------------------
Every rank of every Python method runs :func:`rank_main`.  It blocks SIGUSR1,
imports ``--import``'s modules (as a real ``fn``'s module would), writes an
"entered" record (its CLOCK_MONOTONIC time, which Linux shares between
processes) to a FIFO the bench reads, and sleeps in ``sigtimedwait`` until the
bench sends it SIGUSR1.  The bench waits for every rank's record, sums the
ranks' USS, then releases them: each writes an "exited" record and returns.
In a failure round only one rank is released; it writes a "failed" record and
raises, while the others sleep on until the launcher's teardown kills them.
A rank whose bench dies exits by itself (it polls a pidfd of the bench once a
second), so an interrupted bench leaves nothing behind even where it never
learnt a rank's pid.

The floor method's ranks do not run :func:`rank_main`: a small helper
interpreter (``python -I -S``, started untimed by :class:`FloorMethod`)
forks them in a bare ``os.fork()`` loop when the bench asks over a
socketpair, and each writes the same records to the same FIFO from the
program in ``_FLOOR_PROGRAM``; the helper reaps them and reports their pids
and exit statuses back.  The tables compare every Python method's "all
running" to the floor's.

This module is also the ranks' ``fn`` module: spawn-like ranks import it to
unpickle :func:`rank_main`.  Its top level therefore imports only what a rank
needs; what the bench itself uses is imported inside the functions that use
it, so a spawned rank does not pay for the bench's imports.

JSON output (``--json FILE``)
-----------------------------
One object, described by the JSON Schema shipped beside this module,
``fastspawn/bench.schema.json`` (draft 2020-12; :func:`load_schema` reads
it):

- ``schema``: ``"fastspawn-bench/2"``; ``started_at`` (UTC, ISO 8601);
  ``duration_s``.
- ``machine``: ``cpu`` (model name from /proc/cpuinfo), ``cores``,
  ``usable_cores`` (CPU affinity), ``kernel``, ``python``, ``fastspawn``
  (version), ``torch`` (version when the run imported it, else null),
  ``memory_bytes``.
- ``config``: ``methods``, ``nprocs``, ``repeat``, ``imports``,
  ``payload_bytes``, ``binary`` (what binary methods start), ``argv``.
- ``rounds``: every raw sample, one object per round: ``method``, ``nprocs``,
  ``round`` (0-based), ``kind`` (``"launch"`` or ``"failure"``), and, in
  seconds unless named ``_bytes``, null where the phase does not apply:
  ``created_s``, ``running_s``, ``joined_s``, ``failure_s``, ``reaped_s``,
  ``uss_bytes``, ``helper_uss_bytes`` (the zygote or forkserver process
  itself), ``rank_entry_s`` and ``rank_exit_s`` (per rank, from t0).
- ``summary``: one object per method, nprocs and phase: ``phase`` (one of
  :data:`PHASES`), ``unit`` (``"s"`` or ``"bytes"``), ``rounds``, ``median``,
  ``p90``, ``min``, and ``ratio`` (median / the baseline's median) with
  ``baseline`` (``mp-spawn``, or ``binary-popen`` for binary methods), both
  null when the baseline was not measured; ``floor_ratio`` (median / the
  ``floor`` method's median for the same nprocs and phase), null for binary
  methods and where floor was not measured or has no such phase.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterable, Sequence
    from types import TracebackType

    from fastspawn._helper import HelperClient
    from fastspawn._methods.registry import StartMethodName

    # (report FIFO path, bench pid, round id, modules to import, payload, failing rank or -1)
    RankSpec = tuple[str, int, int, tuple[str, ...], bytes, int]
    Record = dict[str, Any]

# ------------------------------------------------------------------- ranks

_RECORD = struct.Struct("<iiid")  # round id, rank, kind, time.monotonic() of the event
ENTERED, EXITED, FAILED = 1, 2, 3


def rank_main(rank: int, spec: RankSpec) -> None:
    """The bench's ``fn``: report entry, wait for release, report exit or fail.

    ``spec`` is (report FIFO path, bench pid, round id, modules to import,
    payload, the rank that must fail or -1); the payload is only carried.
    """
    fifo, bench_pid, round_id, modules, _payload, fail_rank = spec
    # Blocked from the start, the release signal stays pending until
    # sigtimedwait takes it: it can never kill us by its default action.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    # A forked rank inherits the bench's SIGTERM handler; a teardown's SIGTERM
    # must simply kill.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in modules:
        __import__(name)  # the user's heavy imports, paid as a real fn's module pays them
    entered = time.monotonic()
    try:
        bench = os.pidfd_open(bench_pid)
    except ProcessLookupError:
        os._exit(1)  # the bench is gone: nobody will release or reap us
    out = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(out, _RECORD.pack(round_id, rank, ENTERED, entered))
        _wait_for_release(bench)
        if rank == fail_rank:
            os.write(out, _RECORD.pack(round_id, rank, FAILED, time.monotonic()))
            # multiprocessing prints a failing target's traceback; a planned
            # failure's is noise on the bench's terminal.
            sys.stderr = open(os.devnull, "w")  # lives as long as the rank
            raise RuntimeError("the failure this fastspawn bench round asked for")
        os.write(out, _RECORD.pack(round_id, rank, EXITED, time.monotonic()))
    finally:
        os.close(out)
        os.close(bench)


def _wait_for_release(bench_pidfd: int) -> None:
    """Sleep until SIGUSR1 comes; exit if the bench dies first."""
    import select

    poller = select.poll()
    poller.register(bench_pidfd, select.POLLIN)
    while signal.sigtimedwait([signal.SIGUSR1], 1.0) is None:
        if poller.poll(0):  # the bench's pidfd polls readable once it has exited
            os._exit(1)


# ---------------------------------------------------------------- methods

SCHEMA_ID = "fastspawn-bench/2"
BASELINE = "mp-spawn"
BINARY_BASELINE = "binary-popen"
FLOOR = "floor"

# name -> what it runs (for --help)
METHOD_HELP: dict[str, str] = {
    "fastspawn-zygote-warm": 'fastspawn.start_processes(start_method="zygote"), zygote running',
    "fastspawn-zygote-cold": "the same after fastspawn.stop_zygote(): the launch starts it",
    "fastspawn-spawn": 'fastspawn.start_processes(start_method="spawn")',
    "fastspawn-fork": 'fastspawn.start_processes(start_method="fork")',
    "fastspawn-forkserver": 'fastspawn.start_processes(start_method="forkserver")',
    "mp-spawn": "multiprocessing spawn context: a Process per rank, start all, join all",
    "mp-fork": "the same with the fork context",
    "mp-forkserver": "the same with the forkserver context (preloading the fn's module)",
    "torch-spawn": "torch.multiprocessing.spawn(join=False) (each rank imports torch)",
    "floor": "a bare os.fork() loop in a small helper interpreter: the floor (see below)",
    "floor-sized": "the same loop in a helper the zygote's size (its modules, gc.freeze())",
    "binary-fastspawn": "fastspawn.elastic.start_processes with true(1) as the entrypoint",
    "binary-popen": 'subprocess.Popen(["true"])',
    "binary-popen-pdeathsig": "the same with a preexec_fn that sets PR_SET_PDEATHSIG",
}
ALL_METHODS: tuple[str, ...] = tuple(METHOD_HELP)
GROUPS: dict[str, list[str]] = {}
for _name in ALL_METHODS:
    GROUPS.setdefault(_name.split("-", 1)[0], []).append(_name)
del _name


class BenchError(Exception):
    """A round could not be measured: a rank died, a launch failed, ..."""


class UsageError(Exception):
    """Bad options, or a sweep this machine cannot run: exit status 2."""


class Launched:
    """The processes of one launch, whatever started them."""

    def pids(self) -> list[int]:
        raise NotImplementedError

    def problem(self) -> str | None:
        """What went wrong if some process already ended, else None."""
        raise NotImplementedError

    def release(self, ranks: Iterable[int]) -> None:
        """Let these ranks go on (they are alive, blocked in sigtimedwait)."""
        pids = self.pids()
        for rank in ranks:
            os.kill(pids[rank], signal.SIGUSR1)

    def join(self) -> None:
        """Wait for every process to end successfully, and reap it."""
        raise NotImplementedError

    def join_failure(self) -> None:
        """Wait for one rank's failure and the teardown of the others."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL and reap whatever still runs; safe to call in any state."""
        raise NotImplementedError


def _describe_exit(rank: int, pid: int, code: int | None) -> str:
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"rank {rank} (pid {pid}) ended with {how} before the bench released it"


class FastspawnLaunched(Launched):
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def pids(self) -> list[int]:
        return list(self.ctx.pids())

    def problem(self) -> str | None:
        for proc in self.ctx.processes:
            if proc.exitcode is not None:
                return _describe_exit(proc.rank, proc.pid, proc.exitcode)
        return None

    def join(self) -> None:
        while not self.ctx.join():
            pass

    def join_failure(self) -> None:
        import fastspawn

        try:
            self.join()
        except (fastspawn.ProcessRaisedException, fastspawn.ProcessExitedException):
            return  # raised once every other rank is stopped and reaped
        raise BenchError("the failure round ended without the planned failure")

    def kill(self) -> None:
        from fastspawn._errors import ProcessException

        for proc in self.ctx.processes:
            proc.kill()
        try:
            # The first SIGKILLed rank makes join stop and reap the rest.
            while not self.ctx.join(grace_period=0):
                pass
        except ProcessException:
            pass


class MpLaunched(Launched):
    """multiprocessing.Process objects (also what torch's context holds)."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def problem(self) -> str | None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                return _describe_exit(rank, proc.pid, proc.exitcode)
        return None

    def join(self) -> None:
        for proc in self.procs:
            proc.join()
        for proc in self.procs:
            proc.close()  # its sentinel fd, now rather than at garbage collection

    def join_failure(self) -> None:
        # What a multiprocessing user writes: wait on the sentinels until a
        # rank fails, then terminate the others and join everyone.
        from multiprocessing.connection import wait

        while True:
            codes = [p.exitcode for p in self.procs]  # once: a rank may exit meanwhile
            if any(code not in (None, 0) for code in codes):
                break
            running = [
                p.sentinel for p, code in zip(self.procs, codes, strict=True) if code is None
            ]
            if not running:
                raise BenchError(f"no rank failed as planned; exit codes {codes}")
            wait(running)
        for proc in self.procs:
            if proc.exitcode is None:
                proc.terminate()
        self.join()

    def kill(self) -> None:
        started = []
        for proc in self.procs:
            try:
                if proc.pid is not None and proc.exitcode is None:
                    proc.kill()
                started.append(proc)
            except ValueError:
                pass  # closed: reaped already
        for proc in started:
            if proc.pid is not None:
                proc.join()
                proc.close()


class TorchLaunched(MpLaunched):
    def __init__(self, ctx: Any) -> None:
        super().__init__(list(ctx.processes))
        self.ctx = ctx

    def join(self) -> None:
        while not self.ctx.join():
            pass

    def join_failure(self) -> None:
        import importlib

        tmp: Any = importlib.import_module("torch.multiprocessing")
        try:
            self.join()
        except (tmp.ProcessRaisedException, tmp.ProcessExitedException):
            return  # torch raises once it terminated and joined the others
        raise BenchError("the failure round ended without the planned failure")


class ElasticLaunched(Launched):
    """The ranks of a ``fastspawn.elastic`` PContext."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def pids(self) -> list[int]:
        pids = self.ctx.pids()
        return [pids[rank] for rank in sorted(pids)]

    def problem(self) -> str | None:
        return None

    def join(self) -> None:
        result = self.ctx.wait()
        self.ctx.close()
        if result.is_failed():
            raise BenchError(f"a binary rank failed: {result.failures}")

    def join_failure(self) -> None:
        raise NotImplementedError("binary methods have no failure round")

    def kill(self) -> None:
        self.ctx.close(signal.SIGKILL)


class PopenLaunched(Launched):
    def __init__(self) -> None:
        self.procs: list[Any] = []

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def problem(self) -> str | None:
        return None

    def join(self) -> None:
        for proc in self.procs:
            proc.wait()

    def join_failure(self) -> None:
        raise NotImplementedError("binary methods have no failure round")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
        self.join()


class FloorLaunched(Launched):
    """The ranks that one request to the floor's helper forked.

    The helper reaps them and reports each exit, so ``join`` only reads its
    reports; a rank still unreaped is SIGKILLed by pid (ours to signal: same
    user), never after its exit was reported (its pid may be reused).
    """

    def __init__(self, helper: HelperClient, nprocs: int) -> None:
        import select

        self.helper = helper
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
        self.helper.control.send(_FLOOR_REQUEST.pack(round_id, self.expected, fail_rank))
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
        return _describe_exit(rank, self.forked[rank], self.codes[rank])

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


class Session:
    """What every round shares: the report FIFO, the options, live launches."""

    def __init__(
        self,
        reports: Reports,
        imports: Sequence[str],
        payload_bytes: int,
        binary: str,
        live: list[Launched],
    ) -> None:
        self.reports = reports
        self.imports = tuple(imports)
        self.payload = bytes(payload_bytes)
        self.binary = binary
        # Launches not yet reaped: what an interruption must kill.
        self.live = live
        self._round_id = 0

    def spec(self, fail_rank: int) -> RankSpec:
        """The ranks' argument for a new round (its own id: stale records never count)."""
        self._round_id += 1
        return (
            self.reports.path,
            os.getpid(),
            self._round_id,
            self.imports,
            self.payload,
            fail_rank,
        )


class Method:
    """One way of starting processes."""

    binary = False
    failure_round = True

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, session: Session) -> None:
        """Once, before the warm-up round."""

    def prepare(self, session: Session) -> None:
        """Before every round, untimed."""

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        """Start the ranks; the handle is in ``session.live`` once it exists."""
        raise NotImplementedError

    def helper_pids(self) -> list[int]:
        """The long-lived process that forks the ranks, if there is one."""
        return []

    def teardown(self) -> None:
        """Once, after the last round (or a failure, or an interruption):
        stop and reap what ``setup`` started."""


class FastspawnMethod(Method):
    def __init__(self, name: str, start_method: StartMethodName, cold: bool = False) -> None:
        super().__init__(name)
        self.start_method = start_method
        self.cold = cold
        # After its launch a cold zygote is a warm one: the failure round
        # would repeat fastspawn-zygote-warm's.
        self.failure_round = not cold

    def prepare(self, session: Session) -> None:
        import fastspawn
        from fastspawn._methods import registry

        method = registry.get(self.start_method)
        if self.cold:
            fastspawn.stop_zygote()
        elif method.supports_preload and not method.helper_pids():
            # No zygote (it died?): start one and let it import this module
            # and the preloads, so that the timed launch finds it warm.
            fastspawn.start_processes(
                _noop, nprocs=1, start_method=self.start_method, preload=list(session.imports)
            )

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        import fastspawn
        from fastspawn._methods import registry

        takes_preload = registry.get(self.start_method).supports_preload
        ctx = fastspawn.start_processes(
            rank_main,
            (spec,),
            nprocs=nprocs,
            join=False,
            start_method=self.start_method,
            preload=list(session.imports) if takes_preload else None,
        )
        launched = FastspawnLaunched(ctx)
        session.live.append(launched)
        return launched

    def helper_pids(self) -> list[int]:
        from fastspawn._methods import registry

        return sorted(registry.get(self.start_method).helper_pids())


def _noop(rank: int) -> None:
    """A rank that does nothing: warms the zygote up."""


class MpMethod(Method):
    def __init__(self, name: str, start_method: str) -> None:
        super().__init__(name)
        self.start_method = start_method

    def setup(self, session: Session) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context(self.start_method)
        if isinstance(ctx, multiprocessing.context.ForkServerContext):
            # Before the server starts: the rank function's module (which the
            # zygote keeps from its first launch) and what the zygote gets
            # through preload=.
            ctx.set_forkserver_preload([__name__, *session.imports])

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        import multiprocessing

        ctx: Any = multiprocessing.get_context(self.start_method)
        procs = [ctx.Process(target=rank_main, args=(rank, spec)) for rank in range(nprocs)]
        launched = MpLaunched(procs)
        session.live.append(launched)
        for proc in procs:
            proc.start()
        return launched

    def helper_pids(self) -> list[int]:
        import multiprocessing
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context(self.start_method)
        if not isinstance(ctx, multiprocessing.context.ForkServerContext):
            return []

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        return [pid] if isinstance(pid, int) else []


class TorchMethod(Method):
    def setup(self, session: Session) -> None:
        import importlib

        importlib.import_module("torch.multiprocessing")  # untimed: the launcher's own import

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        import importlib

        tmp: Any = importlib.import_module("torch.multiprocessing")
        ctx = tmp.spawn(rank_main, args=(spec,), nprocs=nprocs, join=False)
        launched = TorchLaunched(ctx)
        session.live.append(launched)
        return launched


class BinaryFastspawn(Method):
    """Binary ranks as users start them: ``fastspawn.elastic.start_processes``
    with a binary entrypoint (what ``fastspawn run --no-python`` runs)."""

    binary = True
    failure_round = False

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        from fastspawn import elastic

        ranks = range(nprocs)
        ctx = elastic.start_processes(
            "bench",
            session.binary,
            {rank: () for rank in ranks},
            {rank: {} for rank in ranks},
            log_dir=os.devnull,
        )
        launched = ElasticLaunched(ctx)
        session.live.append(launched)
        return launched


class BinaryPopen(Method):
    binary = True
    failure_round = False

    def __init__(self, name: str, pdeathsig: bool) -> None:
        super().__init__(name)
        self.pdeathsig = pdeathsig
        self.preexec: Callable[[], None] | None = None

    def setup(self, session: Session) -> None:
        if not self.pdeathsig:
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1

        def preexec() -> None:
            # As users write it; a preexec_fn makes Popen fork instead of vfork.
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)

        self.preexec = preexec

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        import subprocess

        launched = PopenLaunched()
        session.live.append(launched)
        for _ in range(nprocs):
            launched.procs.append(subprocess.Popen([session.binary], preexec_fn=self.preexec))
        return launched


# The floor's wire: the bench asks its helper for ranks, the helper reports
# on them.  The program below gets these formats and numbers in its argv.
_FLOOR_REQUEST = struct.Struct("<iii")  # round id, nprocs, the rank that must fail or -1
_FLOOR_REPLY = struct.Struct("<iii")  # event, rank, pid (FORKED) / exit code (ENDED) / errno
FORKED, ENDED, NOT_FORKED = 1, 2, 3
_FLOOR_CHUNK = 1024  # reports per message: far below a SOCK_SEQPACKET message's size limit

# The floor's helper: run as ``python -I -S -c`` (no site, no fastspawn, no
# multiprocessing), it imports os, select, signal, struct and time.  Each
# request forks the ranks in a bare loop; a rank reports entry, waits for
# SIGUSR1, reports exit (or failure) as rank_main does, and _exits.  The
# helper then reaps them, reporting each exit status.  It ends at the bench's
# EOF, or with the bench (PR_SET_PDEATHSIG); a rank ends by itself once the
# bench or the helper is gone.
_FLOOR_PROGRAM = """\
import os, select, signal, struct, sys, time

fifo, record_format, request_format, reply_format, *numbers = sys.argv[1:]
ENTERED, EXITED, FAILED, FORKED, ENDED, NOT_FORKED, CHUNK, control, bench_pid = map(int, numbers)
record, request, reply = map(struct.Struct, (record_format, request_format, reply_format))
# Blocked before any fork: a release stays pending until sigtimedwait takes it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
bench = os.pidfd_open(bench_pid)
out = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)
helper = os.getpid()


def rank_main(round_id, rank, fail_rank):
    entered = time.monotonic()
    os.write(out, record.pack(round_id, rank, ENTERED, entered))
    poller = select.poll()
    poller.register(bench, select.POLLIN)
    while signal.sigtimedwait([signal.SIGUSR1], 1.0) is None:
        if poller.poll(0) or os.getppid() != helper:
            os._exit(1)  # the bench or the helper is gone: nobody will release or reap us
    kind = FAILED if rank == fail_rank else EXITED
    os.write(out, record.pack(round_id, rank, kind, time.monotonic()))
    os._exit(1 if kind == FAILED else 0)


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


while message := os.read(control, request.size):  # b"": the bench closed its end
    reap(fork_ranks(*request.unpack(message)))
"""


# The sized floor's helper makes itself the zygote's size before the same
# loop: the modules a zygote serving the bench holds (its own, the worker's,
# multiprocessing, this module, where the ranks' function lives: the same
# set, checked), with site, and the zygote's memory treatment: gc.freeze(),
# the object arenas in one region collapsed into huge pages where the
# zygote does that.  A fork costs more from a bigger process (more page
# tables to copy, more pages to fault in): this floor is what a rank forked
# from a process that size costs at the least.
_SIZED_PREFIX = """\
from fastspawn import _hugepages
if _hugepages.wanted():
    _hugepages.place_arenas()
import gc, multiprocessing.spawn, pkgutil, resource, runpy, fastspawn._zygote, fastspawn._bench
gc.freeze()
for address in _hugepages.collapsible_ranges() if _hugepages.wanted() else ():
    _hugepages.collapse(address)
"""


class FloorMethod(Method):
    """The floor: a small helper interpreter, started untimed, forks the
    ranks in a bare ``os.fork()`` loop when asked (see ``_FLOOR_PROGRAM``);
    ``floor-sized`` the same from a helper the zygote's size.

    The request's round trip over the socketpair is part of what it measures,
    as a launch call is part of every other method's.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.helper: HelperClient | None = None

    def setup(self, session: Session) -> None:
        from fastspawn._helper import HelperClient

        formats = [_RECORD.format, _FLOOR_REQUEST.format, _FLOOR_REPLY.format]
        numbers = [ENTERED, EXITED, FAILED, FORKED, ENDED, NOT_FORKED, _FLOOR_CHUNK]
        if self.name == FLOOR:
            argv = ["-I", "-S", "-c", _FLOOR_PROGRAM]
        else:
            argv = ["-c", _SIZED_PREFIX + _FLOOR_PROGRAM]
        argv += [session.reports.path, *formats]
        # PR_SET_PDEATHSIG: a bench killed outright takes its helper along.
        self.helper = HelperClient([*argv, *map(str, numbers)], pdeathsig=signal.SIGKILL)

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        if self.helper is None:
            raise BenchError("the floor's helper is not started")
        launched = FloorLaunched(self.helper, nprocs)
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


def make_method(name: str) -> Method:
    """The method called ``name`` (one of :data:`ALL_METHODS`)."""
    family, _, rest = name.partition("-")
    if family == "fastspawn":
        # fastspawn-<method>, or fastspawn-<method>-warm / -cold for the
        # default method, whose long-lived process a launch may find running.
        method, _, state = rest.partition("-")
        # A name of METHOD_HELP, built from the registry's: one of its methods.
        return FastspawnMethod(name, cast("StartMethodName", method), cold=state == "cold")
    if family == "mp":
        return MpMethod(name, rest)
    if family == "torch":
        return TorchMethod(name)
    if family == FLOOR:
        return FloorMethod(name)
    if name == "binary-fastspawn":
        return BinaryFastspawn(name)
    return BinaryPopen(name, pdeathsig=name == "binary-popen-pdeathsig")


# ---------------------------------------------------------------- reports


class Reports:
    """The FIFO the ranks write their records to, and the records read so far."""

    STALL_S = 300.0  # no record and no rank exit for this long: give up

    def __init__(self, directory: str) -> None:
        import fcntl

        self.path = os.path.join(directory, "reports")
        os.mkfifo(self.path, 0o600)
        # Read-write: we count as a writer, so the FIFO never reads as EOF
        # between ranks and a rank's open(O_WRONLY) never blocks.
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass  # over /proc/sys/fs/pipe-max-size or the user's pipe quota
        self.capacity = fcntl.fcntl(self.fd, fcntl.F_GETPIPE_SZ)
        self._partial = b""
        self._seen: dict[tuple[int, int], dict[int, float]] = {}

    @property
    def max_ranks(self) -> int:
        """Ranks whose records fit at once: one more would block writing."""
        return self.capacity // _RECORD.size

    def _read(self) -> bool:
        """Take in what the FIFO holds; True when something came."""
        got = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return got
            got = True
            data = self._partial + data
            whole = len(data) - len(data) % _RECORD.size
            for round_id, rank, kind, when in _RECORD.iter_unpack(data[:whole]):
                self._seen.setdefault((round_id, kind), {})[rank] = when
            self._partial = data[whole:]

    def wait(
        self, round_id: int, kind: int, count: int, launched: Launched | None
    ) -> dict[int, float]:
        """``{rank: time}`` once ``count`` ranks sent a ``kind`` record.

        With ``launched``, wait as long as its processes live and report;
        without, the records must be there already (their writers exited).
        """
        import select

        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        news = time.monotonic()
        while True:
            if self._read():
                news = time.monotonic()
            if len(self._seen.get((round_id, kind), {})) >= count:
                return self._seen.pop((round_id, kind))
            if launched is None:
                if time.monotonic() - news > 2.0:
                    raise BenchError(
                        f"{count - len(self._seen.get((round_id, kind), {}))} rank(s) "
                        "exited without their report"
                    )
            elif time.monotonic() - news > self.STALL_S:
                raise BenchError(f"no rank reported for {self.STALL_S:.0f} s; giving up")
            if not poller.poll(500) and launched is not None:
                # Checked only when nothing comes: polling hundreds of ranks
                # while they start would slow the start that is measured.
                problem = launched.problem()
                if problem is not None:
                    raise BenchError(problem)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ----------------------------------------------------------------- rounds

# (phase, record key, unit)
PHASE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("created", "created_s", "s"),
    ("running", "running_s", "s"),
    ("joined", "joined_s", "s"),
    ("failure", "failure_s", "s"),
    ("reaped", "reaped_s", "s"),
    ("uss", "uss_bytes", "bytes"),
    ("helper_uss", "helper_uss_bytes", "bytes"),
)
PHASES: tuple[str, ...] = tuple(phase for phase, _, _ in PHASE_KEYS)
_RECORD_KEYS = [key for _, key, _ in PHASE_KEYS] + ["rank_entry_s", "rank_exit_s"]


def new_record(method: str, nprocs: int, round_no: int, kind: str) -> Record:
    record: Record = {"method": method, "nprocs": nprocs, "round": round_no, "kind": kind}
    record.update(dict.fromkeys(_RECORD_KEYS))
    return record


def summed_uss(pids: Sequence[int]) -> int | None:
    """Summed USS of ``pids`` (psutil), or None without psutil or access."""
    import importlib

    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        return None
    total = 0
    for pid in pids:
        try:
            total += int(psutil.Process(pid).memory_full_info().uss)
        except psutil.AccessDenied:
            return None
        except psutil.NoSuchProcess:
            raise BenchError(f"process {pid} vanished while the bench measured memory") from None
    return total


def python_round(
    method: Method, nprocs: int, round_no: int, session: Session, failure: bool
) -> Record:
    """One launch (or failure) round of a Python method."""
    import gc

    method.prepare(session)
    fail_rank = nprocs // 2 if failure else -1
    spec = session.spec(fail_rank)
    round_id = spec[2]
    gc.collect()  # not in the timed part
    t0 = time.monotonic()
    launched = method.launch(nprocs, spec, session)
    created = time.monotonic()
    entries = session.reports.wait(round_id, ENTERED, nprocs, launched)
    record = new_record(method.name, nprocs, round_no, "failure" if failure else "launch")
    if failure:
        launched.release([fail_rank])
        launched.join_failure()
        done = time.monotonic()
        failed = session.reports.wait(round_id, FAILED, 1, None)
        record["failure_s"] = done - failed[fail_rank]
    else:
        record["uss_bytes"] = summed_uss(launched.pids())
        helpers = method.helper_pids()
        record["helper_uss_bytes"] = summed_uss(helpers) if helpers else None
        launched.release(range(nprocs))
        launched.join()
        joined = time.monotonic()
        exits = session.reports.wait(round_id, EXITED, nprocs, None)
        record["created_s"] = created - t0
        record["running_s"] = max(entries.values()) - t0
        record["joined_s"] = joined - max(exits.values())
        record["rank_entry_s"] = [entries[rank] - t0 for rank in range(nprocs)]
        record["rank_exit_s"] = [exits[rank] - t0 for rank in range(nprocs)]
    session.live.remove(launched)
    return record


def binary_round(method: Method, nprocs: int, round_no: int, session: Session) -> Record:
    """One round of a binary method: start ``nprocs`` binaries, reap them all."""
    import gc

    method.prepare(session)
    gc.collect()
    t0 = time.monotonic()
    launched = method.launch(nprocs, session.spec(-1), session)
    created = time.monotonic()
    launched.join()
    reaped = time.monotonic()
    session.live.remove(launched)
    record = new_record(method.name, nprocs, round_no, "launch")
    record["created_s"] = created - t0
    record["reaped_s"] = reaped - t0
    return record


class Progress:
    """One self-erasing status line on stderr; silent unless it is a terminal."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.enabled = bool(stream is not None and stream.isatty())
        self.shown = False

    def show(self, text: str) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        if self.enabled and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def sweep(
    methods: Sequence[Method],
    nprocs_list: Sequence[int],
    repeat: int,
    session: Session,
    progress: Progress,
) -> list[Record]:
    """Every method, nprocs and round; rounds interleave the methods."""

    def one(method: Method, nprocs: int, round_no: int, failure: bool) -> Record:
        try:
            if method.binary:
                return binary_round(method, nprocs, round_no, session)
            return python_round(method, nprocs, round_no, session, failure)
        except BenchError as exc:
            raise BenchError(f"{method.name} with nprocs={nprocs}: {exc}") from exc
        except Exception as exc:  # a launch refused (EAGAIN, ENOMEM, ...) or a rank failed
            raise BenchError(
                f"{method.name} with nprocs={nprocs}: {type(exc).__name__}: {exc}"
            ) from exc

    for method in methods:
        progress.show(f"fastspawn bench: warming up {method.name}")
        method.setup(session)
        one(method, 1, 0, False)  # starts servers, fills caches; not recorded
    records = []
    for nprocs in nprocs_list:
        for round_no in range(repeat):
            # Rotate the order too, so that no method always follows the same one.
            shift = round_no % len(methods)
            for method in [*methods[shift:], *methods[:shift]]:
                for failure in (False, True) if method.failure_round else (False,):
                    progress.show(
                        f"fastspawn bench: {method.name}  nprocs={nprocs}  "
                        f"round {round_no + 1}/{repeat}{'  (failure)' if failure else ''}"
                    )
                    records.append(one(method, nprocs, round_no, failure))
    progress.clear()
    return records


# ------------------------------------------------------------- statistics


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0 < q < 1), interpolating linearly
    between ranks (statistics' "inclusive" method, R's type 7)."""
    import statistics

    if not values:
        raise ValueError("quantile of no values")
    if len(values) == 1:
        return float(values[0])  # statistics.quantiles wants two
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return cuts[round(q * 1000) - 1]


def _over(median: float, base: float | None) -> float | None:
    return median / base if base is not None and base > 0 else None


def summarize(records: Sequence[Record], methods: Sequence[str]) -> list[Record]:
    """Median, p90 and min per method, nprocs and phase, with the ratio of
    the median to the baseline's (mp-spawn; binary-popen for binaries) and,
    for Python methods, to the floor's."""
    values: dict[tuple[str, int, str], list[float]] = {}
    for record in records:
        for phase, key, _unit in PHASE_KEYS:
            if record[key] is not None:
                values.setdefault((record["method"], record["nprocs"], phase), []).append(
                    record[key]
                )
    units = {phase: unit for phase, _, unit in PHASE_KEYS}
    medians = {group: quantile(v, 0.5) for group, v in values.items()}
    summary: list[Record] = []
    for (method, nprocs, phase), samples in values.items():
        binary = method.startswith("binary-")
        baseline = BINARY_BASELINE if binary else BASELINE
        median = medians[(method, nprocs, phase)]
        ratio = _over(median, medians.get((baseline, nprocs, phase)))
        floor = None if binary else medians.get((FLOOR, nprocs, phase))
        summary.append(
            {
                "method": method,
                "nprocs": nprocs,
                "phase": phase,
                "unit": units[phase],
                "rounds": len(samples),
                "median": median,
                "p90": quantile(samples, 0.9),
                "min": min(samples),
                "ratio": ratio,
                "baseline": baseline if ratio is not None else None,
                "floor_ratio": _over(median, floor),
            }
        )
    order = {name: i for i, name in enumerate(methods)}
    summary.sort(key=lambda s: (s["nprocs"], order.get(s["method"], 99), PHASES.index(s["phase"])))
    return summary


# ------------------------------------------------------------------ table


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    # As times are (97.3x, 1.25x) down to 0.10x, then two significant digits (0.054x).
    return f"{_number(value)}x" if round(value, 2) >= 0.1 else f"{value:.2g}x"


def _cell(stats: Record | None) -> str:
    if stats is None:
        return "-"
    scale = 1000.0 if stats["unit"] == "s" else 1.0 / 2**20  # ms, MiB
    med, low, p90 = (stats[k] * scale for k in ("median", "min", "p90"))
    return f"{_number(med)} ({_number(low)}-{_number(p90)})"


# (key, title); a key "field:phase" shows that field of the phase's summary.
_PY_COLUMNS = [
    ("created", "created"),
    ("running", "all running"),
    ("ratio:running", f"vs {BASELINE}"),
    ("joined", "exit->joined"),
    ("failure", "failure->reaped"),
    ("uss", "USS MiB"),
]
_FLOOR_COLUMN = ("floor_ratio:running", f"vs {FLOOR}")  # after the baseline's, when floor ran
_BIN_COLUMNS = [
    ("created", "created"),
    ("reaped", "all reaped"),
    ("ratio:reaped", f"vs {BINARY_BASELINE}"),
]


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _row(
    name: str, nprocs: int, columns: Sequence[tuple[str, str]], stats: dict[Any, Record]
) -> list[str]:
    row = [name]
    for key, _title in columns:
        field, _, phase = key.rpartition(":")
        found = stats.get((name, nprocs, phase))
        row.append(_ratio(found[field] if found else None) if field else _cell(found))
    return row


def format_table(
    summary: Sequence[Record], methods: Sequence[str], repeat: int, machine: Record
) -> str:
    """The terminal report: one block per nprocs, a row per method."""
    stats = {(s["method"], s["nprocs"], s["phase"]): s for s in summary}
    floor_ran = any(s["method"] == FLOOR for s in summary)
    lines = [
        f"fastspawn bench: {repeat} round(s) per cell; each cell is median (min-p90),",
        "times in ms from the launch call (exit->joined: from the last rank's return;",
        "failure->reaped: from the failing rank's raise); USS summed over the ranks.",
        f"vs {BASELINE} / vs {BINARY_BASELINE}: this method's median over the baseline's "
        "(below 1: faster).",
    ]
    py_columns = list(_PY_COLUMNS)
    if floor_ran:
        lines.append(
            f"vs {FLOOR}: this method's all running median over {FLOOR}'s, a bare os.fork() "
            "loop in a small interpreter."
        )
        py_columns.insert(py_columns.index(("ratio:running", f"vs {BASELINE}")) + 1, _FLOOR_COLUMN)
    lines.append(
        "machine: {cpu}, {cores} cores ({usable_cores} usable), Linux {kernel}, "
        "Python {python}, fastspawn {fastspawn}".format(**machine)
    )
    for nprocs in sorted({s["nprocs"] for s in summary}):
        lines.append("")
        lines.append(f"nprocs={nprocs}")
        for binary, columns in ((False, py_columns), (True, _BIN_COLUMNS)):
            names = [m for m in methods if m.startswith("binary-") == binary]
            names = [m for m in names if any((m, nprocs, p) in stats for p in PHASES)]
            if not names:
                continue
            rows = [["binary method" if binary else "method"] + [title for _, title in columns]]
            rows.extend(_row(name, nprocs, columns, stats) for name in names)
            lines.extend(_grid(rows))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- plot

_PANELS = [
    ("created", "call -> processes created (ms)"),
    ("running", "call -> all ranks in fn (ms)"),
    ("joined", "last exit -> join returned (ms)"),
    ("failure", "failure -> all reaped (ms)"),
    ("uss", "summed USS of the ranks (MiB)"),
    ("reaped", "binaries: call -> all reaped (ms)"),
]


def plot(summary: Sequence[Record], methods: Sequence[str], path: str, title: str) -> None:
    """Median latency (bars: min to p90) against nprocs, log-log, a panel per phase."""
    import importlib

    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")  # no display needed
    plt = importlib.import_module("matplotlib.pyplot")
    panels = [(p, t) for p, t in _PANELS if any(s["phase"] == p for s in summary)]
    cols = 3 if len(panels) > 4 else 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    ticker = importlib.import_module("matplotlib.ticker")
    # A fixed color per method, whatever subset runs: tab10 plus three.
    palette = [*plt.get_cmap("tab10").colors, "black", "goldenrod", "grey"]
    ticks = sorted({s["nprocs"] for s in summary})
    styles = {"fastspawn": "-", "mp": "--", "torch": ":", "floor": "-", "binary": "-."}
    handles: dict[str, Any] = {}
    for ax, (phase, panel_title) in zip(axes.flat, panels, strict=False):
        scale = 1000.0 if phase != "uss" else 1.0 / 2**20
        for name in methods:
            points = sorted(
                (s["nprocs"], s["median"] * scale, s["min"] * scale, s["p90"] * scale)
                for s in summary
                if s["method"] == name and s["phase"] == phase
            )
            if not points:
                continue
            xs, med, low, high = (list(column) for column in zip(*points, strict=True))
            line = ax.errorbar(
                xs,
                med,
                yerr=[
                    [m - lo for m, lo in zip(med, low, strict=True)],
                    [h - m for m, h in zip(med, high, strict=True)],
                ],
                marker="o",
                markersize=3,
                capsize=2,
                linestyle=styles[name.split("-", 1)[0]],
                color=palette[ALL_METHODS.index(name) % len(palette)],
                label=name,
            )
            handles[name] = line
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("nprocs")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(handles) + 3) // 4), 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- machine


def machine() -> Record:
    """The machine description that goes with the numbers."""
    import platform

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    cpu = value.strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    import fastspawn

    torch_version = None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch_version = str(getattr(torch, "__version__", "unknown"))
    else:
        from importlib import metadata

        try:
            torch_version = metadata.version("torch")  # installed, not imported
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "usable_cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "fastspawn": fastspawn.__version__,
        "torch": torch_version,
        "memory_bytes": memory,
    }


# ----------------------------------------------------------------- limits

# fds the bench holds per rank while a launch runs: a pidfd (fastspawn), a
# sentinel (multiprocessing), plus torch's error queue pipe; none for the
# floor (its helper reports on the ranks over one socket).
_FDS_PER_RANK = {"fastspawn": 1, "mp": 2, "torch": 4, "floor": 0, "binary": 1}
_SPARE_TASKS = 16  # the zygote, forkservers, resource tracker, their threads
_SPARE_FDS = 64


def limit_problem(
    nprocs: int,
    fds_per_rank: int,
    *,
    nproc_limit: int,
    tasks_in_use: int,
    nofile_limit: int,
    fds_open: int,
    report_ranks: int,
    pid_max: int | None = None,
    threads_max: int | None = None,
) -> str | None:
    """Why ``nprocs`` ranks cannot run under these limits, or None.

    ``nproc_limit`` / ``nofile_limit`` are soft RLIMIT_NPROC / RLIMIT_NOFILE
    values (resource.RLIM_INFINITY for none); ``tasks_in_use`` counts this
    user's processes and threads, ``fds_open`` this process's open fds;
    ``pid_max`` / ``threads_max`` the machine's (None: not checked).  The
    limits themselves are fastspawn's launch check (_limits), here counting
    what runs already, with room for the bench's helpers.
    """
    from fastspawn import _limits

    demand = _limits.Demand(
        nprocs,
        f"--nprocs {nprocs}",
        "lower --nprocs",
        holder="the bench",
        fds_per_rank=fds_per_rank,
        tasks_in_use=tasks_in_use,
        fds_open=fds_open,
        spare_tasks=_SPARE_TASKS,
        spare_fds=_SPARE_FDS,
    )
    limits = _limits.Limits(
        nproc=_limits.finite(nproc_limit),
        nofile=_limits.finite(nofile_limit),
        pid_max=pid_max,
        threads_max=threads_max,
    )
    problem = _limits.problem(demand, limits)
    if problem is None and nprocs > report_ranks:
        problem = (
            f"--nprocs {nprocs} is more ranks than the bench's report pipe holds "
            f"({report_ranks}; its size is capped by /proc/sys/fs/pipe-max-size): "
            "lower --nprocs"
        )
    return problem


def check_limits(nprocs: int, methods: Sequence[str], reports: Reports) -> str | None:
    """:func:`limit_problem` with this process's real limits.  RLIMIT_NPROC
    counts as set even where the kernel would let this process past it
    (root): a sweep measures launches, and one that runs past the limit its
    user set is not the measurement asked for."""
    import resource

    from fastspawn import _limits

    machine = _limits.Limits.current()
    nproc_limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    tasks = _limits.tasks_of(os.getuid()) if nproc_limit != resource.RLIM_INFINITY else 0
    return limit_problem(
        nprocs,
        max(_FDS_PER_RANK[m.split("-", 1)[0]] for m in methods),
        nproc_limit=nproc_limit,
        tasks_in_use=tasks,
        nofile_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        fds_open=len(os.listdir("/proc/self/fd")),
        report_ranks=reports.max_ranks,
        pid_max=machine.pid_max,
        threads_max=machine.threads_max,
    )


# --------------------------------------------------------------- options


def parse_methods(text: str, torch_problem: str | None) -> tuple[list[str], list[str]]:
    """(methods, notes) from ``--methods``: names and group names, comma-separated.

    Raises:
        UsageError: an unknown name, or torch-spawn asked for without torch.
    """
    wanted: list[str] = []
    notes: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item == "all":
            names = list(ALL_METHODS)
            if torch_problem is not None:
                names.remove("torch-spawn")
                notes.append(f"torch-spawn left out: {torch_problem}")
        elif item in GROUPS:
            names = GROUPS[item]
        elif item in METHOD_HELP:
            names = [item]
        else:
            raise UsageError(
                f"unknown method {item!r} in --methods; valid: {', '.join(ALL_METHODS)}, "
                f"or a group: {', '.join(GROUPS)}, all"
            )
        if "torch-spawn" in names and item != "all" and torch_problem is not None:
            raise UsageError(
                f"torch-spawn needs torch, but {torch_problem}: install torch, or leave "
                "torch-spawn out of --methods"
            )
        wanted.extend(n for n in names if n not in wanted)
    if not wanted:
        raise UsageError("--methods names no method")
    # The table and the plot follow the canonical order, whatever the command line's.
    return [m for m in ALL_METHODS if m in wanted], notes


def parse_nprocs(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise UsageError(
            f"--nprocs takes positive integers separated by commas, like 1,8,64; got {text!r}"
        )
    return values


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64K``, ``1M`` or ``1G`` (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in units:
        number, unit = cleaned[:-1], cleaned[-1]
    try:
        value = int(number) * units[unit]
    except ValueError:
        raise UsageError(
            f"--payload-bytes takes a size like 4096, 64K or 1M; got {text!r}"
        ) from None
    if value < 0:
        raise UsageError(f"--payload-bytes must not be negative; got {text!r}")
    return value


def torch_problem() -> str | None:
    """Why torch.multiprocessing cannot be used here, or None when it can."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        importlib.import_module("torch.multiprocessing")
    except Exception as exc:
        return f"import torch failed ({type(exc).__name__}: {exc})"
    return None


def _check_output(path: str | None, flag: str) -> None:
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: the folder {folder} does not exist")


def _check_plot(path: str | None) -> None:
    if path is None:
        return
    _check_output(path, "--plot")
    import subprocess

    # In a child: matplotlib in the bench itself would make every fork-based
    # method fork a bigger process.
    done = subprocess.run(
        [sys.executable, "-c", "import matplotlib"], capture_output=True, text=True
    )
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["import failed"])[-1]
        raise UsageError(
            f"--plot needs matplotlib, which this Python cannot import ({why}): "
            "pip install 'fastspawn[plot]', or leave --plot out"
        )


def _import_all(modules: Sequence[str]) -> None:
    """Import --import's modules here first: fork-based ranks inherit them,
    and a typo fails now rather than in every rank."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise UsageError(
                f"--import {name}: cannot import it here ({type(exc).__name__}: {exc})"
            ) from None


# -------------------------------------------------------------------- CLI

DESCRIPTION = """\
Measure how long starting worker processes takes on this machine, for
fastspawn and the usual alternatives, in one run whose rounds interleave the
methods (so drift on a noisy machine hits them all alike).

Methods (--methods: names or groups fastspawn, mp, torch, floor, binary;
default: all, torch-spawn only where torch imports):
{methods}

The floor is what forking a rank costs at the least on this machine: a small
helper interpreter (python -I -S importing os, select, signal, struct and
time; no fastspawn, no multiprocessing), started untimed, forks the ranks in
a bare os.fork() loop when the bench asks over a socketpair, and reaps them.
t0 is taken before the request, so its round trip counts, as a launch call
counts for the others.  Its ranks report, wait and exit (or fail) as the
others do, but import nothing (--import and --payload-bytes do not apply),
and the failure round SIGKILLs the others.  floor-sized is the same loop in
a helper the size of a zygote serving a small program (the same modules,
gc.freeze(), its arenas in huge pages as the zygote's): a fork costs more
from a bigger process, and this is what one of the zygote's size costs.

Phases, per round, from t0 just before the launch call:
  created          the launch call returned: start_processes(join=False), the
                   last Process.start(), torch spawn(join=False), the last
                   binary launch or Popen, floor's pids back from its helper
  all running      every rank is inside fn: latest rank entry time - t0
                   (CLOCK_MONOTONIC is system-wide)
  exit->joined     last rank's return from fn to the join returning
  failure->reaped  a separate round: once all ranks run one raises, the others
                   sleep; from its raise until the caller has its exception and
                   every rank is reaped (multiprocessing: wait on the sentinels,
                   terminate the rest, join all, as users write it)
  USS              psutil USS summed over the ranks while all are alive (the
                   zygote's or forkserver's own USS is in the JSON)
  all reaped       binary methods: call to every process reaped
Each cell is the median (min-p90) over --repeat rounds.  The ratio column is
a method's "all running" median over mp-spawn's ("all reaped" over
binary-popen's for binaries); below 1 is faster.  Where floor ran, "vs floor"
divides a Python method's "all running" median by floor's: how far above the
floor each launcher starts its ranks.

Spawn-like ranks re-import the caller's main module; the bench hides its own
(this CLI), so they import only the rank function's module and --import's:
add your program's heavy imports with --import to see what your ranks pay.
With torch-spawn or --import torch the bench process itself imports torch,
so fork-based methods then fork a process that holds torch.

Exit status: 0 done; 1 a measurement failed (the message says which rank);
2 bad options, a sweep over RLIMIT_NPROC or RLIMIT_NOFILE, --plot without
matplotlib (checked before measuring anything); 130 on Ctrl-C (143 on SIGTERM),
after every process the bench started is killed and reaped.
"""

EPILOG = """\
examples:
  fastspawn bench
  fastspawn bench --methods fastspawn,mp --nprocs 1,8,64,256 --repeat 5 --json bench.json
  fastspawn bench --import torch --methods fastspawn-zygote-warm,mp-spawn,torch-spawn --nprocs 8
  fastspawn bench --methods fastspawn,mp,binary --nprocs 1,8,64 --repeat 3 --plot bench.png
  fastspawn bench --methods floor,fastspawn,mp --nprocs 8,64 --repeat 3
"""


def build_parser() -> argparse.ArgumentParser:
    import argparse

    methods = "\n".join(f"  {name:24} {text}" for name, text in METHOD_HELP.items())
    parser = argparse.ArgumentParser(
        prog="fastspawn bench",
        description=DESCRIPTION.format(methods=methods),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--methods",
        default="all",
        metavar="LIST",
        help="comma list of methods or groups (default: all)",
    )
    parser.add_argument(
        "--nprocs",
        default="1,8,64",
        metavar="LIST",
        help="comma list of rank counts (default: 1,8,64)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        metavar="R",
        help="rounds per method and nprocs (default: 5)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        default="",
        metavar="MODULES",
        help="comma list of modules every rank imports on entry, as your fn's module "
        "would (the zygote and forkservers preload them), e.g. torch",
    )
    parser.add_argument(
        "--payload-bytes",
        default="0",
        metavar="SIZE",
        help="pass a bytes argument of this size (4096, 64K, 1M, ...) to every rank (default: 0)",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write every raw sample and the machine here"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw latency against nprocs per method (needs matplotlib: fastspawn[plot])",
    )
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: stop everything, exit 128+15."""

    signum = signal.SIGTERM


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


class _BareMain:
    """Hide this process's ``__main__`` (the CLI) while measuring.

    multiprocessing's preparation data names the caller's main module, and
    every spawn-like rank (of any launcher here) re-imports it: for this CLI
    that is argparse and fastspawn.elastic, ~60 ms per rank that measure the
    bench, not the launch.  A bare module leaves them nothing to import.
    """

    def __enter__(self) -> None:
        import types

        self.saved = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.modules["__main__"] = self.saved


class _Quiet:
    """Silence the launchers' per-rank teardown warnings ("Terminating
    process ...") in failure rounds, and Python 3.12's warning about fork in
    a process with threads (the zygote client's watcher thread)."""

    LOGGERS = ("fastspawn", "torch.multiprocessing")

    def __enter__(self) -> None:
        import logging
        import warnings

        self.levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in self.LOGGERS]
        for logger, _ in self.levels:
            logger.setLevel(logging.ERROR)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for logger, level in self.levels:
            logger.setLevel(level)
        self.warnings.__exit__(kind, exc, tb)


def _child_pids() -> set[int]:
    """This process's children, from /proc (ppid field of each stat)."""
    me = os.getpid()
    children = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            if int(data[data.rindex(b")") + 2 :].split()[1]) == me:
                children.add(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def stop_everything(live: list[Launched], children_before: set[int]) -> None:
    """Kill and reap every process the bench started, by pid."""
    for launched in reversed(live):
        try:
            launched.kill()
        except Exception:  # keep going: the sweep below still gets them
            pass
    live.clear()
    import fastspawn

    fastspawn.stop_zygote()  # its workers we may not know of die with it
    # Whatever else we started (a launch interrupted before its handle
    # existed, multiprocessing's forkserver and resource tracker).  Ranks
    # that are not our children exit by themselves once we are gone.
    leftovers = _child_pids() - children_before
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in leftovers:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _say(text: str) -> None:
    print(f"fastspawn bench: {text}", file=sys.stderr)


class Options:
    """The command line, checked.

    Raises:
        UsageError: from the constructor, naming the bad option.
    """

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        items = {part.strip() for part in args.methods.split(",")}
        # torch is imported only where torch-spawn may run (it takes seconds).
        problem = torch_problem() if items & {"all", "torch", "torch-spawn"} else None
        self.methods, self.notes = parse_methods(args.methods, problem)
        self.nprocs = parse_nprocs(args.nprocs)
        if args.repeat < 1:
            raise UsageError(f"--repeat must be at least 1; got {args.repeat}")
        self.repeat: int = args.repeat
        self.imports = [m.strip() for m in args.imports.split(",") if m.strip()]
        self.payload_bytes = parse_size(args.payload_bytes)
        _check_output(args.json, "--json")
        _check_plot(args.plot)
        self.json: str | None = args.json
        self.plot: str | None = args.plot
        self.argv = list(argv)


def measure(
    options: Options, reports: Reports, live: list[Launched], children_before: set[int]
) -> list[Record]:
    """Run the sweep; whatever happens, nothing it started outlives it."""
    import shutil

    problem = check_limits(max(options.nprocs), options.methods, reports)
    if problem is not None:
        raise UsageError(problem)
    _import_all(options.imports)
    if summed_uss([os.getpid()]) is None:
        _say("psutil is missing or denied: USS not measured (pip install 'fastspawn[bench]')")
    binary = shutil.which("true") or "/bin/true"
    session = Session(reports, options.imports, options.payload_bytes, binary, live)
    methods = [make_method(name) for name in options.methods]
    progress = Progress(sys.stderr)
    with _BareMain(), _Quiet():
        try:
            return sweep(methods, options.nprocs, options.repeat, session, progress)
        except BaseException:
            # Ctrl-C, SIGTERM or a failed round: a second signal must not cut
            # the clean-up short (main restores the handlers).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            progress.clear()
            stop_everything(live, children_before)
            raise
        finally:
            import fastspawn

            fastspawn.stop_zygote()
            for method in methods:
                method.teardown()


def report(options: Options, records: list[Record], started: float) -> None:
    """The table on stdout, then --json and --plot."""
    described = machine()
    summary = summarize(records, options.methods)
    sys.stdout.write(format_table(summary, options.methods, options.repeat, described))
    sys.stdout.flush()
    if options.json is not None:
        import json
        import shutil

        document = {
            "schema": SCHEMA_ID,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "duration_s": time.time() - started,
            "machine": described,
            "config": {
                "methods": options.methods,
                "nprocs": options.nprocs,
                "repeat": options.repeat,
                "imports": options.imports,
                "payload_bytes": options.payload_bytes,
                "binary": shutil.which("true") or "/bin/true",
                "argv": options.argv,
            },
            "rounds": records,
            "summary": summary,
        }
        with open(options.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    if options.plot is not None:
        title = (
            f"fastspawn bench: {described['cpu']}, {described['usable_cores']} usable cores, "
            f"{options.repeat} rounds per point (median, bars min-p90)"
        )
        plot(summary, options.methods, options.plot, title)


def run(
    args: argparse.Namespace, argv: Sequence[str], live: list[Launched], children_before: set[int]
) -> int:
    """Check the options, measure, report; returns the exit status."""
    import tempfile

    try:
        options = Options(args, argv)
    except UsageError as exc:
        _say(f"error: {exc}")
        return 2
    for note in options.notes:
        _say(note)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="fastspawn-bench-") as folder:
        reports = Reports(folder)
        try:
            records = measure(options, reports, live, children_before)
        except UsageError as exc:
            _say(f"error: {exc}")
            return 2
        except BenchError as exc:
            _say(
                f"a measurement failed: {exc}\n(every process it started is stopped; "
                "--methods with just that method reproduces it faster)"
            )
            return 1
        finally:
            reports.close()
    report(options, records, started)
    return 0


def main(argv: Sequence[str]) -> int:
    """``fastspawn bench ARGS``; returns the exit status."""
    args = build_parser().parse_args(list(argv))
    children_before = _child_pids()
    live: list[Launched] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return run(args, argv, live, children_before)
    except KeyboardInterrupt as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # Done already when the sweep was running; this covers the rest
        # (an interrupted import, say) and costs nothing twice.
        stop_everything(live, children_before)
        _say("interrupted; every process it started is stopped and reaped")
        return 128 + int(getattr(exc, "signum", signal.SIGINT))
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


# ----------------------------------------------------------------- schema

SCHEMA_FILE = "bench.schema.json"  # in the package, beside this module


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the ``--json`` document, shipped
    with the package as ``bench.schema.json``."""
    import json
    from importlib import resources

    text = resources.files("fastspawn").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema
