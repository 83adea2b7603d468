"""What one warm zygote rank costs before its fn runs, against a bare fork
of a process the zygote's size.

    python benchmarks/rank_cost.py [--nprocs 8] [--launches 10] [--json FILE]

Two figures per rank, taken at the first line of fn:

- CPU time: ``time.process_time()``, which starts at zero in a forked
  child, so it is everything the rank has run since fork(2) returned in
  it (the kernel's copy-on-write faults included);
- private pages: the pages of /proc/self/smaps that are the rank's alone
  (Private_Clean + Private_Dirty), by mapping: after a fork every page is
  shared with the parent, so these are the pages the rank has written
  (copied for it) or newly allocated.

The comparison ("bare fork"): one zygote rank forks children in a plain
``os.fork()`` loop, each reading the same two figures at once: a child of
a process the zygote's size that runs nothing of fastspawn's (as
``fastspawn bench``'s floor-sized).  Medians over every rank of every
launch.  The JSON keeps every rank's figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import fastspawn


def _private_pages() -> dict[str, int]:
    """Private pages by mapping (the file's base name, or [heap], [anon] ...)."""
    with open("/proc/self/smaps", "rb") as f:
        data = f.read()  # read whole first: parsing allocates
    pages: collections.Counter[str] = collections.Counter()
    name = "[anon]"
    for line in data.decode().splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            path = fields[5] if len(fields) > 5 else "[anon]"
            name = os.path.basename(path) if path.startswith("/") else path
        elif fields[0] in ("Private_Clean:", "Private_Dirty:"):
            pages[name] += int(fields[1]) // 4  # kB
    return dict(pages)


def rank_fn(rank: int) -> tuple[float, dict[str, int]]:
    cpu = time.process_time()  # first: before anything else runs here
    return cpu, _private_pages()


def bare_forks(rank: int, count: int) -> list[tuple[float, dict[str, int]]]:
    """``count`` children forked one at a time from this rank, each
    reporting what rank_fn reports, at once."""
    found = []
    for _ in range(count):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            cpu = time.process_time()
            os.write(w, json.dumps([cpu, _private_pages()]).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        cpu, pages = json.loads(data)
        found.append((cpu, pages))
    return found


def summary(samples: list[tuple[float, dict[str, int]]]) -> dict[str, object]:
    names = {name for _, pages in samples for name in pages}
    by_mapping = {name: statistics.median(p.get(name, 0) for _, p in samples) for name in names}
    return {
        "ranks": len(samples),
        "cpu_us_median": statistics.median(cpu for cpu, _ in samples) * 1e6,
        "private_pages_median": statistics.median(sum(p.values()) for _, p in samples),
        "private_pages_by_mapping": {
            name: count
            for name, count in sorted(by_mapping.items(), key=lambda kv: -kv[1])
            if count
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--json", help="write every rank's figures here too")
    args = parser.parse_args()
    fastspawn.start_processes(rank_fn, nprocs=1)  # start the zygote, warm it
    zygote: list[tuple[float, dict[str, int]]] = []
    bare: list[tuple[float, dict[str, int]]] = []
    for _ in range(args.launches):
        ctx = fastspawn.start_processes(rank_fn, nprocs=args.nprocs)
        zygote += ctx.return_values.values()
        bare += fastspawn.start_processes(bare_forks, (args.nprocs,), nprocs=1).return_values[0]
    result = {"zygote rank": summary(zygote), "bare fork": summary(bare)}
    print(f"Python {sys.version.split()[0]}, {args.nprocs} ranks x {args.launches} launches")
    for what, s in result.items():
        top = ", ".join(f"{k} {v:g}" for k, v in list(s["private_pages_by_mapping"].items())[:4])
        print(
            f"{what:12} CPU before fn {s['cpu_us_median']:7.0f} us   "
            f"private pages {s['private_pages_median']:5g} ({top})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": result, "zygote": zygote, "bare": bare}, f)


if __name__ == "__main__":
    main()
