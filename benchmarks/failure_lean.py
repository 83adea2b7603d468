"""One failure among 256 ranks, from a main module that imports next to nothing.

    python benchmarks/failure_lean.py [--rounds 9] [--no-stacks] [--json FILE]

The zygote imports the caller's main module (as a spawn child would), so
every worker carries what that module imports.  zygote_bench.py's main
imports psutil, argparse, statistics and multiprocessing's shared memory,
and its failure scenario measures workers of that size.  This script is the
same scenario with a main module that imports only os, sys, time, signal
and fastspawn: a trivial user script.  The failing rank puts its time of
failure in its exception message (no shared memory needed).

Each round: 256 ranks, all up by a common deadline; rank 200 raises; the
time from its failure to the caller's ProcessRaisedException, every other
rank reaped (grace_period=0).  Interleaved with this interpreter's floor:
256 sleeping children forked from it, one killpg(SIGKILL), all reaped.
By default the launch takes the other ranks' stacks at the failure, as
start_processes does; --no-stacks launches with stacks=False, to see what
that collection adds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emit, fork_sleepers, kill_and_reap  # noqa: E402

import fastspawn  # noqa: E402

NPROCS = 256
BAD_RANK = 200


def fail_one(rank: int, deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
    if rank == BAD_RANK:
        raise RuntimeError(f"planned failure at {time.monotonic()!r}")
    time.sleep(600)


def one_failure(stacks: bool) -> float:
    deadline = time.monotonic() + 2.0  # every rank is up by then
    ctx = fastspawn.start_processes(fail_one, (deadline,), nprocs=NPROCS, join=False, stacks=stacks)
    try:
        while not ctx.join(grace_period=0):
            pass
    except fastspawn.ProcessRaisedException as exc:
        raised = time.monotonic()
        failed_at = float(str(exc).rsplit("planned failure at ", 1)[1].strip())
    else:
        raise AssertionError("no failure seen")
    assert all(p.exitcode is not None for p in ctx.processes)
    return raised - failed_at


def floor() -> float:
    pids = fork_sleepers(NPROCS)
    wall, _cpu = kill_and_reap(pids, lambda: os.killpg(pids[0], signal.SIGKILL))
    return wall


def main() -> None:
    import argparse  # after the workers' imports are settled: argparse is ours only

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--no-stacks",
        dest="stacks",
        action="store_false",
        help="launch with stacks=False: no stacks taken at the failure",
    )
    parser.add_argument("--json", help="write the samples here too")
    args = parser.parse_args()
    # 255 ranks get SIGTERM and SIGKILL logged; discard those records here.
    import logging

    logging.getLogger("fastspawn").addHandler(logging.NullHandler())
    logging.getLogger("fastspawn").propagate = False
    failures: list[float] = []
    floors: list[float] = []
    for _ in range(args.rounds):
        failures.append(one_failure(args.stacks))
        floors.append(floor())
        print(
            f"  fail 1 of {NPROCS} {failures[-1] * 1000:7.1f} ms   "
            f"floor {floors[-1] * 1000:7.1f} ms",
            file=sys.stderr,
        )
    import statistics

    from fastspawn._bench.host import machine

    emit(
        {
            "machine": machine(),
            "nprocs": NPROCS,
            "stacks": args.stacks,
            "samples_s": failures,
            "median_s": statistics.median(failures),
            "bare_killpg_median_s": statistics.median(floors),
            "bare_killpg_s": floors,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
