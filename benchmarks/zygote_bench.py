"""The zygote's performance goals, each measured as a ratio within one run.

    python benchmarks/zygote_bench.py [--rounds R] [--scenarios a,b,...] [--json FILE]

Scenarios (all by default):
  start64   time from the call until all 64 ranks run a trivial fn: warm and
            cold zygote against a bare os.fork() loop, multiprocessing spawn
            and forkserver.  Rounds interleave the methods.
  scaling   the same for the warm zygote and the bare fork loop at 64, 256 and
            1024 ranks, plus the join of 1024 ranks that exit together (join
            return minus the last rank's return), and the same split at the
            last exit seen on the ranks' pidfds.
  failure   one rank fails among 256 (grace_period=0), once all are up: from
            its failure to the exception in the caller, every other rank
            reaped by then.  Interleaved with the machine's floor: 256
            sleeping children forked from this interpreter, one killpg, all
            reaped.
  memory    summed USS (psutil) of 64 idle ranks: zygote workers (plus the
            zygote itself) against multiprocessing spawn workers.
  torch     64 ranks of a module that imports torch, end to end (call to join
            returned): fastspawn with torch preloaded in the zygote, with and
            without huge pages, against torch.multiprocessing.spawn.
            Skipped without torch.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import zygote_workers as zw  # noqa: E402
from _common import emit, fork_sleepers, kill_and_reap  # noqa: E402

import fastspawn  # noqa: E402
from fastspawn._bench.host import machine  # noqa: E402
from fastspawn._os import oscall  # noqa: E402
from fastspawn._os.hugepages import smaps_rollup  # noqa: E402
from fastspawn._zygote import client

# ------------------------------------------------------------ launch methods


def bare_fork(n: int) -> float:
    """A bare os.fork() loop: each child writes its start time and exits."""
    r, w = os.pipe()
    t0 = time.monotonic()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.write(w, struct.pack("d", time.monotonic()))
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    return max(struct.unpack(f"{n}d", data)) - t0


def zygote_warm(n: int) -> float:
    client.get_server()
    t0 = time.monotonic()
    ctx = fastspawn.start_processes(zw.entry_time, nprocs=n, start_method="zygote")
    return max(ctx.return_values.values()) - t0


def zygote_cold(n: int) -> float:
    fastspawn.stop_zygote()
    t0 = time.monotonic()
    ctx = fastspawn.start_processes(zw.entry_time, nprocs=n, start_method="zygote")
    return max(ctx.return_values.values()) - t0


def mp_method(method: str) -> Callable[[int], float]:
    ctx = mp.get_context(method)

    def run(n: int) -> float:
        times = ctx.RawArray("d", n)
        procs = [ctx.Process(target=zw.entry_time_to_array, args=(i, times)) for i in range(n)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return max(times) - t0

    return run


def rounds_of(
    methods: dict[str, Callable[[int], float]], n: int, rounds: int
) -> dict[str, list[float]]:
    """Interleave the methods round by round, after one warm-up each."""
    for fn in methods.values():
        fn(min(n, 8))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            samples[name].append(fn(n))
            print(f"  {name:16} n={n:5} {samples[name][-1] * 1000:9.1f} ms", file=sys.stderr)
    return samples


def med(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------- scenarios


def start64(rounds: int) -> dict[str, Any]:
    methods = {
        "bare fork loop": bare_fork,
        "zygote warm": zygote_warm,
        "zygote cold": zygote_cold,
        "mp spawn": mp_method("spawn"),
        "mp forkserver": mp_method("forkserver"),
    }
    samples = rounds_of(methods, 64, rounds)
    m = {name: med(v) for name, v in samples.items()}
    return {
        "samples_s": samples,
        "median_s": m,
        "warm_vs_bare_fork": m["zygote warm"] / m["bare fork loop"],
        "spawn_vs_warm": m["mp spawn"] / m["zygote warm"],
        "forkserver_vs_warm": m["mp forkserver"] / m["zygote warm"],
        "spawn_vs_cold": m["mp spawn"] / m["zygote cold"],
    }


def join_1024(rounds: int) -> list[float]:
    """Join return minus the last rank's return from fn: includes every
    rank's exit path (result, exit handlers, kernel teardown)."""
    client.get_server()
    out = []
    for _ in range(rounds):
        t0 = time.monotonic()
        deadline = t0 + 3.0
        ctx = fastspawn.start_processes(zw.exit_together, (deadline,), nprocs=1024)
        joined = time.monotonic()
        out.append(joined - max(ctx.return_values.values()))
        print(f"  join 1024        {out[-1] * 1000:9.1f} ms", file=sys.stderr)
    return out


def join_after_exit_1024(rounds: int) -> list[tuple[float, float]]:
    """Split the join of 1024 ranks at the last exit: watch every pidfd (and
    drain the report channel) until all have polled readable, i.e. every rank
    has exited, then run the context's join.  Returns, per round, (last
    return from fn to last exit seen, last exit seen to join returned)."""
    client.get_server()
    out = []
    for _ in range(rounds):
        deadline = time.monotonic() + 3.0
        ctx = fastspawn.start_processes(zw.exit_together, (deadline,), nprocs=1024, join=False)
        waiter = oscall.Waiter()
        channel = 1 << 40
        for proc in ctx.processes:
            waiter.add(proc.sentinel, proc.rank)
        waiter.add(ctx._receiver.fileno(), channel)
        exited = 0
        while exited < 1024:
            for token in waiter.wait(None):
                if token == channel:
                    ctx._receiver.drain()  # a rank blocked sending cannot exit
                    continue
                waiter.remove(ctx.processes[token].sentinel)
                exited += 1
        last_exit = time.monotonic()
        waiter.close()
        while not ctx.join():
            pass
        joined = time.monotonic()
        split = (last_exit - max(ctx.return_values.values()), joined - last_exit)
        out.append(split)
        print(
            f"  1024: return->exit {split[0] * 1000:7.1f} ms, exit->join {split[1] * 1000:7.1f} ms",
            file=sys.stderr,
        )
    return out


def scaling(rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for n in (64, 256, 1024):
        samples = rounds_of({"bare fork loop": bare_fork, "zygote warm": zygote_warm}, n, rounds)
        result[str(n)] = {name: med(v) for name, v in samples.items()}
        result[str(n)]["zygote per rank"] = result[str(n)]["zygote warm"] / n
    result["join_1024_s"] = join_1024(rounds)
    result["join_1024_split_s"] = join_after_exit_1024(rounds)
    return result


def bare_kill(n: int) -> float:
    """The machine's floor for the failure scenario: ``n`` sleeping children
    forked from this interpreter in one process group, killed with one
    killpg(SIGKILL) and reaped.  Returns killpg to the last waitpid."""
    me = os.getpid()
    pids = fork_sleepers(n, lambda: oscall.set_pdeathsig(signal.SIGKILL, me))
    wall, _cpu = kill_and_reap(pids, lambda: os.killpg(pids[0], signal.SIGKILL))
    return wall


def failure(rounds: int) -> dict[str, Any]:
    """One failure among 256 through fastspawn, and the machine's floor for
    it (the same number of processes of this interpreter's size, one killpg),
    interleaved round by round."""
    # 255 ranks get SIGTERM and SIGKILL logged; discard those records here.
    logging.getLogger("fastspawn").addHandler(logging.NullHandler())
    logging.getLogger("fastspawn").propagate = False
    value = mp.get_context("spawn").Value("d", 0.0, lock=False)
    out: list[float] = []
    floor: list[float] = []
    sizes: dict[str, int] = {}
    for _ in range(rounds):
        deadline = time.monotonic() + 2.0  # every rank is up by then
        ctx = fastspawn.start_processes(zw.fail_one, (200, deadline, value), nprocs=256, join=False)
        zygote = client.zygote_pid()
        assert zygote is not None
        sizes["zygote_anonymous_kib"] = smaps_rollup(zygote)["Anonymous"]
        try:
            while not ctx.join(grace_period=0):
                pass
        except fastspawn.ProcessRaisedException:
            raised = time.monotonic()
        else:
            raise AssertionError("no failure seen")
        assert all(p.exitcode is not None for p in ctx.processes)
        out.append(raised - value.value)
        print(f"  fail 1 of 256    {out[-1] * 1000:9.1f} ms", file=sys.stderr)
        sizes["bench_anonymous_kib"] = smaps_rollup()["Anonymous"]
        floor.append(bare_kill(256))
        print(f"  bare killpg 256  {floor[-1] * 1000:9.1f} ms", file=sys.stderr)
    return {
        "samples_s": out,
        "median_s": med(out),
        "bare_killpg_256_s": floor,
        "bare_killpg_256_median_s": med(floor),
        **sizes,
    }


def _uss(pids: list[int]) -> int:
    return sum(psutil.Process(pid).memory_full_info().uss for pid in pids)


def memory(rounds: int) -> dict[str, Any]:
    ctx_mp = mp.get_context("spawn")
    n = 64
    release = ctx_mp.Event()

    def wait_until_idle(pids: list[int]) -> None:
        # Up means: sleeping in release.wait (no CPU use for a while).
        time.sleep(1.0)
        deadline = time.monotonic() + 120
        while any(psutil.Process(p).cpu_percent(0.2) > 1 for p in pids):
            assert time.monotonic() < deadline

    ctx = fastspawn.start_processes(zw.idle, (release,), nprocs=n, join=False)
    wait_until_idle(ctx.pids())
    zygote_pids, _ = client.helper_processes()
    workers_uss = _uss(ctx.pids())
    zygote_uss = _uss(list(zygote_pids))
    release.set()
    while not ctx.join():
        pass
    release.clear()
    procs = [ctx_mp.Process(target=zw.idle, args=(i, release)) for i in range(n)]
    for p in procs:
        p.start()
    wait_until_idle([p.pid for p in procs])
    spawn_uss = _uss([p.pid for p in procs])
    release.set()
    for p in procs:
        p.join()
    return {
        "zygote_workers_uss": workers_uss,
        "zygote_itself_uss": zygote_uss,
        "mp_spawn_workers_uss": spawn_uss,
        "ratio_spawn_vs_zygote_total": spawn_uss / (workers_uss + zygote_uss),
    }


def torch_scenario(rounds: int) -> dict[str, Any]:
    """64 ranks of a torch-importing module, end to end, with torch preloaded
    in a fresh zygote each round that then idles 2 s (as while a program
    loads its data), with huge pages (the default) and without
    (FASTSPAWN_HUGEPAGES=0), interleaved; then torch.multiprocessing.spawn
    once (it takes a minute or more)."""
    try:
        import torch.multiprocessing as tmp
    except ImportError:
        return {"skipped": "torch is not installed"}
    import torch_workers

    samples: dict[str, list[float]] = {"hugepages": [], "no_hugepages": []}
    huge_kib: dict[str, list[int]] = {kind: [] for kind in samples}
    for _ in range(rounds):
        for kind in samples:
            fastspawn.stop_zygote()
            os.environ["FASTSPAWN_HUGEPAGES"] = "1" if kind == "hugepages" else "0"
            try:
                fastspawn.preload(["torch"])
                # Returns once torch is imported there.
                fastspawn.start_processes(torch_workers.entry_time, nprocs=1)
            finally:
                del os.environ["FASTSPAWN_HUGEPAGES"]
            time.sleep(2.0)
            zygote = client.zygote_pid()
            assert zygote is not None
            huge_kib[kind].append(smaps_rollup(zygote)["AnonHugePages"])
            t0 = time.monotonic()
            fastspawn.spawn(torch_workers.entry_time, nprocs=64)
            samples[kind].append(time.monotonic() - t0)
            print(
                f"  fastspawn torch {kind:13} {samples[kind][-1] * 1000:9.1f} ms", file=sys.stderr
            )
    t0 = time.monotonic()
    tmp.spawn(torch_workers.entry_time, nprocs=64)
    theirs = time.monotonic() - t0
    print(f"  torch mp.spawn   {theirs * 1000:9.1f} ms", file=sys.stderr)
    return {
        "fastspawn_s": samples["hugepages"],
        "fastspawn_no_hugepages_s": samples["no_hugepages"],
        "zygote_anon_huge_kib": huge_kib,
        "torch_spawn_s": theirs,
        "ratio": theirs / med(samples["hugepages"]),
        "ratio_no_hugepages": theirs / med(samples["no_hugepages"]),
        "hugepages_gain": med(samples["no_hugepages"]) / med(samples["hugepages"]),
        "torch": __import__("torch").__version__,
    }


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "start64": start64,
    "scaling": scaling,
    "failure": failure,
    "memory": memory,
    "torch": torch_scenario,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--json", help="write every sample and the machine here")
    args = parser.parse_args()
    report: dict[str, Any] = {"machine": machine(), "rounds": args.rounds}
    for name in args.scenarios.split(","):
        print(f"{name}:", file=sys.stderr)
        report[name] = SCENARIOS[name](args.rounds)
    fastspawn.stop_zygote()
    emit(report, args.json)


if __name__ == "__main__":
    main()
