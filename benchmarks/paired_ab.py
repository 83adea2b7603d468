"""Two installs of fastspawn, A and B, compared by ``fastspawn bench`` in
pairs: each invocation runs one round of every cell, A and B alternate
(A B, then B A, ...), and each pair's B/A is taken, so that both sides of a
pair see the same moment of a shared machine.

    python benchmarks/paired_ab.py --a A/.venv/bin/fastspawn --b B/.venv/bin/fastspawn \\
        --pairs 8 --methods fastspawn-zygote-warm,fastspawn-fork --nprocs 8,64,256 \\
        --json results/ab.json

Prints, per method and nprocs, the medians of "all running" ("all reaped"
for the binary methods) for A and B and
the median (min-max) of the per-pair B/A; the JSON keeps every round and the
1-minute load average before each invocation.  A difference is one where the
B/A spread lies on one side of 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any


def one_round(fastspawn: str, methods: str, nprocs: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.json")
        subprocess.run(
            [fastspawn, "bench", "--methods", methods, "--nprocs", nprocs, "--repeat", "1"]
            + ["--json", out],
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=folder,
        )
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    # What the comparison reads, per round: the machine and the phases.
    keep = ("method", "nprocs", "round", "kind", "created_s", "running_s", "joined_s", "reaped_s")
    return {
        "started_at": result["started_at"],
        "machine": result["machine"],
        "rounds": [{k: r[k] for k in keep} for r in result["rounds"]],
    }


def running(result: dict[str, Any]) -> dict[tuple[str, int], float]:
    """ms to "all running" by (method, nprocs); a binary method's "all
    reaped" (its ranks run no Python to report their start)."""
    times = {}
    for r in result["rounds"]:
        seconds = r["running_s"] if r["running_s"] is not None else r.get("reaped_s")
        if r["kind"] == "launch" and seconds is not None:
            times[(r["method"], r["nprocs"])] = seconds * 1e3
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="A's fastspawn command")
    parser.add_argument("--b", required=True, help="B's fastspawn command")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--methods", default="fastspawn-zygote-warm")
    parser.add_argument("--nprocs", default="8,64,256")
    parser.add_argument("--json", default=None, help="write every round here")
    args = parser.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        order = ("a", "b") if pair % 2 == 0 else ("b", "a")
        for side in order:
            load = os.getloadavg()[0]
            result = one_round(getattr(args, side), args.methods, args.nprocs)
            rounds.append({"pair": pair, "side": side, "load": load, "result": result})
            print(f"pair {pair} {side} (load {load:.1f})", file=sys.stderr)
    cells = sorted({cell for r in rounds for cell in running(r["result"])}, key=lambda c: c[1])
    table = []
    print("method                  nprocs  A median  B median  B/A per pair: median (min-max)")
    for cell in cells:
        by_pair: dict[int, dict[str, float]] = {}
        for r in rounds:
            value = running(r["result"]).get(cell)
            if value is not None:
                by_pair.setdefault(r["pair"], {})[r["side"]] = value
        pairs = [p for p in by_pair.values() if len(p) == 2]
        ratios = [p["b"] / p["a"] for p in pairs]
        a = statistics.median(p["a"] for p in pairs)
        b = statistics.median(p["b"] for p in pairs)
        row = {
            "method": cell[0],
            "nprocs": cell[1],
            "a_median_ms": a,
            "b_median_ms": b,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        table.append(row)
        print(
            f"{cell[0]:<22} {cell[1]:>7} {a:>9.1f} {b:>9.1f}  "
            f"{row['ratio_median']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "table": table, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
