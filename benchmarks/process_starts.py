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

Beside the times, what each start costs the machine: its CPU time over a
loop and until the machine is idle again (``/proc/stat``: every
process's, the zygote's and its workers' included, making a worker ready
before its start or after it too), less what the machine spends idle for
as long (measured asleep before the first launch), over the loop's
starts.  A ready worker is paid for ahead, off the caller's path, but
paid: where the cores are all busy anyway (a 2-core machine running
DataLoader workers), what counts is that column.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch  # noqa: F401  (the zygote and the caller as a torch user has them)

import fastspawn
from fastspawn._bench.host import machine
from fastspawn._bench.mp_child import get_context, target_loop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_s  # noqa: E402

IDLE_S = 1.0  # asleep, to measure what the machine spends idle


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
    idle = idle_busy()  # before any launch: nothing of ours runs meanwhile
    target_loop(get_context("fastspawn"), 20)  # the zygote up, torch preloaded in it
    settle(idle)
    wanted = loops(options.gap)
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in wanted}
    rounds: dict[str, list[list[float]]] = {name: [] for name in wanted}
    cpu: dict[str, float] = dict.fromkeys(wanted, 0.0)
    for _ in range(options.rounds):
        for name, (context, gap, ready) in wanted.items():
            before = (lambda: fastspawn.prefork(1)) if ready else None
            busy, t0 = busy_s(), time.monotonic()
            got = target_loop(get_context(context), options.starts, gap, before)
            settle(idle)  # the zygote's refill after the last start, in this loop's time
            cpu[name] += busy_s() - busy - idle * (time.monotonic() - t0)
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
    print(
        f"medians of {options.rounds} x {options.starts} starts, ms; CPU: the machine's "
        f"a start, less {idle * 1e3:.1f} ms a second idle"
    )
    print(f"  {'':38} {'start()':>7} {'target':>7} {'join':>7} {'CPU':>7}")
    medians = {}
    cpu_ms = {name: used * 1e3 / (options.rounds * options.starts) for name, used in cpu.items()}
    for name, got in samples.items():
        medians[name] = [statistics.median(s[i] for s in got) * 1e3 for i in (0, 1, 2)]
        row = [*medians[name], cpu_ms[name]]
        print(f"  {name:38}" + "".join(f" {value:7.2f}" for value in row))
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
                    "cpu_per_start_ms": cpu_ms,
                    "idle_cpu_per_s_ms": idle * 1e3,
                },
                f,
                indent=1,
            )


def idle_busy() -> float:
    """CPU seconds the machine spends a second while this process sleeps."""
    busy, t0 = busy_s(), time.monotonic()
    time.sleep(IDLE_S)
    return (busy_s() - busy) / (time.monotonic() - t0)


def settle(idle: float) -> None:
    """Sleep until the machine is about as idle as ``idle`` says (a 0.1 s
    slice with at most a clock tick more than that): what the last start
    left running (the zygote making a worker ready) is then done.  5 s at
    most."""
    deadline = time.monotonic() + 5.0
    tick = 1 / os.sysconf("SC_CLK_TCK")
    while time.monotonic() < deadline:
        busy, t0 = busy_s(), time.monotonic()
        time.sleep(0.1)
        if busy_s() - busy <= idle * (time.monotonic() - t0) + tick:
            return


if __name__ == "__main__":
    main()
