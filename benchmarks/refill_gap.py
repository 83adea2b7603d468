"""A launch that comes while the zygote is still making the last launch's
workers ready again (issue 31): what the time between two launches costs.

Each round, for each gap: ``prefork(0)`` (none ready; the background on),
a launch of ``--nprocs`` ranks that return at once, joined (every rank
forked: the zygote then owes that many ready workers; with ``--first
ready``, every rank from a worker ``prefork(n)`` made ready, which the
zygote then makes ready again: a sweep's launches, back to back), a sleep
of the gap from its return, then the timed launch of as many ranks: from
its call to the last rank's first line of ``fn`` (each rank stamps
``CLOCK_MONOTONIC`` into a private file, then stays until a second after
the call), joined.
Beside them, in the same rounds: "ready" (``prefork(n, refill=False)``,
which returns once every worker has rehearsed its wake, then a second's
sleep) and "forked" (no ready worker: every rank forked).  The settings
run in a new order each round; medians of ``--rounds``, and of how many
workers were ready (listed: forked, rehearsed or not) as the timed launch
began.

    python benchmarks/refill_gap.py [--nprocs 64] [--preload torch] [--rounds 7]
        [--gaps 0.05,0.2,0.5,1,2] [--first forked|ready] [--json FILE]

Prints the medians with the CPU model; with ``--json`` writes them and
every round's figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import struct
import sys
import tempfile
import time

import fastspawn
from fastspawn._bench.host import machine
from fastspawn._bench.methods import _await_ready
from fastspawn._launch.methods import registry
from fastspawn._zygote import client

STAMP = struct.Struct("d")
STAY = 1.0  # seconds after the call that the timed launch's ranks exit


def stamp(rank: int, path: str, until: float) -> None:
    """Stamp the start, then stay until ``until`` (CLOCK_MONOTONIC): no
    rank's exit shares the cores with the later ranks' starts, as in
    ``fastspawn bench``."""
    now = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, STAMP.pack(now), rank * STAMP.size)
    finally:
        os.close(fd)
    time.sleep(max(0.0, until - time.monotonic()))


def idle(rank: int) -> None:
    """A rank that does nothing: leaves its worker owed."""


def timed_launch(nprocs: int, path: str) -> float:
    """Milliseconds from the call to the last rank's stamp."""
    with open(path, "r+b") as f:
        f.write(bytes(nprocs * STAMP.size))
    started = time.monotonic()
    fastspawn.start_processes(stamp, (path, started + STAY), nprocs=nprocs)
    with open(path, "rb") as f:
        stamps = [value for (value,) in STAMP.iter_unpack(f.read(nprocs * STAMP.size))]
    if not all(stamps):
        raise RuntimeError("a rank did not stamp its start")
    return float(max(stamps) - started) * 1000


def settle() -> None:
    """Wait until the zygote and its helpers are asleep (no refill left)."""
    _await_ready(registry.get("zygote"), 0)


def one_round(setting: str, nprocs: int, path: str, first: str) -> tuple[float, int]:
    """The timed launch's milliseconds, and how many workers were ready
    (forked, rehearsed or not) as it began.  ``first``: how the earlier
    launch of a gap's round gets its ranks ("forked" or "ready")."""
    if setting == "ready":
        fastspawn.prefork(nprocs, refill=False)
        time.sleep(1.0)
    elif setting == "forked":
        fastspawn.prefork(0, refill=False)
        settle()
    else:
        fastspawn.prefork(0)
        settle()
        if first == "ready":
            fastspawn.prefork(nprocs)  # and kept so: made ready again after
            settle()
        fastspawn.start_processes(idle, nprocs=nprocs)
        time.sleep(float(setting))
    ready = len(client.ready_workers(client.zygote_pid() or 0))
    return timed_launch(nprocs, path), ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=64, help="ranks of each launch")
    parser.add_argument("--preload", action="append", default=[], help="a module for the zygote")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gaps", default="0.05,0.2,0.5,1,2", help="seconds, comma-separated")
    parser.add_argument(
        "--first",
        choices=("forked", "ready"),
        default="forked",
        help="how the launch before each gap gets its ranks",
    )
    parser.add_argument("--json", help="write the figures to this file")
    options = parser.parse_args()
    if options.nprocs < 1 or options.rounds < 1:
        parser.error("--nprocs and --rounds take counts >= 1")
    try:
        seconds = [float(gap) for gap in options.gaps.split(",")]
    except ValueError:
        seconds = [-1.0]
    if not all(0 <= gap < 3600 for gap in seconds):
        parser.error(f"--gaps takes seconds (0 to 3600) separated by commas, not {options.gaps!r}")
    gaps = list(dict.fromkeys(f"{gap:g}" for gap in seconds))  # each once
    if options.preload:
        fastspawn.preload(options.preload)
    settings = ["ready", "forked", *gaps]
    results: dict[str, list[float]] = {setting: [] for setting in settings}
    ready: dict[str, list[int]] = {setting: [] for setting in settings}
    with tempfile.TemporaryDirectory() as private:
        path = os.path.join(private, "stamps")
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        fastspawn.start_processes(idle, nprocs=1)  # the zygote up, this module in it
        for _ in range(options.rounds):
            for setting in random.sample(settings, len(settings)):
                took, were_ready = one_round(setting, options.nprocs, path, options.first)
                results[setting].append(took)
                ready[setting].append(were_ready)
        fastspawn.prefork(0)
    medians = {setting: statistics.median(values) for setting, values in results.items()}
    ready_medians = {setting: statistics.median(values) for setting, values in ready.items()}
    host = machine()
    preload = ", ".join(options.preload) or "nothing"
    print(
        f"{host['cpu']}, {host['cores']} cores, {options.nprocs} ranks, {preload} preloaded, "
        f"the launch before each gap's ranks {options.first}; "
        f"medians of {options.rounds}: ms from the call to the last rank's first line, "
        "workers ready as it began"
    )
    for setting in settings:
        label = setting if setting in ("ready", "forked") else f"{setting} s after the last"
        print(f"  {label:>22}: {medians[setting]:7.1f} ms, {ready_medians[setting]:g} ready")
    if options.json:
        import json

        with open(options.json, "w") as f:
            json.dump(
                {
                    "machine": host,
                    "nprocs": options.nprocs,
                    "preload": options.preload,
                    "first": options.first,
                    "medians_ms": medians,
                    "rounds_ms": results,
                    "ready_medians": ready_medians,
                    "rounds_ready": ready,
                    "argv": sys.argv[1:],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
