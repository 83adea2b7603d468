"""What touching a page again costs after the machine sat idle.

    python benchmarks/idle_touch.py [--pages 2048] [--pauses 0,0.1,0.5,2] [--rounds 3] [--json FILE]

The bound behind ``fastspawn bench --pause``: a woken worker's memory is
its own and mapped, yet on some virtual machines a page left untouched for
a while costs far more to read again than one read a moment ago.  This
process maps ``--pages`` pages and touches each once; then, for each pause
in turn, sleeps that long and reads one byte of every page (each read a
page not read since the pause), then reads them all again at once (warm).
A forked child then sleeps as long and reads the same pages, shared with
this process, right after this process has read them again: what a page
costs that another process touched a moment ago (the zygote's pages, for
its workers).  Prints nanoseconds per page, medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from typing import Any

PAGE = mmap.PAGESIZE


def read_pages(buf: mmap.mmap, pages: int) -> float:
    """Nanoseconds per page to read one byte of each of ``pages``."""
    total = 0
    started = time.perf_counter_ns()
    for index in range(pages):
        total += buf[index * PAGE]
    return (time.perf_counter_ns() - started) / pages


def child_after(buf: mmap.mmap, pages: int, pause: float) -> float:
    """A child forked now sleeps ``pause`` s (this process reads every page
    meanwhile, just before the child wakes), then reads them: ns per page."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            time.sleep(pause + 0.05)
            os.write(write_end, str(read_pages(buf, pages)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        time.sleep(pause)
        read_pages(buf, pages)
        with os.fdopen(read_end, "rb") as answer:
            return float(answer.read())
    finally:
        os.waitpid(pid, 0)


def measure(pages: int, pauses: list[float], rounds: int) -> dict[str, Any]:
    buf = mmap.mmap(-1, pages * PAGE)
    try:
        for index in range(pages):
            buf[index * PAGE] = 1  # mapped and ours before anything is timed
        samples: dict[str, dict[str, list[float]]] = {}
        for _ in range(rounds):
            for pause in pauses:
                row = samples.setdefault(f"{pause:g}", {"after": [], "warm": [], "child": []})
                time.sleep(pause)
                row["after"].append(read_pages(buf, pages))
                row["warm"].append(read_pages(buf, pages))
                row["child"].append(child_after(buf, pages, pause))
        return samples
    finally:
        buf.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--pauses", default="0,0.1,0.5,2", help="seconds, comma list")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    pauses = [float(p) for p in args.pauses.split(",")]
    samples = measure(args.pages, pauses, args.rounds)
    print(f"ns per page of {args.pages}, median of {args.rounds} rounds:")
    print(f"{'pause s':>8} {'after it':>9} {'warm':>7} {'child':>7}")
    for pause, row in samples.items():
        after, warm, child = (statistics.median(row[key]) for key in ("after", "warm", "child"))
        print(f"{pause:>8} {after:>9.0f} {warm:>7.0f} {child:>7.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pages": args.pages, "samples_ns": samples, "argv": sys.argv}, f, indent=1)


if __name__ == "__main__":
    main()
