"""What huge pages in a process's heap do to fork() and exit.

    python benchmarks/fork_cost.py [--module torch] [--rounds 5] [--children 32] [--json FILE]

Each round runs three fresh interpreters, one after the other, each importing
``--module``: "plain" forks as is; "collapsed" first collapses its heap and
arenas the way the fastspawn zygote does when idle; "placed" also placed its
object arenas in one aligned region before the import, as the zygote does
from its first line (fastspawn._os.hugepages), then collapses.  Each forks
``--children`` children that stop themselves at once (so the time is the
fork alone), then kills them all with SIGKILL and reaps them (each child's
exit tears its page tables down).  Reports per-child medians and the ratios
to "plain".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import emit, kill_and_reap

KINDS = ("plain", "collapsed", "placed")


def measure(module: str, kind: str, children: int) -> dict[str, float]:
    """In this process: maybe place, import, maybe collapse, fork and kill
    ``children``."""
    from fastspawn._os import hugepages

    if kind == "placed":
        hugepages.place_arenas()
    __import__(module)
    collapsed = 0
    if kind != "plain":
        collapsed = sum(hugepages.collapse(a) for a in hugepages.collapsible_ranges())
    rollup = hugepages.smaps_rollup()
    pids = []
    t0 = time.perf_counter()
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(0)
        pids.append(pid)
    t1 = time.perf_counter()
    time.sleep(0.2)  # all stopped

    def kill() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    wall, cpu = kill_and_reap(pids, kill)
    return {
        "fork_s": (t1 - t0) / children,
        "kill_reap_s": wall / children,
        "teardown_cpu_s": cpu / children,
        "anonymous_kib": rollup["Anonymous"],
        "anon_huge_kib": rollup["AnonHugePages"],
        "collapsed_2mib": collapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--module", default="torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--children", type=int, default=32)
    parser.add_argument("--json")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.module, args.one, args.children)))
        return
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in samples:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    kind,
                    "--module",
                    args.module,
                    "--children",
                    str(args.children),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            samples[kind].append(json.loads(out))
            s = samples[kind][-1]
            print(
                f"  {kind:9} fork {s['fork_s'] * 1000:6.2f} ms  kill+reap "
                f"{s['kill_reap_s'] * 1000:6.2f} ms  teardown CPU "
                f"{s['teardown_cpu_s'] * 1000:6.2f} ms  (huge {s['anon_huge_kib'] // 1024} "
                f"of {s['anonymous_kib'] // 1024} MiB anonymous)",
                file=sys.stderr,
            )
    med: dict[str, Any] = {
        kind: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for kind, runs in samples.items()
    }
    from fastspawn._bench.host import machine

    report = {
        "machine": machine(),
        "module": args.module,
        "children": args.children,
        "samples": samples,
        "medians": med,
        "ratios_to_plain": {
            kind: {
                key: med["plain"][key] / med[kind][key]
                for key in ("fork_s", "kill_reap_s", "teardown_cpu_s")
            }
            for kind in KINDS[1:]
        },
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
