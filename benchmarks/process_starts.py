"""One multiprocessing Process at a time, with torch imported, from
fastspawn's context and from multiprocessing's fork context in the same
run: the time from ``Process()`` to ``start()``'s return, to the target's
first line (start to target) and to the joined exit (start to join), back
to back, with a gap
between starts and, for fastspawn, with ``fastspawn.prefork(1)`` before each
start (untimed: every start then finds a ready worker).

    python benchmarks/process_starts.py [--starts 150] [--gap 0.03] [--rounds 3] [--json FILE]
    FASTSPAWN_READY=0 python benchmarks/process_starts.py

This file is the main module: small, as a minimal main module should be
(fastspawn's workers import it as ``__mp_main__``; fork's children inherit
it).  The contexts take turns, round by round; prints the medians of each
loop over all rounds (milliseconds) with the CPU model, and with ``--json``
writes them and every round's own medians.  Run it with readiness off too,
on the same machine, and compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch  # noqa: F401  (the zygote and the caller as a torch user has them)

import fastspawn
from fastspawn._bench.host import machine
from fastspawn._bench.mp_child import get_context, target_loop


def loops(gap: float) -> dict[str, tuple[str, float, bool]]:
    """Each loop's name: (context, gap in seconds, prefork(1) before each)."""
    return {
        "fastspawn, back to back": ("fastspawn", 0.0, False),
        f"fastspawn, {gap * 1e3:g} ms apart": ("fastspawn", gap, False),
        "fastspawn, prefork(1) before each": ("fastspawn", gap, True),
        "fork, back to back": ("fork", 0.0, False),
        f"fork, {gap * 1e3:g} ms apart": ("fork", gap, False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=150, help="starts per loop and round")
    parser.add_argument("--gap", type=float, default=0.03, help="seconds between starts")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every loop")
    parser.add_argument("--json", help="write the medians to this file")
    options = parser.parse_args()
    if options.starts < 1 or options.rounds < 1 or options.gap < 0:
        parser.error("--starts and --rounds take a positive count, --gap seconds >= 0")
    target_loop(get_context("fastspawn"), 20)  # the zygote up, torch preloaded in it
    wanted = loops(options.gap)
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in wanted}
    rounds: dict[str, list[list[float]]] = {name: [] for name in wanted}
    for _ in range(options.rounds):
        for name, (context, gap, ready) in wanted.items():
            before = (lambda: fastspawn.prefork(1)) if ready else None
            got = target_loop(get_context(context), options.starts, gap, before)
            if ready:
                fastspawn.prefork(0)  # the background as it was, for the other loops
            samples[name] += got
            rounds[name].append([statistics.median(s[i] for s in got) * 1e3 for i in (0, 1, 2)])
    setting = os.environ.get("FASTSPAWN_READY", "default")
    host = machine()
    print(
        f"CPU: {host['cpu']}, {host['usable_cores']} cores; Python {host['python']}; "
        f"torch {host['torch']}; FASTSPAWN_READY={setting}"
    )
    print(f"medians of {options.rounds} x {options.starts} starts, ms:")
    print(f"  {'':38} {'start()':>7} {'target':>7} {'join':>7}")
    medians = {}
    for name, got in samples.items():
        medians[name] = [statistics.median(s[i] for s in got) * 1e3 for i in (0, 1, 2)]
        print(f"  {name:38}" + "".join(f" {value:7.2f}" for value in medians[name]))
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                {
                    "machine": host,
                    "argv": sys.argv[1:],
                    "FASTSPAWN_READY": setting,
                    "unit": "ms",
                    "columns": ["start() return", "start to target", "start to join"],
                    "medians": medians,
                    "round_medians": rounds,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
