"""Startup and join latency of fastspawn against plain multiprocessing.

One *round* launches ``nprocs`` ranks of :func:`launch_workers.timed_rank`
with one launcher and joins them:

- startup latency = (last rank's entry into fn) - t0, where t0 is taken just
  before ``fastspawn.start_processes`` / before the first ``Process.start()``;
- join latency = (join returned) - (last rank's return from fn).  Every rank
  sleeps until a common deadline t0 + margin, so all ranks are up before any
  returns and they all return together; the join then measures worker
  teardown plus the parent noticing and reaping every exit.

Rounds alternate between the launchers (fastspawn first on even rounds,
multiprocessing first on odd ones) so that machine noise hits both alike.

Entry points: ``python benchmarks/run_launch.py`` (prints the table) and
``pytest benchmarks/bench_launch.py`` (pytest-benchmark, one fresh
interpreter per case running run_launch.py).

fastspawn is imported only where a fastspawn round runs, so that a worker
multiprocessing started never pays for importing it.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import launch_workers

START_METHODS = ("spawn", "fork", "forkserver")
NPROCS = (1, 8, 64)
LAUNCHERS = ("fastspawn", "multiprocessing")
# Rounds per nprocs: enough for stable medians on a noisy 2-core machine,
# with the whole run under ~4 minutes (a 64-rank spawn round takes ~10 s).
DEFAULT_ROUNDS = {1: 15, 8: 15, 64: 5}
# Deadline margin = startup estimate * MARGIN_FACTOR + MARGIN_EXTRA (seconds).
MARGIN_FACTOR = 2.0
MARGIN_EXTRA = 0.3


@dataclass(frozen=True)
class Sample:
    startup: float  # seconds from t0 until the last rank entered fn
    join: float  # seconds from the last rank's return until join returned
    late: bool  # some rank entered fn after the deadline: the margin was short


@dataclass
class Result:
    method: str
    nprocs: int
    rounds: int
    margin: float
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def median(self, launcher: str, metric: str) -> float:
        return float(statistics.median(getattr(s, metric) for s in self.samples[launcher]))

    def late_rounds(self, launcher: str) -> int:
        return sum(s.late for s in self.samples[launcher])

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "nprocs": self.nprocs,
            **self.summary(),
            "samples": {k: [asdict(s) for s in v] for k, v in self.samples.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        samples = {k: [Sample(**s) for s in v] for k, v in data["samples"].items()}
        return cls(data["method"], data["nprocs"], data["rounds"], data["margin_s"], samples)

    def summary(self) -> dict[str, float | int]:
        """Medians (seconds) and late-round counts, flat, for extra_info/JSON."""
        out: dict[str, float | int] = {"rounds": self.rounds, "margin_s": self.margin}
        for launcher in LAUNCHERS:
            for metric in ("startup", "join"):
                out[f"{launcher}_{metric}_median_s"] = self.median(launcher, metric)
            out[f"{launcher}_late_rounds"] = self.late_rounds(launcher)
        return out


def _sample(
    t0: float, deadline: float, t_end: float, times: Sequence[tuple[float, float]]
) -> Sample:
    entries = [entry for entry, _ in times]
    returns = [done for _, done in times]
    return Sample(
        startup=max(entries) - t0,
        join=t_end - max(returns),
        late=max(entries) > deadline,
    )


def run_fastspawn(method: str, nprocs: int, margin: float) -> Sample:
    """One round with fastspawn.start_processes(join=True)."""
    import fastspawn  # here, not at module level: see the module docstring

    t0 = time.monotonic()
    ctx = fastspawn.start_processes(
        launch_workers.timed_rank,
        args=(t0 + margin,),
        nprocs=nprocs,
        join=True,
        start_method=method,
    )
    t_end = time.monotonic()
    values = ctx.return_values
    if sorted(values) != list(range(nprocs)):
        raise RuntimeError(f"fastspawn returned values for ranks {sorted(values)}")
    return _sample(t0, t0 + margin, t_end, list(values.values()))


def run_multiprocessing(method: str, nprocs: int, margin: float) -> Sample:
    """One round with mp.get_context(method).Process per rank: start all, join all."""
    context = mp.get_context(method)
    queue = context.SimpleQueue()
    # The deadline goes into the Process args, so it is fixed just before
    # they are built; t0 is then taken right before the first start(), as
    # the benchmark defines it (this costs multiprocessing nothing).
    deadline = time.monotonic() + margin
    procs = [
        context.Process(  # type: ignore[attr-defined]  # typeshed: BaseContext for a str
            target=launch_workers.timed_rank_to_queue, args=(rank, deadline, queue)
        )
        for rank in range(nprocs)
    ]
    try:
        t0 = time.monotonic()
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        t_end = time.monotonic()
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"multiprocessing workers exited with {codes}")
        # Every rank put exactly once before exiting 0: these gets cannot block.
        times = [queue.get() for _ in range(nprocs)]
    finally:
        # On any failure, leave nothing running: kill what started, reap it.
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join()
                proc.close()
        queue.close()
    return _sample(t0, deadline, t_end, times)


RUNNERS: dict[str, Callable[[str, int, float], Sample]] = {
    "fastspawn": run_fastspawn,
    "multiprocessing": run_multiprocessing,
}


def _one(launcher: str, method: str, nprocs: int, margin: float) -> Sample:
    gc.collect()  # so that no collection falls inside a timed round
    return RUNNERS[launcher](method, nprocs, margin)


def measure(method: str, nprocs: int, rounds: int) -> Result:
    """Warm up both launchers, size the margin, then time ``rounds`` rounds
    of each, interleaved."""
    # Warm-up, not recorded: starts the fork servers and the resource
    # tracker, fills the page cache; with margin 0 the ranks return at once,
    # and the slower startup sizes the deadline margin for both launchers.
    warm = [_one(launcher, method, nprocs, 0.0).startup for launcher in LAUNCHERS]
    margin = max(warm) * MARGIN_FACTOR + MARGIN_EXTRA
    result = Result(method, nprocs, rounds, margin, {launcher: [] for launcher in LAUNCHERS})
    for i in range(rounds):
        order = LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]
        for launcher in order:
            result.samples[launcher].append(_one(launcher, method, nprocs, margin))
    return result


# ------------------------------------------------------------------ reporting


def machine() -> dict[str, Any]:
    """The machine description ``fastspawn bench`` records (imported here,
    in the parent only: workers never load fastspawn through this module)."""
    from fastspawn._bench.host import machine as describe

    return describe()


def fastspawn_origin() -> str:
    """Where fastspawn is imported from: the installed tree or a snapshot
    put first on PYTHONPATH (see README.md)."""
    import fastspawn

    return os.path.dirname(fastspawn.__file__ or "?")


def describe_machine() -> str:
    info = machine()
    return (
        f"CPU: {info['cpu']}; cores: {info['usable_cores']}; kernel: {info['kernel']}; "
        f"Python {info['python']}; fastspawn from {fastspawn_origin()}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def table(results: Sequence[Result]) -> str:
    """Markdown table of medians (ms); ratio = multiprocessing / fastspawn."""
    lines = [
        (
            "| method | nprocs | rounds | fastspawn startup ms | mp startup ms | mp/fs "
            "| fastspawn join ms | mp join ms | mp/fs |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = [r.method, str(r.nprocs), str(r.rounds)]
        for metric in ("startup", "join"):
            fs = r.median("fastspawn", metric)
            mpv = r.median("multiprocessing", metric)
            cells += [_ms(fs), _ms(mpv), f"{mpv / fs:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    late = [
        f"{r.method}/{r.nprocs}: {launcher} {r.late_rounds(launcher)}"
        for r in results
        for launcher in LAUNCHERS
        if r.late_rounds(launcher)
    ]
    if late:
        lines.append("")
        lines.append("Rounds where a rank started after the deadline: " + ", ".join(late))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(START_METHODS), choices=START_METHODS)
    parser.add_argument("--nprocs", nargs="+", type=int, default=list(NPROCS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds for every nprocs (default, by nprocs: {DEFAULT_ROUNDS}, else 5)",
    )
    parser.add_argument("--json", help="also write every sample to this file")
    opts = parser.parse_args(argv)

    print(describe_machine(), flush=True)
    results = []
    started = time.monotonic()
    for method in opts.methods:
        for nprocs in opts.nprocs:
            rounds = opts.rounds or DEFAULT_ROUNDS.get(nprocs, 5)
            result = measure(method, nprocs, rounds)
            results.append(result)
            fs, mpr = "fastspawn", "multiprocessing"
            print(
                f"{method:>10} nprocs={nprocs:<3}"
                f" startup fs {_ms(result.median(fs, 'startup'))}"
                f" mp {_ms(result.median(mpr, 'startup'))} ms;"
                f" join fs {_ms(result.median(fs, 'join'))}"
                f" mp {_ms(result.median(mpr, 'join'))} ms",
                flush=True,
            )
    print(f"\n(total {time.monotonic() - started:.0f} s)\n")
    print(table(results))
    if opts.json:
        with open(opts.json, "w") as f:
            info = {**machine(), "fastspawn": fastspawn_origin()}
            json.dump({"machine": info, "results": [r.to_json() for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
