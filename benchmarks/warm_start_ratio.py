"""Warm zygote start of 64 ranks against a bare fork loop, rounds
interleaved in one process: the ratio to compare two checkouts by.

    python benchmarks/warm_start_ratio.py [--rounds 11] [--nprocs 64]

Prints one JSON line: the median ratio (zygote / bare fork loop) and the
median times.  To compare two commits on a noisy machine, run it from each
checkout in turn, A B B A, several times, and compare the medians of the
ratios (benchmarks/README.md has such a comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zygote_bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--nprocs", type=int, default=64)
    args = parser.parse_args()
    zygote_bench.zygote_warm(args.nprocs)  # start the zygote, warm it
    ratios, warm, bare = [], [], []
    for _ in range(args.rounds):
        bare.append(zygote_bench.bare_fork(args.nprocs))
        warm.append(zygote_bench.zygote_warm(args.nprocs))
        ratios.append(warm[-1] / bare[-1])
    print(
        json.dumps(
            {
                "ratio_median": statistics.median(ratios),
                "zygote_warm_ms": statistics.median(warm) * 1e3,
                "bare_fork_ms": statistics.median(bare) * 1e3,
            }
        )
    )


if __name__ == "__main__":
    main()
