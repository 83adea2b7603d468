"""``fastspawn bench --mp``: fastspawn's multiprocessing contexts against
multiprocessing's own, with torch imported, in three scenarios a program
meets: a torch DataLoader's epochs, a ProcessPoolExecutor's life, one
Process started and joined.

Every context's measurements run in a fresh interpreter whose main module
is ``mp_child`` (``python -m``), a minimal one that imports torch and
fastspawn: multiprocessing's spawn and forkserver workers re-import the
caller's main module, and from this bench's own (argparse, the bench) they
would measure the bench.  Its rows run one after the other in each round,
in reverse order every other round, so drift on a busy machine hits them
alike; a "floor" row, from the same minimal module, forks bare
(``os.fork()``, ``os._exit(0)``, ``waitpid``) and runs the loader in-process.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

from fastspawn._bench.common import FLOOR, UsageError
from fastspawn._bench.summary import _grid, _number, _ratio, quantile

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

SCHEMA_ID = "fastspawn-bench-mp/1"
BASE = "mp-fork"  # the ratios' denominator
FORKSERVER = "mp-forkserver"  # the goals' "faster than forkserver"
ZYGOTE = "fastspawn"  # fastspawn.get_context()'s default

# row -> what it is (for --help); the child's mp_child.get_context maps the name.
CONTEXTS: dict[str, str] = {
    FLOOR: "no context: a bare os.fork() loop per process, the loader in-process",
    BASE: 'multiprocessing.get_context("fork")',
    FORKSERVER: "multiprocessing's forkserver, as configured by default (no preload)",
    "mp-spawn": "multiprocessing's spawn",
    ZYGOTE: "fastspawn.get_context(): the zygote, stopped first (started in epoch 1)",
    "fastspawn-fork": "fastspawn's fork context",
    "fastspawn-forkserver": "fastspawn's forkserver context (the zygote's way)",
    "fastspawn-spawn": "fastspawn's spawn context (a fresh interpreter per process)",
}
DEFAULT_CONTEXTS = (FLOOR, BASE, FORKSERVER, "mp-spawn", ZYGOTE, "fastspawn-fork")
# Each of their workers imports torch (seconds): fewer repeats.
SLOW = frozenset({FORKSERVER, "mp-spawn", "fastspawn-spawn"})

# (name, what) of the metrics, in the table's order.
METRICS: tuple[tuple[str, str], ...] = (
    ("first_epoch", "DataLoader's first epoch (the zygote or forkserver starts in it)"),
    ("warm_epoch", "DataLoader epochs 2..N (new workers each: persistent_workers=False)"),
    ("pool", "ProcessPoolExecutor: created, its results in, shut down"),
    ("process", "one Process: start, join, close (floor: fork, _exit, waitpid)"),
)

# (metric, numerator, denominator, comparison, bound): the goals.
GOALS: tuple[tuple[str, str, str, str, float], ...] = (
    ("warm_epoch", ZYGOTE, BASE, "<=", 1.5),
    ("warm_epoch", FORKSERVER, ZYGOTE, ">=", 20.0),
    ("pool", ZYGOTE, BASE, "<=", 1.5),
    ("pool", FORKSERVER, ZYGOTE, ">=", 10.0),
)


class Sizes:
    """One run's sizes: the issue's (full), or tiny ones (--quick)."""

    def __init__(self, quick: bool, rounds: int | None, processes: int | None) -> None:
        self.quick = quick
        self.rounds = rounds if rounds is not None else (1 if quick else 2)
        self.workers = 2 if quick else 8
        self.items = 16 if quick else 256
        self.batch = 4 if quick else 8
        self.epochs = 3 if quick else 6  # per run: the first, then warm ones
        self.slow_epochs = 2
        self.pool_workers = 2 if quick else 8
        self.pool_results = 4 if quick else 64
        self.pool_repeats = 2 if quick else 5
        self.slow_pool_repeats = 1
        # Processes per row over the whole run, split between the rounds.
        self.processes = processes if processes is not None else (20 if quick else 1000)
        self.slow_processes = 1 if quick else 2  # per round
        if self.rounds < 1 or self.processes < 1:
            raise UsageError("--rounds and --processes must be at least 1")

    def child_config(self, name: str) -> dict[str, int]:
        slow = name in SLOW
        per_round = -(-self.processes // self.rounds)
        return {
            "workers": self.workers,
            "items": self.items,
            "batch": self.batch,
            "epochs": self.slow_epochs if slow else self.epochs,
            "pool_workers": self.pool_workers,
            "pool_results": self.pool_results,
            "pool_repeats": self.slow_pool_repeats if slow else self.pool_repeats,
            "process_n": self.slow_processes if slow else per_round,
        }

    def describe(self) -> dict[str, Any]:
        return {
            key: getattr(self, key)
            for key in (
                "quick",
                "rounds",
                "workers",
                "items",
                "batch",
                "epochs",
                "slow_epochs",
                "pool_workers",
                "pool_results",
                "pool_repeats",
                "slow_pool_repeats",
                "processes",
                "slow_processes",
            )
        }


def parse_contexts(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in CONTEXTS]
    if unknown or not names:
        raise UsageError(
            f"--contexts: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
            f"valid: {', '.join(CONTEXTS)}"
        )
    return [n for n in CONTEXTS if n in names]  # the table's order


def build_parser() -> argparse.ArgumentParser:
    import argparse

    rows = "\n".join(f"  {name:22} {text}" for name, text in CONTEXTS.items())
    metrics = "\n".join(f"  {name:12} {text}" for name, text in METRICS)
    parser = argparse.ArgumentParser(
        prog="fastspawn bench --mp",
        description=f"{__doc__}\nRows (--contexts; default {','.join(DEFAULT_CONTEXTS)}):\n"
        f"{rows}\n\nMetrics (seconds per sample; the table shows medians in ms):\n{metrics}\n\n"
        "Full sizes: DataLoader of 8 workers over 256 items (torch.tensor([i])), batch 8,\n"
        "6 epochs per run; pool of 8 workers, 64 results, 5 runs; 1000 processes per row\n"
        "over the run; 2 rounds.  Rows whose workers import torch (mp-spawn,\n"
        "mp-forkserver, fastspawn-spawn) do 2 epochs, 1 pool run and 2 processes per\n"
        "round.  About 4 minutes on 2 cores.  --quick: tiny sizes, 1 round (under a\n"
        "minute); its ratios are not the issue's and its goals are not judged.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--contexts", default=",".join(DEFAULT_CONTEXTS), metavar="LIST")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round")
    parser.add_argument("--rounds", type=int, metavar="R", help="rounds (default 2; --quick 1)")
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="processes per fast row over the run (default 1000; --quick 20)",
    )
    parser.add_argument("--json", metavar="FILE", help="write every sample and the summary")
    return parser


# ------------------------------------------------------------ measuring


def _child_module() -> str:
    return __name__.rpartition(".")[0] + ".mp_child"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _die_with_us() -> None:
    import signal

    from fastspawn._os import oscall

    oscall.set_pdeathsig(signal.SIGKILL, os.getppid())


def run_child(name: str, config: dict[str, int], folder: str) -> dict[str, Any]:
    """One row's measurements in a fresh ``python -m mp_child``; its whole
    process group is killed if anything (Ctrl-C) stops the wait.

    Raises:
        RuntimeError: the child failed (its output's end in the message).
    """
    import json
    import signal
    import subprocess

    out = os.path.join(folder, f"{name}.json")
    log = os.path.join(folder, f"{name}.log")
    env = dict(os.environ)
    # The children import the fastspawn this process runs, wherever it is.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", _child_module(), name, json.dumps(config), out]
    with open(log, "w+b") as output:
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_us,
        )
        try:
            code = proc.wait()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its workers, whatever is left
            except ProcessLookupError:
                pass
            proc.wait()
        if code != 0:
            output.seek(0)
            tail = output.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{name}: the measuring child exited with {code}:\n{tail}")
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    return result


def measure(contexts: Sequence[str], sizes: Sizes, runs: list[dict[str, Any]]) -> None:
    """Every round, every row, into ``runs`` (one record per child)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fastspawn-bench-mp-") as folder:
        for round_no in range(sizes.rounds):
            order = list(contexts) if round_no % 2 == 0 else list(reversed(contexts))
            for name in order:
                t0 = time.monotonic()
                result = run_child(name, sizes.child_config(name), folder)
                result["round"] = round_no
                result["wall_s"] = time.monotonic() - t0
                runs.append(result)
                _say(f"round {round_no + 1}/{sizes.rounds} {name}: {result['wall_s']:.1f} s")


def _say(text: str) -> None:
    print(f"fastspawn bench --mp: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------ summarizing


def _samples(runs: Sequence[dict[str, Any]], name: str, metric: str) -> list[float]:
    mine = [r for r in runs if r["context"] == name]
    if metric == "first_epoch":
        return [r["epochs_s"][0] for r in mine if r["epochs_s"]]
    if metric == "warm_epoch":
        return [e for r in mine for e in r["epochs_s"][1:]]
    key = {"pool": "pool_s", "process": "process_s"}[metric]
    return [s for r in mine for s in r[key]]


def summarize(runs: Sequence[dict[str, Any]], contexts: Sequence[str]) -> list[dict[str, Any]]:
    """Per row and metric: samples, median, min, max, and the median over
    mp-fork's, mp-forkserver's over it, and (processes) over the floor's."""
    medians: dict[tuple[str, str], float] = {}
    summary: list[dict[str, Any]] = []
    for name in contexts:
        for metric, _what in METRICS:
            values = _samples(runs, name, metric)
            if values:
                medians[(name, metric)] = quantile(values, 0.5)
                summary.append(
                    {
                        "context": name,
                        "metric": metric,
                        "samples": len(values),
                        "median_s": medians[(name, metric)],
                        "min_s": min(values),
                        "max_s": max(values),
                    }
                )
    for row in summary:
        median = row["median_s"]
        base = medians.get((BASE, row["metric"]))
        forkserver = medians.get((FORKSERVER, row["metric"]))
        floor = medians.get((FLOOR, row["metric"])) if row["metric"] == "process" else None
        row["over_fork"] = median / base if base else None
        row["forkserver_over"] = forkserver / median if forkserver and median > 0 else None
        row["over_floor"] = median / floor if floor else None
    return summary


def judge(summary: Sequence[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """The issue's goals, each with its measured ratio; ``met`` is None
    where a row was not measured or the sizes were --quick's."""
    medians = {(s["context"], s["metric"]): s["median_s"] for s in summary}
    goals = []
    for metric, top, bottom, comparison, bound in GOALS:
        a, b = medians.get((top, metric)), medians.get((bottom, metric))
        ratio = a / b if a is not None and b else None
        met = None
        if ratio is not None and not quick:
            met = ratio <= bound if comparison == "<=" else ratio >= bound
        goals.append(
            {
                "metric": metric,
                "ratio": f"{top} / {bottom}",
                "goal": f"{comparison} {bound:g}",
                "measured": ratio,
                "met": met,
            }
        )
    return goals


def format_report(
    summary: Sequence[dict[str, Any]],
    goals: Sequence[dict[str, Any]],
    contexts: Sequence[str],
    sizes: Sizes,
    described: dict[str, Any],
) -> str:
    """The tables: medians with ratios, then spreads; then the goals."""
    stats = {(s["context"], s["metric"]): s for s in summary}

    def cell(name: str, metric: str, field: str) -> str:
        found = stats.get((name, metric))
        if found is None:
            return "-"
        if field == "median_s":
            return _number(found[field] * 1000)
        if field == "spread":
            lo, hi = found["min_s"] * 1000, found["max_s"] * 1000
            return f"{_number(lo)}-{_number(hi)} n={found['samples']}"
        return _ratio(found[field])

    pool = f"pool {sizes.pool_workers}x{sizes.pool_results}"
    head = ["context", "1st epoch", "warm epoch", "vs fork", pool, "vs fork", "Process"]
    head += ["vs fork", "vs floor"]
    rows = [head]
    for name in contexts:
        rows.append(
            [
                name,
                cell(name, "first_epoch", "median_s"),
                cell(name, "warm_epoch", "median_s"),
                cell(name, "warm_epoch", "over_fork"),
                cell(name, "pool", "median_s"),
                cell(name, "pool", "over_fork"),
                cell(name, "process", "median_s"),
                cell(name, "process", "over_fork"),
                cell(name, "process", "over_floor"),
            ]
        )
    spread = [["context", "1st epoch", "warm epoch", pool, "Process"]]
    for name in contexts:
        spread.append([name, *(cell(name, m, "spread") for m, _ in METRICS)])
    lines = [
        # Two lines: a CPU's name alone can be 50 characters.
        f"CPU: {described['cpu']}, {described['usable_cores']} usable cores",
        f"Python {described['python']}; torch {described['torch']}; "
        f"fastspawn {described['fastspawn']}",
        f"Each row measured in a fresh `python -m {_child_module()}`:",
        "a minimal main module importing torch and fastspawn (spawn's workers re-import it).",
        f"{sizes.rounds} round(s), rows interleaved.  DataLoader: {sizes.workers} workers, "
        f"{sizes.items} items, batch {sizes.batch}, persistent_workers=False.",
        *(["QUICK sizes: not the issue's; the goals are not judged."] if sizes.quick else []),
        "",
        "Medians, ms ('vs fork': over mp-fork's median; floor: a bare fork loop, "
        "an in-process loader):",
        *_grid(rows),
        "",
        "Spread, ms (min-max, samples):",
        *_grid(spread),
        "",
        "Goals (the issue's):",
    ]
    for goal in goals:
        measured = "not measured" if goal["measured"] is None else _ratio(goal["measured"])
        verdict = {None: "not judged", True: "met", False: "NOT MET"}[goal["met"]]
        lines.append(
            f"  {goal['metric']:10} {goal['ratio']:26} {measured:>12}  "
            f"(goal {goal['goal']}x): {verdict}"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------ the run


def main(argv: Sequence[str]) -> int:
    """``fastspawn bench --mp ARGS``; returns the exit status."""
    from fastspawn._bench.host import machine

    args = build_parser().parse_args(list(argv))
    try:
        contexts = parse_contexts(args.contexts)
        sizes = Sizes(args.quick, args.rounds, args.processes)
        if args.json is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise UsageError(f"--json {args.json}: its folder does not exist")
    except UsageError as exc:
        _say(f"error: {exc}")
        return 2
    started = time.time()
    runs: list[dict[str, Any]] = []
    failure = None
    try:
        measure(contexts, sizes, runs)
    except RuntimeError as exc:
        failure = str(exc)
        _say(f"a measurement failed: {exc}")
    except KeyboardInterrupt:
        _say("interrupted; every process it started is stopped")
        return 130
    described = machine()
    if runs:
        described["torch"] = runs[0]["torch"]  # the version the children imported
    summary = summarize(runs, contexts)
    goals = judge(summary, sizes.quick)
    sys.stdout.write(format_report(summary, goals, contexts, sizes, described))
    sys.stdout.flush()
    if args.json is not None:
        _write_json(
            args.json, argv, contexts, sizes, described, started, runs, summary, goals, failure
        )
    return 1 if failure is not None else 0


def _write_json(
    path: str,
    argv: Sequence[str],
    contexts: Sequence[str],
    sizes: Sizes,
    described: dict[str, Any],
    started: float,
    runs: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]],
    goals: Sequence[dict[str, Any]],
    failure: str | None,
) -> None:
    import json

    document = {
        "schema": SCHEMA_ID,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": time.time() - started,
        "machine": described,
        "config": {
            "contexts": list(contexts),
            "sizes": sizes.describe(),
            "child_main_module": _child_module(),
            "argv": list(argv),
        },
        "runs": list(runs),
        "summary": list(summary),
        "goals": list(goals),
        "failed": failure,
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")
