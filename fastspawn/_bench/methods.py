"""The methods the bench compares, each a Method that starts a round's
ranks and the Launched handle it returns (fastspawn's, multiprocessing's,
torch's, and the binary launchers); the floor is in ``floor``."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from fastspawn._bench.common import BenchError
from fastspawn._bench.ranks import rank_main
from fastspawn._bench.session import Launched, Session

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastspawn._bench.ranks import RankSpec
    from fastspawn._launch.methods.registry import StartMethodName


def describe_exit(rank: int, pid: int, code: int | None) -> str:
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
                return describe_exit(proc.rank, proc.pid, proc.exitcode)
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
        from fastspawn._launch.errors import ProcessException

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
                return describe_exit(rank, proc.pid, proc.exitcode)
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


class Method:
    """One way of starting processes."""

    binary = False
    failure_round = True

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, session: Session) -> None:
        """Once, before the warm-up round."""

    def prepare(self, session: Session, nprocs: int) -> None:
        """Before every round of ``nprocs`` ranks, untimed."""

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        """Start the ranks; the handle is in ``session.live`` once it exists."""
        raise NotImplementedError

    def settle(self, nprocs: int) -> None:
        """After every round of ``nprocs`` ranks, untimed: wait for what the
        round set the method's helper doing in the background, so that the
        next round (another method's, say) has the cores to itself."""

    def helper_pids(self) -> list[int]:
        """The long-lived process that forks the ranks, if there is one."""
        return []

    def teardown(self) -> None:
        """Once, after the last round (or a failure, or an interruption):
        stop and reap what ``setup`` started."""


class FastspawnMethod(Method):
    """``state``, for the zygote: "warm" (running, every rank forked),
    "cold" (stopped before each round), "ready" (prefork(nprocs) before
    each round), "refilled" (each round the second of two launches, its
    ranks made ready by the zygote in the background)."""

    def __init__(self, name: str, start_method: StartMethodName, state: str = "warm") -> None:
        super().__init__(name)
        self.start_method = start_method
        self.state = state
        # After its launch a cold zygote is a warm one: the failure round
        # would repeat fastspawn-zygote-warm's.
        self.failure_round = state != "cold"

    def prepare(self, session: Session, nprocs: int) -> None:
        import fastspawn
        from fastspawn._launch.methods import registry

        method = registry.get(self.start_method)
        if self.state == "cold":
            fastspawn.stop_zygote()
            return
        if method.supports_preload and not method.helper_pids():
            # No zygote (it died?): start one and let it import this module
            # and the preloads, so that the timed launch finds it warm.
            fastspawn.start_processes(
                _noop, nprocs=1, start_method=self.start_method, preload=list(session.imports)
            )
        if not method.supports_preload:
            return
        if self.state == "warm":
            fastspawn.prefork(0, refill=False)
        elif self.state == "ready":
            # Made now, as the pre-forked floors make their children: none
            # left from an earlier round, idle (and colder) since, and none
            # made again in the background after this round's launch, where
            # it would share the cores with the next round's.
            fastspawn.prefork(0, refill=False)
            fastspawn.prefork(nprocs, refill=False)
        elif self.state == "refilled":
            fastspawn.prefork(0)  # none ready: the background's only
            fastspawn.start_processes(
                _noop, nprocs=nprocs, start_method=self.start_method, preload=list(session.imports)
            )
            _await_ready(method, nprocs)

    def settle(self, nprocs: int) -> None:
        # The refilled row's workers, taken by its launch, are made ready
        # again in the background once it has ended; left to it, that shared
        # the cores with the next round's timed launch (a floor's, as the
        # rounds are ordered: the ready row's refill, when it had one, was
        # 16% of the CPU samples there, 5 rounds of 64 ranks with torch
        # preloaded, perf, AMD EPYC).
        if self.state == "refilled":
            _await_ready(self, nprocs)

    def launch(self, nprocs: int, spec: RankSpec, session: Session) -> Launched:
        import fastspawn
        from fastspawn._launch.methods import registry

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
        from fastspawn._launch.methods import registry

        return sorted(registry.get(self.start_method).helper_pids())


def _noop(rank: int) -> None:
    """A rank that does nothing: warms the zygote up."""


def _await_ready(method: Any, nprocs: int) -> None:
    """Wait until the zygote has ``nprocs`` ready workers, made in the
    background, or until their number has not grown for a second (its cap,
    FASTSPAWN_READY, may be lower), and it and each of them are done: asleep
    at two looks in a row, CPU time unchanged between them (its helper
    processes are its guard, itself and those).  No longer: a launch after
    a pause costs more on some machines, the more memory its ranks touch
    (benchmarks/README.md, "The second launch's wait, and a launch after a
    pause"), and the ready row and the floors launch with none.  Thirty
    seconds at most: the timed launch forks what is not ready then."""
    grew = time.monotonic()
    deadline = grew + 30.0
    before: dict[int, int | None] = {}
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = {pid: _cpu_if_asleep(pid) for pid in method.helper_pids()}
        if len(now) > len(before):
            grew = time.monotonic()
        done = all(cpu is not None and before.get(pid) == cpu for pid, cpu in now.items())
        before = now
        if done and (len(now) >= nprocs + 2 or time.monotonic() > grew + 1.0):
            return


def _cpu_if_asleep(pid: int) -> int | None:
    """The CPU time (clock ticks) of a process asleep; None while it runs,
    or once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12]) if fields[0] == b"S" else None


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
