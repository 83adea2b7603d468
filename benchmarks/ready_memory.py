"""What the ready workers a launch leaves behind cost, to make and while
idle: one launch of ``--nprocs`` trivial ranks, no ``prefork()``, then the
zygote's background makes as many ready again (up to FASTSPAWN_READY);
once it has, and the zygote and every worker are asleep with their CPU
time unchanged (their rehearsals done: the bench's own wait for its
refilled row), and a second more passed, each waiting worker's USS
(psutil's ``memory_full_info``), the CPU time it took from its fork to
its wait (its process's CPU clock) and its minor page faults (copies of
the zygote's pages, most of them), their medians (and the USS summed),
how long after the launch returned they were ready so, and how long a
second launch of the same size (which takes them) takes to return, every
rank joined.

    python benchmarks/ready_memory.py [--nprocs 256] [--preload torch] [--json FILE]
    FASTSPAWN_READY=64 python benchmarks/ready_memory.py

Prints the figures with the CPU model; with ``--json`` writes them too.
Each run starts a zygote of its own (this process's), so run it once per
setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import psutil

import fastspawn
from fastspawn._bench import cputime
from fastspawn._bench.host import machine
from fastspawn._bench.methods import _await_ready
from fastspawn._launch.methods import registry
from fastspawn._zygote import client, ready

MIB = 1 << 20


def rank(index: int) -> int:
    return index


def minor_faults(pid: int) -> int | None:
    """Minor page faults of process ``pid`` so far (/proc/PID/stat's
    minflt); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=256, help="ranks of each launch")
    parser.add_argument("--preload", action="append", default=[], help="a module for the zygote")
    parser.add_argument("--json", help="write the figures to this file")
    options = parser.parse_args()
    if options.nprocs < 1:
        parser.error("--nprocs takes a count >= 1")
    if options.preload:
        fastspawn.preload(options.preload)
    fastspawn.start_processes(rank, nprocs=1)  # the zygote up, this module in it
    zygote = client.zygote_pid()
    assert zygote is not None
    method = registry.get("zygote")
    _await_ready(method, 1)
    started = time.monotonic()
    fastspawn.start_processes(rank, nprocs=options.nprocs)
    returned = time.monotonic()
    expected = min(options.nprocs, ready.cap_from_environment(os.environ))
    _await_ready(method, expected)
    made = time.monotonic()
    time.sleep(1.0)  # what more a refill would make, it has made
    waiting = client.ready_workers(zygote)
    uss = sorted(psutil.Process(pid).memory_full_info().uss / MIB for pid in waiting)
    cpu = [ns / 1e6 for ns in map(cputime.process_ns, waiting) if ns is not None]
    faults = [count for count in map(minor_faults, waiting) if count is not None]
    second = time.monotonic()
    fastspawn.start_processes(rank, nprocs=options.nprocs)
    figures = {
        "nprocs": options.nprocs,
        "preload": options.preload,
        "FASTSPAWN_READY": os.environ.get("FASTSPAWN_READY", "default"),
        "first_launch_ms": (returned - started) * 1e3,
        "ready_after_s": made - returned,
        "ready": len(uss),
        "uss_median_mib": statistics.median(uss) if uss else 0.0,
        "uss_sum_mib": sum(uss),
        "cpu_to_ready_ms_median": statistics.median(cpu) if cpu else 0.0,
        "minor_faults_median": statistics.median(faults) if faults else 0,
        "second_launch_ms": (time.monotonic() - second) * 1e3,
    }
    host = machine()
    print(
        f"CPU: {host['cpu']}, {host['usable_cores']} cores; Python {host['python']}; "
        f"preload {options.preload or 'none'}; FASTSPAWN_READY={figures['FASTSPAWN_READY']}"
    )
    print(
        f"launch of {options.nprocs}: {figures['first_launch_ms']:.0f} ms; "
        f"{len(uss)} ready again {figures['ready_after_s']:.2f} s after it returned; "
        f"idle USS median {figures['uss_median_mib']:.2f} MiB, "
        f"summed {figures['uss_sum_mib']:.0f} MiB; "
        f"each took {figures['cpu_to_ready_ms_median']:.2f} ms of CPU and "
        f"{figures['minor_faults_median']:.0f} minor faults to be ready (medians); "
        f"second launch {figures['second_launch_ms']:.0f} ms"
    )
    if options.json:
        with open(options.json, "w") as f:
            json.dump({"machine": host, "argv": sys.argv[1:], **figures}, f, indent=1)


if __name__ == "__main__":
    main()
