"""A large launch right after a preload: collapse first, or fork at once?

    python benchmarks/collapse_first.py [--module torch] [--nprocs 64,128,256]
                                        [--rounds 3] [--json FILE]

The zygote collapses its memory into huge pages while idle; a launch that
comes before it had the time finds it in 4 KiB pages.  From 128 ranks on,
the zygote collapses what is left before forking (fastspawn._zygote.server.Zygote.collapse_now).
Each round runs, for each rank count, three fresh callers one after the
other, each preloading ``--module`` in a fresh zygote and waiting for the
import (a 1-rank launch), then launching the ranks and timing the call
until every rank has entered its function:

  at-once     the launch follows the preload at once (from 128 ranks on,
              the zygote collapses before forking)
  idle        3 s of idle time first, in which the zygote collapses
  no-huge     FASTSPAWN_HUGEPAGES=0: nothing collapsed, arenas not placed
"""

from __future__ import annotations

import os
import sys
import time

KINDS = ("at-once", "idle", "no-huge")


def one(module: str, nprocs: int, idle: float) -> float:
    """In this process: preload, wait, launch ``nprocs``; seconds until all run."""
    import zygote_workers as zw

    import fastspawn

    fastspawn.preload([module])
    fastspawn.start_processes(zw.entry_time, nprocs=1)  # returns once imported
    time.sleep(idle)
    t0 = time.monotonic()
    ctx = fastspawn.start_processes(zw.entry_time, nprocs=nprocs)
    up = max(ctx.return_values.values()) - t0
    fastspawn.stop_zygote()
    return up


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(one(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
        return

    import argparse
    import statistics
    import subprocess

    from _common import emit

    from fastspawn._bench.host import machine

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--module", default="torch")
    parser.add_argument("--nprocs", default="64,128,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    counts = [int(n) for n in args.nprocs.split(",")]
    samples: dict[str, dict[str, list[float]]] = {str(n): {k: [] for k in KINDS} for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            for kind in KINDS:
                env = dict(os.environ)
                if kind == "no-huge":
                    env["FASTSPAWN_HUGEPAGES"] = "0"
                idle = "3" if kind == "idle" else "0"
                out = subprocess.run(
                    [sys.executable, __file__, "--one", args.module, str(n), idle],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                samples[str(n)][kind].append(float(out))
                print(f"  {n:4} ranks  {kind:8} {float(out) * 1000:8.1f} ms", file=sys.stderr)
    medians = {
        n: {kind: statistics.median(values) for kind, values in by_kind.items()}
        for n, by_kind in samples.items()
    }
    emit(
        {"machine": machine(), "module": args.module, "samples": samples, "medians": medians},
        args.json,
    )


if __name__ == "__main__":
    main()
