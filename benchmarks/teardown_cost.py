"""What the kernel charges to tear down a forked process, by what it maps.

    python benchmarks/teardown_cost.py [--rounds 5] [--children 256] [--json FILE]

When one rank of a launch fails, the others are killed and the kernel tears
down each of their address spaces; with hundreds of ranks on a few cores that
teardown is most of the time until the exception (the zygote benchmark's
failure scenario).  This measures its cost model.  Each round runs one fresh
interpreter per variant, interleaved; each forks ``--children`` children that
sleep, then kills them all with one killpg(SIGKILL) and reaps them with
wait4().  Per variant:

- wall: killpg to the last reap;
- teardown CPU: the children's CPU time as wait4() reports it minus what
  they had used before the kill (/proc/PID/schedstat), summed.

Variants (all import fastspawn's C core, for MADV_COLLAPSE):
  bare       nothing else
  mappings   200 extra one-page mappings (alternately read-only and written,
             so that none merge)
  anon       16 MiB of written private memory in 4 KiB pages
  anon-huge  the same 16 MiB collapsed into 2 MiB huge pages (skipped where
             MADV_COLLAPSE or huge pages are not available)
  zygote     shaped as the zygote shapes itself: object arenas placed in
             one aligned region first (fastspawn._os.hugepages), then its
             imports (fastspawn._zygote, multiprocessing.spawn), gc.freeze()
             and the huge-page collapse of its idle time
  zygote-unplaced  the same without placing the arenas
Slopes per child come from each variant's difference to ``bare``.
"""

from __future__ import annotations

import os
import sys

from _common import emit, fork_sleepers, kill_and_reap

EXTRA_MAPPINGS = 200
ANON_MIB = 16
HUGE = 2 << 20
VARIANTS = ("bare", "mappings", "anon", "anon-huge", "zygote", "zygote-unplaced")


def _prepare(variant: str) -> list[object]:
    """Shape this process as ``variant``; returns what must stay alive."""
    from fastspawn._os import hugepages

    if variant == "zygote":
        hugepages.place_arenas()  # first, as in the zygote
    import mmap

    from fastspawn._os import oscall
    from fastspawn._os._core import ffi

    keep: list[object] = []
    PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # noqa: N806
    if variant == "mappings":
        for i in range(EXTRA_MAPPINGS):
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0)
            area = mmap.mmap(-1, mmap.PAGESIZE, flags=PRIVATE, prot=prot)
            if i % 2:
                area[0] = 1
            keep.append(area)
    elif variant in ("anon", "anon-huge"):
        area = mmap.mmap(-1, (ANON_MIB << 20) + HUGE, flags=PRIVATE)
        base = int(ffi.cast("uintptr_t", ffi.from_buffer(area)))
        offset = -base % HUGE  # ANON_MIB MiB from a 2 MiB boundary on
        for page in range(offset, offset + (ANON_MIB << 20), mmap.PAGESIZE):
            area[page] = 1
        if variant == "anon-huge":
            for stretch in range(base + offset, base + offset + (ANON_MIB << 20), HUGE):
                oscall.collapse_hugepages(stretch, HUGE)
        keep.append(area)
    elif variant in ("zygote", "zygote-unplaced"):
        import gc
        import multiprocessing.spawn  # noqa: F401

        import fastspawn._zygote  # noqa: F401

        gc.freeze()
        if hugepages.wanted():
            for stretch in hugepages.collapsible_ranges():
                hugepages.collapse(stretch)
    return keep


def measure(variant: str, children: int) -> dict[str, float]:
    """In this process: shape it, fork ``children`` sleepers, kill, reap."""
    import signal

    keep = _prepare(variant)
    from fastspawn._os.hugepages import smaps_rollup

    rollup = smaps_rollup()
    with open("/proc/self/maps") as f:
        mappings = sum(1 for _ in f)
    pids = fork_sleepers(children)
    wall, cpu = kill_and_reap(pids, lambda: os.killpg(pids[0], signal.SIGKILL))
    del keep
    return {
        "wall_s": wall,
        "teardown_cpu_s": cpu,
        "mappings": mappings,
        "anonymous_kib": rollup["Anonymous"],
        "anon_huge_kib": rollup["AnonHugePages"],
    }


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        result = measure(sys.argv[2], int(sys.argv[3]))
        import json  # not before: the variants' imports come first

        print(json.dumps(result))
        return

    import argparse
    import json
    import statistics
    import subprocess

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--children", type=int, default=256)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--json")
    args = parser.parse_args()

    from fastspawn._bench.host import machine
    from fastspawn._os import hugepages

    variants = [v for v in args.variants.split(",") if v in VARIANTS]
    if "bare" not in variants:
        parser.error("--variants must include bare (the slopes are differences to it)")
    if not hugepages.wanted() and "anon-huge" in variants:
        variants.remove("anon-huge")  # nothing can be collapsed here
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            out = subprocess.run(
                [sys.executable, __file__, "--one", variant, str(args.children)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            s = json.loads(out)
            samples[variant].append(s)
            print(
                f"  {variant:9} wall {s['wall_s'] * 1000:6.1f} ms  teardown CPU "
                f"{s['teardown_cpu_s'] * 1000:6.1f} ms  ({s['mappings']} mappings, "
                f"{s['anonymous_kib'] // 1024} MiB anonymous, {s['anon_huge_kib'] // 1024} huge)",
                file=sys.stderr,
            )
    med = {
        variant: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for variant, runs in samples.items()
    }
    n = args.children

    def per_child_us(variant: str, key: str, units: float) -> float:
        return (med[variant][key] - med["bare"][key]) / n / units * 1e6

    slopes = {"teardown_cpu_us_per_child_bare": med["bare"]["teardown_cpu_s"] / n * 1e6}
    if "mappings" in med:
        extra = med["mappings"]["mappings"] - med["bare"]["mappings"]
        slopes["teardown_cpu_us_per_mapping"] = per_child_us("mappings", "teardown_cpu_s", extra)
    for variant, key in (("anon", "4k"), ("anon-huge", "huge")):
        if variant in med:
            slopes[f"teardown_cpu_us_per_mib_{key}"] = per_child_us(
                variant, "teardown_cpu_s", ANON_MIB
            )
    report = {
        "machine": machine(),
        "children": n,
        "samples": samples,
        "medians": med,
        "slopes": slopes,
    }
    emit(report, args.json)


if __name__ == "__main__":
    main()
