"""What collapsing a process's heap into huge pages does to fork() and exit.

    python benchmarks/fork_cost.py [--module torch] [--rounds 5] [--children 32] [--json FILE]

Each round runs two fresh interpreters, one after the other, both importing
``--module``: one forks as is, the other first collapses its heap and arenas
the way the fastspawn zygote does when idle.  Each forks ``--children``
children that stop themselves at once (so the time is the fork alone), then
kills them all with SIGKILL and reaps them (each child's exit tears its page
tables down).  Reports per-child medians and the ratio.
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


def measure(module: str, collapse: bool, children: int) -> dict[str, float]:
    """In this process: import, maybe collapse, fork and kill ``children``."""
    __import__(module)
    collapsed = 0
    if collapse:
        from fastspawn import _server

        collapsed = sum(_server._collapse(a) for a in _server._collapsible_ranges())
    with open("/proc/self/smaps_rollup") as f:
        rollup = {line.split(":")[0]: int(line.split()[1]) for line in f if "kB" in line}
    pids = []
    t0 = time.perf_counter()
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(0)
        pids.append(pid)
    t1 = time.perf_counter()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    t2 = time.perf_counter()
    return {
        "fork_s": (t1 - t0) / children,
        "kill_reap_s": (t2 - t1) / children,
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
    parser.add_argument("--one", choices=["plain", "collapsed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.module, args.one == "collapsed", args.children)))
        return
    samples: dict[str, list[dict[str, float]]] = {"plain": [], "collapsed": []}
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
                f"{s['kill_reap_s'] * 1000:6.2f} ms  (huge {s['anon_huge_kib'] // 1024} "
                f"of {s['anonymous_kib'] // 1024} MiB anonymous)",
                file=sys.stderr,
            )
    med: dict[str, Any] = {
        kind: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for kind, runs in samples.items()
    }
    from fastspawn._bench import machine

    report = {
        "machine": machine(),
        "module": args.module,
        "children": args.children,
        "samples": samples,
        "medians": med,
        "fork_ratio": med["plain"]["fork_s"] / med["collapsed"]["fork_s"],
        "kill_reap_ratio": med["plain"]["kill_reap_s"] / med["collapsed"]["kill_reap_s"],
    }
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
