"""``fastspawn bench``: a run measured, reported and torn down whatever
stops it; the JSON output's schema."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from fastspawn._bench import cputime
from fastspawn._bench.common import SCHEMA_ID, RoundFailed, UsageError
from fastspawn._bench.host import check_limits, machine, uncached_modules, usable_cores
from fastspawn._bench.options import MP_FLAG, Options, build_parser, import_all
from fastspawn._bench.progress import Progress, clock
from fastspawn._bench.rounds import make_method, plan, summed_uss, sweep, warm_up
from fastspawn._bench.session import Launched, Reports, Session
from fastspawn._bench.summary import format_table, plot, summarize

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from types import TracebackType

    from fastspawn._bench.ranks import Record


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


def _announce(options: Options, progress: Progress) -> None:
    nprocs = ",".join(map(str, options.nprocs))
    length = "" if options.full else " (--full: the long sweep)"
    progress.say(
        f"{len(options.methods)} method(s) at nprocs {nprocs}, {options.repeat} round(s) "
        f"each{length}"
    )
    for name, cap in options.caps.items():
        progress.say(f"{name}: launch rounds only, up to nprocs {cap}")


def _say_what_skews(cpu: bool) -> None:
    """Say what this machine leaves out of the figures, or adds to them."""
    uncached = uncached_modules()
    if uncached:
        import fastspawn

        why = " (PYTHONDONTWRITEBYTECODE is set)" if sys.dont_write_bytecode else ""
        _say(
            f"{len(uncached)} of fastspawn's modules have no bytecode cache here{why}: every "
            "fresh interpreter (a spawned rank, a zygote or forkserver starting) compiles them "
            "first, and the figures include that; `python -m compileall -q "
            f"{os.path.dirname(fastspawn.__file__)}` caches them"
        )
    if not cpu:
        _say(
            "this kernel refuses processes' CPU clocks or shows no children in /proc: "
            "CPU time not measured"
        )


def measure(
    options: Options,
    reports: Reports,
    live: list[Launched],
    children_before: set[int],
    records: list[Record],
) -> None:
    """Run the sweep into ``records``; whatever happens, nothing it started
    outlives it, and the rounds finished before a failure stay in ``records``."""
    import shutil

    problem = check_limits(max(options.nprocs), options.methods, reports)
    if problem is not None:
        raise UsageError(problem)
    import_all(options.imports)
    if summed_uss([os.getpid()]) is None:
        _say("psutil is missing or denied: USS not measured (pip install 'fastspawn[bench]')")
    cpu = cputime.available()
    binary = shutil.which("true") or "/bin/true"
    session = Session(
        reports, options.imports, options.payload_bytes, binary, live, options.pause, cpu
    )
    methods = [make_method(name) for name in options.methods]
    rounds = plan(methods, options.nprocs, options.repeat, options.caps)
    progress = Progress(sys.stderr)
    _announce(options, progress)
    _say_what_skews(cpu)
    progress.say("warming every method up to estimate how long the rounds take")
    probe = min(max(options.nprocs), 2 * usable_cores())
    with _BareMain(), _Quiet():
        try:
            estimate = warm_up(methods, probe, session, progress)
            planned_s = [estimate.round_s(r.method.name, r.nprocs) for r in rounds]
            progress.say(f"{len(rounds)} rounds to measure: about {clock(sum(planned_s))}")
            progress.begin(planned_s)
            sweep(rounds, session, progress, records)
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


def _document(
    options: Options,
    records: list[Record],
    summary: list[Record],
    described: Record,
    started: float,
    failed: RoundFailed | None,
) -> Record:
    """The --json document (schema: bench.schema.json)."""
    import shutil

    return {
        "schema": SCHEMA_ID,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": time.time() - started,
        "machine": described,
        "config": {
            "methods": options.methods,
            "nprocs": options.nprocs,
            "repeat": options.repeat,
            "full": options.full,
            "caps": options.caps,
            "imports": options.imports,
            "payload_bytes": options.payload_bytes,
            "pause_s": options.pause,
            "binary": shutil.which("true") or "/bin/true",
            "argv": options.argv,
        },
        "rounds": records,
        "summary": summary,
        "failed": None
        if failed is None
        else {
            "method": failed.method,
            "nprocs": failed.nprocs,
            "round": failed.round_no,
            "kind": failed.kind,
            "message": failed.why,
        },
    }


def report(
    options: Options, records: list[Record], started: float, failed: RoundFailed | None = None
) -> None:
    """The table on stdout, then --json and --plot: of every round measured,
    all of them or those finished before ``failed``."""
    described = machine()
    summary = summarize(records, options.methods)
    if records:
        if failed is not None:
            print(f"(the {len(records)} round(s) measured before {failed.method} failed)")
        sys.stdout.write(
            format_table(summary, options.methods, options.repeat, described, options.pause)
        )
        sys.stdout.flush()
    if options.json is not None:
        import json

        document = _document(options, records, summary, described, started, failed)
        with open(options.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    if options.plot is not None and records:
        title = (
            f"{described['cpu']}, {described['usable_cores']} usable cores, "
            f"{options.repeat} rounds per point (median, bars min-p90)"
        )
        plot(summary, options.methods, options.plot, title)


def _failed(options: Options, exc: RoundFailed, measured: int) -> None:
    kept = "no round was measured before it"
    if measured:
        kept = "the rounds measured before it are above"
        if options.json is not None:
            kept += f" and in {options.json}"
    _say(
        f"a measurement failed: {exc}\n"
        f"({kept}; every process the bench started is stopped; to measure just that "
        f"method and size: fastspawn bench --methods {exc.method} --nprocs {exc.nprocs})"
    )


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
    records: list[Record] = []
    with tempfile.TemporaryDirectory(prefix="fastspawn-bench-") as folder:
        reports = Reports(folder)
        try:
            measure(options, reports, live, children_before, records)
        except UsageError as exc:
            _say(f"error: {exc}")
            return 2
        except RoundFailed as exc:
            report(options, records, started, exc)
            _failed(options, exc, len(records))
            return 1
        finally:
            reports.close()
    report(options, records, started)
    return 0


def main(argv: Sequence[str]) -> int:
    """``fastspawn bench ARGS``; returns the exit status."""
    if MP_FLAG in argv:  # a mode of its own, with its own options
        from fastspawn._bench import mp_scenarios

        return mp_scenarios.main([arg for arg in argv if arg != MP_FLAG])
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


SCHEMA_FILE = "bench.schema.json"  # in this package, beside this module


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the ``--json`` document, shipped
    with the package as ``bench.schema.json``."""
    import json
    from importlib import resources

    text = (
        resources.files(__name__.rpartition(".")[0])
        .joinpath(SCHEMA_FILE)
        .read_text(encoding="utf-8")
    )
    schema: dict[str, Any] = json.loads(text)
    return schema
