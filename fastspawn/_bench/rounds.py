"""The rounds: one launch (or failure) of one method at one nprocs, its
phases timed from the ranks' records; the sweep over methods and sizes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, cast

from fastspawn._bench import cputime
from fastspawn._bench.common import FLOOR, BenchError, RoundFailed
from fastspawn._bench.floor import FloorMethod
from fastspawn._bench.methods import (
    BinaryFastspawn,
    BinaryPopen,
    FastspawnMethod,
    Method,
    MpMethod,
    TorchMethod,
)
from fastspawn._bench.progress import Estimate
from fastspawn._bench.ranks import ENTERED, EXITED, FAILED
from fastspawn._bench.session import Session

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from fastspawn._bench.progress import Progress
    from fastspawn._bench.ranks import Record
    from fastspawn._launch.methods.registry import StartMethodName


def make_method(name: str) -> Method:
    """The method called ``name`` (one of :data:`ALL_METHODS`)."""
    family, _, rest = name.partition("-")
    if family == "fastspawn":
        # fastspawn-<method>, or fastspawn-<method>-warm / -cold / -ready /
        # -refilled for the default method, whose long-lived process a
        # launch may find running, and ready workers in it.
        method, _, state = rest.partition("-")
        # A name of METHOD_HELP, built from the registry's: one of its methods.
        return FastspawnMethod(name, cast("StartMethodName", method), state or "warm")
    if family == "mp":
        return MpMethod(name, rest)
    if family == "torch":
        return TorchMethod(name)
    if family == FLOOR:
        return FloorMethod(name)
    if name == "binary-fastspawn":
        return BinaryFastspawn(name)
    return BinaryPopen(name, pdeathsig=name == "binary-popen-pdeathsig")


# (phase, record key, unit)
PHASE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("created", "created_s", "s"),
    ("running", "running_s", "s"),
    ("joined", "joined_s", "s"),
    ("failure", "failure_s", "s"),
    ("reaped", "reaped_s", "s"),
    ("uss", "uss_bytes", "bytes"),
    ("helper_uss", "helper_uss_bytes", "bytes"),
    ("cpu", "cpu_s", "s"),
    ("rank_cpu", "rank_cpu_s", "s"),
    ("helper_cpu", "helper_cpu_s", "s"),
    ("caller_cpu", "caller_cpu_s", "s"),
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

    method.prepare(session, nprocs)
    fail_rank = nprocs // 2 if failure else -1
    spec = session.spec(fail_rank)
    round_id = spec[2]
    gc.collect()  # not in the timed part
    cpu = cputime.snapshot() if session.cpu and not failure else None
    time.sleep(session.pause)
    if cpu is not None:
        cpu = cputime.bench_now(cpu)
    t0 = time.monotonic()
    launched = method.launch(nprocs, spec, session)
    created = time.monotonic()
    entries = session.reports.wait(round_id, ENTERED, nprocs, launched)
    bench_ns = cputime.bench_ns() if cpu is not None else 0
    record = new_record(method.name, nprocs, round_no, "failure" if failure else "launch")
    if failure:
        launched.release([fail_rank])
        launched.join_failure()
        done = time.monotonic()
        failed = session.reports.wait(round_id, FAILED, 1, None)
        record["failure_s"] = done - failed[fail_rank]
    else:
        helpers = method.helper_pids()
        if cpu is not None:
            record.update(cputime.spent(cpu, bench_ns, launched.pids(), helpers))
        record["uss_bytes"] = summed_uss(launched.pids())
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
    method.settle(nprocs)
    return record


def binary_round(method: Method, nprocs: int, round_no: int, session: Session) -> Record:
    """One round of a binary method: start ``nprocs`` binaries, reap them all."""
    import gc

    method.prepare(session, nprocs)
    gc.collect()
    time.sleep(session.pause)
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


class Planned(NamedTuple):
    """One round to measure."""

    method: Method
    nprocs: int
    round_no: int
    failure: bool


def plan(
    methods: Sequence[Method], nprocs_list: Sequence[int], repeat: int, caps: Mapping[str, int]
) -> list[Planned]:
    """Every round, in order: by nprocs, then round number; within a round
    number every method once (failure round after launch round), the order
    rotated each time so that drift on a noisy machine hits them all alike
    and no method always follows the same one.  A method in ``caps`` is kept
    small: launch rounds only, at nprocs up to its cap."""
    rounds = []
    for nprocs in nprocs_list:
        here = [m for m in methods if nprocs <= caps.get(m.name, nprocs)]
        for round_no in range(repeat):
            shift = round_no % len(here) if here else 0
            for method in [*here[shift:], *here[:shift]]:
                failures = method.failure_round and method.name not in caps
                for failure in (False, True) if failures else (False,):
                    rounds.append(Planned(method, nprocs, round_no, failure))
    return rounds


def measure_round(planned: Planned, session: Session) -> Record:
    """The round measured, or RoundFailed naming it."""
    method, nprocs, round_no, failure = planned
    try:
        if method.binary:
            return binary_round(method, nprocs, round_no, session)
        return python_round(method, nprocs, round_no, session, failure)
    except Exception as exc:  # a launch refused (EAGAIN, ENOMEM, ...) or a rank failed
        why = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
        kind = "failure" if failure else "launch"
        raise RoundFailed(method.name, nprocs, round_no, kind, why) from exc


def warm_up(
    methods: Sequence[Method], probe: int, session: Session, progress: Progress
) -> Estimate:
    """Set every method up and launch it once with one rank (starts servers,
    fills caches), then with ``probe`` ranks; neither is recorded, both
    time the estimate."""
    estimate = Estimate()
    for method in methods:
        progress.status(f"warming up {method.name}")
        method.setup(session)
        for nprocs in (1, probe) if probe > 1 else (1,):
            started = time.monotonic()
            measure_round(Planned(method, nprocs, -1, False), session)
            estimate.add(method.name, nprocs, time.monotonic() - started)
    progress.clear()
    return estimate


def sweep(
    rounds: Sequence[Planned], session: Session, progress: Progress, records: list[Record]
) -> None:
    """Measure ``rounds`` in order into ``records``: a failed round raises
    RoundFailed, and the records of the rounds before it stay."""
    for planned in rounds:
        method, nprocs, round_no, failure = planned
        progress.round_starts(
            f"{method.name} nprocs={nprocs} round {round_no + 1}{' (failure)' if failure else ''}"
        )
        records.append(measure_round(planned, session))
        progress.round_done()
    progress.clear()
