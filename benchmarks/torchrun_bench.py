"""fastspawn run against torchrun, and against the floor: torch's import
and its rendezvous.

    python benchmarks/torchrun_bench.py [--rounds 5] [--json FILE]

Two cases, each timed from the command's start (wall clock, CLOCK_REALTIME,
system-wide) to the moment the last rank reports:

  script  8 ranks of a script whose first line imports torch, one node; a
          rank reports once the import is done (it is "running").
            fastspawn-standalone  fastspawn run --standalone --preload torch
                                  (torch's agent, c10d rendezvous)
            fastspawn-static      fastspawn run --preload torch (no agent)
            torchrun              torchrun --standalone
            floor                 one `python -c "import torch"` that then
                                  runs torch's c10d rendezvous for one node
            bound                 the floor beside a second `import torch`:
                                  what fastspawn-standalone must do at least
                                  (its agent and its zygote each import
                                  torch), on a machine with fewer free
                                  cores than processes
            import-torch          `python -c "import torch"` alone
  ddp     examples/ddp_train.py --stamp --steps 1, 2 nodes x 2 ranks on this
          machine, c10d rendezvous (--rdzv-endpoint 127.0.0.1:PORT); a rank
          reports once past init_process_group.
            fastspawn             fastspawn run --preload torch, per node
            torchrun              torchrun, per node
            floor                 two processes (one per node), each
                                  importing torch and joining torch's c10d
                                  rendezvous for two nodes
            bound                 the floor beside two more `import torch`
                                  (two agents and two zygotes import torch)

Every method runs once per round, in an order that rotates from round to
round, so that drift on a noisy machine hits all alike.  Reported: the
median (min-max) over the rounds, and each method's median over the
floor's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from fastspawn._bench.host import machine
from fastspawn._cli.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TIMEOUT = 600

SCRIPT = """\
import time
import torch
print(f"{time.time():.6f}\\n", end="", flush=True)
"""

# torch's import, then its own c10d rendezvous (what the agent runs first).
FLOOR = """\
import sys, time
import torch
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
nnodes, endpoint = int(sys.argv[1]), sys.argv[2]
params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="floor",
                              min_nodes=nnodes, max_nodes=nnodes)
handler = get_rendezvous_handler(params)
handler.next_rendezvous()
print(f"{time.time():.6f}\\n", end="", flush=True)
time.sleep(3)  # untimed: the store's host stays while the other node reads it
"""

IMPORT_TORCH = "import time, torch; print(f'{time.time():.6f}')"


def _stamps(text: str) -> list[float]:
    """The times reported on stdout: a bare number per line, or DDP's
    ``past init_process_group T``."""
    found = []
    for line in text.splitlines():
        last = line.split()[-1] if line.split() else ""
        try:
            found.append(float(last))
        except ValueError:
            continue
    return found


class RunFailed(Exception):
    """A measured command failed; the message ends with its stderr's tail."""


def _run_all(commands: list[list[str]], workdir: Path, expected: int) -> float:
    """Start ``commands`` together; seconds from the first start to the
    latest stamp any of them printed (``expected`` stamps in all).

    Raises:
        RunFailed: one exited non-zero, or fewer stamps came.
    """
    env = {**os.environ, "TMPDIR": str(workdir), "PYTHONUNBUFFERED": "1"}
    outs = [workdir / f"out{i}" for i in range(len(commands))]
    errs = [workdir / f"err{i}" for i in range(len(commands))]
    t0 = time.time()
    procs = []
    for command, out, err in zip(commands, outs, errs, strict=True):
        with open(out, "w") as f, open(err, "w") as e:
            procs.append(subprocess.Popen(command, stdout=f, stderr=e, cwd=workdir, env=env))
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    stamps = [s for out in outs for s in _stamps(out.read_text())]
    if any(codes) or len(stamps) != expected:
        tails = [err.read_text()[-1500:] for err, code in zip(errs, codes, strict=True) if code]
        raise RunFailed(
            f"{' '.join(commands[0][:3])}...: exit codes {codes}, {len(stamps)} of {expected} "
            f"stamps; stderr of the failed:\n" + "\n---\n".join(tails)
        )
    return max(stamps) - t0


def _fastspawn(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastspawn", "run", *args]


def script_case(workdir: Path) -> dict[str, Callable[[], float]]:
    script = workdir / "script.py"
    script.write_text(SCRIPT)
    floor = workdir / "floor.py"
    floor.write_text(FLOOR)
    ranks = ["--nproc-per-node", "8", str(script)]
    py = sys.executable
    floor_cmd = [py, str(floor), "1", "localhost:0"]
    return {
        "fastspawn-standalone": lambda: _run_all(
            [_fastspawn("--standalone", "--preload", "torch", *ranks)], workdir, 8
        ),
        "fastspawn-static": lambda: _run_all(
            [_fastspawn("--preload", "torch", *ranks)], workdir, 8
        ),
        "torchrun": lambda: _run_all([[TORCHRUN, "--standalone", *ranks]], workdir, 8),
        "floor": lambda: _run_all([floor_cmd], workdir, 1),
        "bound": lambda: _run_all([floor_cmd, [py, "-c", IMPORT_TORCH]], workdir, 2),
        "import-torch": lambda: _run_all([[py, "-c", IMPORT_TORCH]], workdir, 1),
    }


def ddp_case(workdir: Path) -> dict[str, Callable[[], float]]:
    floor = workdir / "floor.py"
    floor.write_text(FLOOR)
    ddp = [str(ROOT / "examples" / "ddp_train.py"), "--stamp", "--steps", "1"]
    py = sys.executable

    def nodes(launcher: Callable[..., list[str]], *extra: str) -> float:
        endpoint = f"127.0.0.1:{free_port()}"
        rdzv = [
            *("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", endpoint, "--rdzv-id", f"bench{time.monotonic_ns()}"),
        ]
        return _run_all([launcher(*extra, *rdzv, *ddp) for _ in range(2)], workdir, 4)

    def floors(extra_imports: int) -> float:
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [[py, str(floor), "2", endpoint] for _ in range(2)]
        commands += [[py, "-c", IMPORT_TORCH]] * extra_imports
        return _run_all(commands, workdir, 2 + extra_imports)

    return {
        "fastspawn": lambda: nodes(_fastspawn, "--preload", "torch"),
        "torchrun": lambda: nodes(lambda *a: [TORCHRUN, *a]),
        "floor": lambda: floors(0),
        "bound": lambda: floors(2),
    }


def measure(methods: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Every method once per round, in an order rotated each round; also
    the 1-minute load average at the start of each round ("load")."""
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in [*names, "load"]}
    for round_index in range(rounds):
        samples["load"].append(os.getloadavg()[0])
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            try:
                samples[name].append(methods[name]())
            except RunFailed as exc:
                # Counted and shown, not timed: a launcher that fails now
                # and then is part of what is measured.
                FAILURES.setdefault(name, []).append(str(exc))
                print(f"round {round_index}: {name} failed: {exc}", file=sys.stderr)
    return samples


FAILURES: dict[str, list[str]] = {}


def table(title: str, samples: dict[str, list[float]]) -> str:
    floor = statistics.median(samples["floor"])
    load = samples["load"]
    lines = [
        f"{title}\n({len(load)} rounds; 1-minute load average {min(load):.1f}-{max(load):.1f}, "
        f"median {statistics.median(load):.1f})",
        f"{'method':<22}{'median s':>10}{'min-max s':>16}{'vs floor':>10}",
    ]
    for name, values in samples.items():
        if name == "load":
            continue
        if not values:
            lines.append(f"{name:<22}{'every run failed':>26}")
            continue
        median = statistics.median(values)
        spread = f"{min(values):.2f}-{max(values):.2f}"
        failed = len(FAILURES.get(name, []))
        note = f"   ({failed} failed)" if failed else ""
        lines.append(f"{name:<22}{median:>10.2f}{spread:>16}{median / floor:>9.2f}x{note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="script,ddp")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="torchrun-bench-"))
    results = {}
    try:
        for case in args.cases.split(","):
            methods = script_case(workdir) if case == "script" else ddp_case(workdir)
            samples = measure(methods, args.rounds)
            results[case] = samples
            title = {
                "script": "8 ranks of `import torch`, one node: command -> every rank running",
                "ddp": "DDP, 2 nodes x 2 ranks, c10d: command -> every rank past "
                "init_process_group",
            }[case]
            print(table(title, samples), end="\n\n", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(textwrap.fill(f"machine: {json.dumps(machine())}", 100))
    if args.json:
        with open(args.json, "w") as f:
            record = {"machine": machine(), "rounds": args.rounds, "results": results}
            json.dump({**record, "failures": FAILURES}, f, indent=1)


if __name__ == "__main__":
    main()
