"""Issue 31's figures for ready workers on this host, in one command: each
of its "Done when" ratios beside its goal, with the CPU model, so that a
host of another kind (the project's run on AMD EPYC and Intel Xeon, with
fork costs 4x apart) can be checked as the first was.

Runs ``fastspawn bench`` twice, each in a fresh interpreter: without torch
at 64 and 256 ranks (ready workers from ``prefork()``, the second of two
launches without it, the bare fork loop of a small interpreter and its
children forked ahead and woken by one write each), then with torch at 64
(ready workers of a zygote holding torch, the bare fork loop and the
pre-forked children of a process with torch imported).  Every figure is
the "all running" median (the call to the last rank's first line of
``fn``) of ``--repeat`` rounds, and each ratio is between two methods of
the same run.

    python benchmarks/ready_goals.py [--repeat 7] [--runs 1] [--no-torch] [--json FILE]

About 2 minutes on 2 cores (AMD EPYC), 1.5 without torch.  Prints the
ratios, the goals and whether each was met, and beside each the ratio of
the CPU time the two launches took (the median of ``fastspawn bench``'s
"cpu": the ranks', the helpers' and the caller's, from the call until
every rank has entered ``fn``): on a host of few cores a launch's "all
running" follows the CPU it takes (on 2 cores it was about half of it,
benchmarks/README.md, "Issue 31's goals at `e086419`"), so the bound a
ratio meets there is shown beside it.  With ``--json`` writes them, the
machine and each run's summary.  ``--runs N`` does all of that N
times, one run after the other, and prints each goal's ratio in every run,
their median and in how many runs it was met: on the 2-core VMs the
project runs on, the floors themselves move by a fifth from run to run,
and a goal near its bound is met in some runs and not in others
(``--repeat 21``, about 10 minutes a run there, narrowed the rows without
torch, not torch's: benchmarks/README.md, "Issue 31's goals with 21
rounds a run").  Exit
status 0 whatever was met (a benchmark, not a test).
``benchmarks/process_starts.py`` measures the
issue's other figure, one ``ctx.Process`` start from a ready worker
against fork's.
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

READY = "fastspawn-zygote-ready"
REFILLED = "fastspawn-zygote-refilled"
FORK_LOOP, PREFORKED = "floor", "floor-preforked"
# With --import torch the sized floors are a process with torch imported.
TORCH_FORK_LOOP, TORCH_PREFORKED = "floor-sized", "floor-preforked-sized"
# What --json keeps of each run's JSON.
SUMMARY = ("started_at", "duration_s", "machine", "config", "summary", "failed")
AT_MOST_FORK_LOOP = 0.6
AT_MOST_PREFORKED = 1.3

# (label, nprocs, method, floor, goal) for each run.
PLAIN_GOALS = [
    (f"{what}, {n} ranks, over {name}", n, method, floor, goal)
    for n in (64, 256)
    for what, method in (("from ready workers", READY), ("second launch", REFILLED))
    for name, floor, goal in (
        ("the bare fork loop", FORK_LOOP, AT_MOST_FORK_LOOP),
        ("the bare pre-forked floor", PREFORKED, AT_MOST_PREFORKED),
    )
]
TORCH_GOALS = [
    (f"torch, from ready workers, 64 ranks, over {name}", 64, READY, floor, goal)
    for name, floor, goal in (
        ("the bare fork loop of a torch process", TORCH_FORK_LOOP, AT_MOST_FORK_LOOP),
        ("its bare pre-forked children", TORCH_PREFORKED, AT_MOST_PREFORKED),
    )
]


def bench(arguments: list[str], repeat: int, directory: str, name: str) -> dict[str, Any]:
    """One ``fastspawn bench`` run in a fresh interpreter: its JSON."""
    path = os.path.join(directory, f"{name}.json")
    command = [sys.executable, "-m", "fastspawn", "bench", *arguments]
    command += ["--repeat", str(repeat), "--json", path]
    print("running:", " ".join(command[1:-2]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        figures: dict[str, Any] = json.load(f)
        return figures


def medians(run: dict[str, Any], phase: str = "running") -> dict[tuple[str, int], float]:
    """(method, nprocs) -> the median of ``phase``, in seconds: "all
    running" by default, "cpu" for the machine's CPU time of the launch."""
    return {
        (entry["method"], entry["nprocs"]): entry["median"]
        for entry in run["summary"]
        if entry["phase"] == phase and entry["median"] is not None
    }


def judge(
    run: dict[str, Any], goals: list[tuple[str, int, str, str, float]]
) -> list[dict[str, Any]]:
    """Each goal's ratio in ``run``, and whether it was met (None: a
    method's figure is missing, its rounds failed); beside it, the ratio
    of the CPU time the two launches took (None where not measured)."""
    running, cpu = medians(run), medians(run, "cpu")
    judged = []
    for label, nprocs, method, floor, goal in goals:
        ours, theirs = running.get((method, nprocs)), running.get((floor, nprocs))
        ratio = None if ours is None or not theirs else ours / theirs
        our_cpu, their_cpu = cpu.get((method, nprocs)), cpu.get((floor, nprocs))
        judged.append(
            {
                "goal": label,
                "nprocs": nprocs,
                "method": method,
                "floor": floor,
                "ms": None if ours is None else ours * 1e3,
                "floor_ms": None if theirs is None else theirs * 1e3,
                "ratio": ratio,
                "at_most": goal,
                "met": None if ratio is None else ratio <= goal,
                "cpu_ms": None if our_cpu is None else our_cpu * 1e3,
                "floor_cpu_ms": None if their_cpu is None else their_cpu * 1e3,
                "cpu_ratio": None if our_cpu is None or not their_cpu else our_cpu / their_cpu,
            }
        )
    return judged


def one_run(repeat: int, no_torch: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both bench commands in fresh interpreters: their JSON by name, and
    each goal judged."""
    runs: dict[str, Any] = {}
    judged: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        methods = ",".join([FORK_LOOP, READY, REFILLED, PREFORKED])
        runs["plain"] = bench(
            ["--methods", methods, "--nprocs", "64,256"], repeat, directory, "plain"
        )
        judged += judge(runs["plain"], PLAIN_GOALS)
        if not no_torch:
            methods = ",".join([TORCH_FORK_LOOP, READY, TORCH_PREFORKED])
            arguments = ["--import", "torch", "--methods", methods, "--nprocs", "64"]
            runs["torch"] = bench(arguments, repeat, directory, "torch")
            judged += judge(runs["torch"], TORCH_GOALS)
    return runs, judged


def print_run(judged: list[dict[str, Any]]) -> None:
    """One run's goals: each ratio with its two figures."""
    width = max(len(entry["goal"]) for entry in judged)
    for entry in judged:
        if entry["ratio"] is None:
            print(f"{entry['goal']:<{width}}  no figure (its rounds failed: see the JSON)")
            continue
        print(
            f"{entry['goal']:<{width}}  {entry['ms']:7.1f} / {entry['floor_ms']:7.1f} ms = "
            f"{entry['ratio']:.2f}x (goal <= {entry['at_most']}x): "
            f"{'met' if entry['met'] else 'NOT met'}; CPU {_times(entry['cpu_ratio'])}"
        )
    met = sum(1 for entry in judged if entry["met"])
    print(f"{met} of {len(judged)} met")


def across(each: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each goal over several runs: its ratio in each (None where its
    rounds failed), their median, and in how many runs it was met."""
    summary = []
    for index, first in enumerate(each[0]):
        ratios = [judged[index]["ratio"] for judged in each]
        measured = [ratio for ratio in ratios if ratio is not None]
        cpu = [judged[index]["cpu_ratio"] for judged in each]
        cpu_measured = [ratio for ratio in cpu if ratio is not None]
        summary.append(
            {
                "goal": first["goal"],
                "at_most": first["at_most"],
                "ratios": ratios,
                "median_ratio": statistics.median(measured) if measured else None,
                "cpu_ratios": cpu,
                "median_cpu_ratio": statistics.median(cpu_measured) if cpu_measured else None,
                "met_runs": sum(1 for judged in each if judged[index]["met"]),
                "runs": len(each),
            }
        )
    return summary


def print_across(summary: list[dict[str, Any]], each: list[list[dict[str, Any]]]) -> None:
    width = max(len(entry["goal"]) for entry in summary)
    for entry in summary:
        ratios = " ".join("  -  " if r is None else f"{r:.2f}x" for r in entry["ratios"])
        print(
            f"{entry['goal']:<{width}}  {ratios}  median {_times(entry['median_ratio'])} "
            f"(goal <= {entry['at_most']}x): met in {entry['met_runs']} of {entry['runs']}; "
            f"CPU {_times(entry['median_cpu_ratio'])}"
        )
    whole = sum(1 for judged in each if all(entry["met"] for entry in judged))
    print(f"runs that met every goal: {whole} of {len(each)}")


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of each method (7)")
    parser.add_argument("--runs", type=int, default=1, help="runs, one after the other (1)")
    parser.add_argument("--no-torch", action="store_true", help="leave the torch run out")
    parser.add_argument("--json", help="write the figures to this file")
    options = parser.parse_args()
    if options.repeat < 1:
        parser.error("--repeat takes a count >= 1")
    if options.runs < 1:
        parser.error("--runs takes a count >= 1")
    each_runs: list[dict[str, Any]] = []
    each: list[list[dict[str, Any]]] = []
    for number in range(1, options.runs + 1):
        if options.runs > 1:
            print(f"run {number} of {options.runs}", flush=True)
        runs, judged = one_run(options.repeat, options.no_torch)
        each_runs.append(runs)
        each.append(judged)
    host = each_runs[0]["plain"]["machine"]
    print(
        f"\nCPU: {host['cpu']}, {host['usable_cores']} cores; Linux {host['kernel']}; "
        f"Python {host['python']}; torch {host.get('torch') or 'not run'}; "
        f"{options.repeat} rounds, 'all running' medians"
    )
    summary = across(each)
    if options.runs == 1:
        print_run(each[0])
    else:
        for number, judged in enumerate(each, 1):
            print(f"\nrun {number} of {options.runs}:")
            print_run(judged)
        print(f"\nover the {options.runs} runs, each goal's ratio in each:")
        print_across(summary, each)
    if options.json:
        # Each run's summary, not its every round (1 MB a run).
        kept = [
            {name: {key: run[key] for key in SUMMARY} for name, run in runs.items()}
            for runs in each_runs
        ]
        figures: dict[str, Any] = {"machine": host, "argv": sys.argv[1:]}
        if options.runs == 1:
            figures.update(goals=each[0], runs=kept[0])
        else:
            figures.update(
                goals=summary,
                each_run=[
                    {"goals": judged, "runs": runs} for judged, runs in zip(each, kept, strict=True)
                ],
            )
        with open(options.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
