"""A whole launch, start to join, of ranks that return at once: what a
sweep, an evaluation loop or a test harness waits for each time it
launches, where ``fastspawn bench`` times the start ("all running") and
the join ("exit->joined") apart, its ranks held in between.

    python benchmarks/launch_join.py [--nprocs 64] [--rounds 15] [--torch] [--json FILE]

Per round, each after 50 ms asleep, in turn:

- ready: ``fastspawn.start_processes(fn, nprocs=N)`` (joined) after
  ``fastspawn.prefork(N, refill=False)``: every rank from a ready worker;
- forked: the same with ready workers off (``prefork(0, refill=False)``),
  every rank forked at the launch;
- floor: N children forked ahead (untimed) by a helper the zygote's size,
  each woken by one byte on a socketpair of its own, exiting at once
  with ``os._exit``, all reaped with ``waitpid``: the kernel's part of
  the same cycle (a wake, an exit, a teardown, a reap) and nothing else.

``fn`` returns at once.  This file is the main module and imports next to
nothing.  The floor's helper, a fresh interpreter, makes itself what the
zygote is (as ``fastspawn bench``'s sized floors do): its object arenas
placed first, this module and the zygote's own imported, with
``--torch`` torch too (which the zygote then preloads), ``gc.freeze()``
and the huge-page collapse.  A process's teardown costs by its mappings
and memory: forked from this process instead, with torch imported as
usual, the floor's cycle of 64 took 130 ms, the ready workers' 76 (Intel
Xeon).  Beside each cycle's time, the machine's CPU time
meanwhile (``/proc/stat``: all but idle, iowait and steal; counted in
ticks, so their mean over the rounds).  Prints the medians (ms), each over
the floor, with the CPU model; ``--json`` writes them and every round's
figures.  benchmarks/README.md, "A launch to its join, and a rank's
exit", has what it measured.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import fastspawn
from fastspawn._bench.host import machine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_s  # noqa: E402

SETTLE_S = 0.05  # asleep before each timed cycle, every method alike


def returns_at_once(rank: int) -> None:
    """The ranks' fn."""


def ready(nprocs: int) -> tuple[float, float]:
    fastspawn.prefork(nprocs, refill=False)
    return _cycle(nprocs)


def forked(nprocs: int) -> tuple[float, float]:
    fastspawn.prefork(0, refill=False)
    return _cycle(nprocs)


def _cycle(nprocs: int) -> tuple[float, float]:
    """One launch of ``nprocs``, joined: (seconds, the machine's CPU
    seconds meanwhile)."""
    time.sleep(SETTLE_S)
    busy = busy_s()
    t0 = time.perf_counter()
    fastspawn.start_processes(returns_at_once, nprocs=nprocs)
    return time.perf_counter() - t0, busy_s() - busy


def floor(nprocs: int) -> tuple[float, float]:
    """Children forked ahead, each woken by one byte, exiting at once, all
    reaped: (seconds from the first byte sent to the last reap, the
    machine's CPU seconds meanwhile)."""
    pairs = [socket.socketpair() for _ in range(nprocs)]
    pids: list[int] = []
    try:
        for index in range(nprocs):
            pid = os.fork()
            if pid == 0:
                try:
                    mine = pairs[index][1]
                    mine.recv(1)
                finally:
                    os._exit(0)
            pids.append(pid)
        for _ours, theirs in pairs:
            theirs.close()
        time.sleep(SETTLE_S)
        busy = busy_s()
        t0 = time.perf_counter()
        for ours, _theirs in pairs:
            ours.send(b"x")
        while pids:
            os.waitpid(pids[-1], 0)
            pids.pop()  # reaped: its pid may be another process's from now on
        return time.perf_counter() - t0, busy_s() - busy
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
        for pid in pids:  # not reaped above (an error came first): still ours
            os.kill(pid, 9)
            os.waitpid(pid, 0)


# The floor's helper: the zygote's memory treatment first, then its
# modules (this one among them: the zygote imports the caller's main
# module), then one floor cycle for each count it reads.
_HELPER = """\
import sys
from fastspawn._os import hugepages
if hugepages.wanted():
    hugepages.place_arenas()
import gc, multiprocessing.spawn, fastspawn._zygote
sys.path.insert(0, {directory!r})
import launch_join
{imports}gc.freeze()
for address in hugepages.collapsible_ranges() if hugepages.wanted() else ():
    hugepages.collapse(address)
for line in sys.stdin:
    print(*launch_join.floor(int(line)), flush=True)
"""


class FloorHelper:
    """The floor's helper process (see _HELPER); one cycle a call."""

    def __init__(self, torch: bool) -> None:
        program = _HELPER.format(
            directory=os.path.dirname(os.path.abspath(__file__)),
            imports="import torch\n" if torch else "",
        )
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(
            [sys.executable, "-c", program], stdin=pipe, stdout=pipe, text=True
        )

    def __call__(self, nprocs: int) -> tuple[float, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{nprocs}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the floor's helper ended (exit status {self.process.wait()})")
        seconds, busy = answer.split()
        return float(seconds), float(busy)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=64, help="ranks a launch (64)")
    parser.add_argument("--rounds", type=int, default=15, help="cycles of each method (15)")
    parser.add_argument("--torch", action="store_true", help="caller and zygote hold torch")
    parser.add_argument("--json", help="write the figures to this file")
    options = parser.parse_args()
    if options.nprocs < 1 or options.rounds < 1:
        parser.error("--nprocs and --rounds take a count >= 1")
    if options.torch:
        import torch  # noqa: F401

        fastspawn.preload(["torch"])
    fastspawn.start_processes(returns_at_once, nprocs=1)  # the zygote up and warm
    helper = FloorHelper(options.torch)
    methods: dict[str, Callable[[int], tuple[float, float]]] = {
        "ready": ready,
        "forked": forked,
        "floor": helper,
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    try:
        for _ in range(options.rounds):
            for name, method in methods.items():
                samples[name].append(method(options.nprocs))
    finally:
        helper.close()
        fastspawn.prefork(0, refill=False)
    medians = {name: statistics.median(s for s, _ in values) for name, values in samples.items()}
    # The machine's CPU time is counted in ticks (10 ms, most often): the
    # mean over the rounds, not a median of ticks.
    busy = {name: statistics.fmean(b for _, b in values) for name, values in samples.items()}
    host = machine()
    print(
        f"CPU: {host['cpu']}, {host['usable_cores']} cores; Python {host['python']}; "
        f"{'torch ' + host['torch'] if options.torch else 'no torch'}; {options.nprocs} ranks "
        f"returning at once, start to join, medians of {options.rounds} rounds; the "
        "machine's CPU time a cycle, their mean"
    )
    for name, value in medians.items():
        print(
            f"{name:<7} {value * 1e3:8.1f} ms  {value / medians['floor']:5.2f}x the floor   "
            f"CPU {busy[name] * 1e3:6.1f} ms  {busy[name] / busy['floor']:5.2f}x"
        )
    if options.json:
        import json

        report = {
            "machine": host,
            "argv": sys.argv[1:],
            "median_s": medians,
            "mean_cpu_s": busy,
            "samples_s": {name: [s for s, _ in values] for name, values in samples.items()},
            "cpu_samples_s": {name: [b for _, b in values] for name, values in samples.items()},
        }
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
