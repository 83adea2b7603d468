"""Binary launch: fastspawn's C launcher and binary ranks against subprocess.Popen.

    python benchmarks/binary_bench.py [--count 256] [--rounds 5] [--parent-mib 1024]

Each round starts ``--count`` copies of /bin/true and waits for all, four
ways, interleaved round by round:
  elastic      fastspawn.elastic.start_processes with /bin/true as the
               entrypoint (what `fastspawn run --no-python` runs): the zygote
               starts each rank with the C launcher
  fastspawn    fastspawn's clone(CLONE_VM|CLONE_VFORK)+exec launcher, with
               PR_SET_PDEATHSIG armed before exec and the parent re-checked
  popen+pdeath subprocess.Popen with a preexec_fn that sets PR_SET_PDEATHSIG
               (through ctypes, as users write it); preexec_fn forces fork
  popen        plain subprocess.Popen (vfork/posix_spawn inside, no pdeathsig)
The parent first allocates and touches ``--parent-mib`` MiB, as a training
process holding its model would: fork's cost grows with that, vfork's not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from fastspawn._bench.host import machine
from fastspawn._os import oscall

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _preexec() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def fastspawn_launch(count: int) -> float:
    env = dict(os.environ)
    t0 = time.monotonic()
    pidfds = [
        oscall.launch("/bin/true", ["true"], env, pdeathsig=signal.SIGKILL)[1] for _ in range(count)
    ]
    for fd in pidfds:
        oscall.pidfd_wait(fd, nohang=False)
        os.close(fd)
    return time.monotonic() - t0


def elastic_launch(count: int) -> float:
    from fastspawn import elastic

    ranks = range(count)
    t0 = time.monotonic()
    ctx = elastic.start_processes(
        "bench", "/bin/true", {r: () for r in ranks}, {r: {} for r in ranks}, log_dir=os.devnull
    )
    result = ctx.wait()
    elapsed = time.monotonic() - t0
    if result is None or result.is_failed():
        raise RuntimeError(f"a rank failed: {result}")
    return elapsed


def popen(preexec: bool) -> Callable[[int], float]:
    def run(count: int) -> float:
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(["/bin/true"], preexec_fn=_preexec if preexec else None)
            for _ in range(count)
        ]
        for p in procs:
            p.wait()
        return time.monotonic() - t0

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parent-mib", type=int, default=1024)
    args = parser.parse_args()
    ballast = bytearray(args.parent_mib * 1024 * 1024)
    if ballast:
        ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page
    methods = {
        "elastic": elastic_launch,
        "fastspawn": fastspawn_launch,
        "popen+pdeath": popen(True),
        "popen": popen(False),
    }
    for fn in methods.values():
        fn(8)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            samples[name].append(fn(args.count))
            print(f"  {name:13} {samples[name][-1] * 1000:8.1f} ms", file=sys.stderr)
    med = {name: statistics.median(v) for name, v in samples.items()}
    report = {
        "machine": machine(),
        "count": args.count,
        "parent_mib": args.parent_mib,
        "samples_s": samples,
        "median_s": med,
        "popen_pdeath_vs_fastspawn": med["popen+pdeath"] / med["fastspawn"],
        "popen_vs_fastspawn": med["popen"] / med["fastspawn"],
        "elastic_vs_popen": med["elastic"] / med["popen"],
        "popen_pdeath_vs_elastic": med["popen+pdeath"] / med["elastic"],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
