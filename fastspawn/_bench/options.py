"""``fastspawn bench``'s command line: its options, each checked, and the
Options a run takes."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from fastspawn._bench.common import ALL_METHODS, GROUPS, METHOD_HELP, UsageError

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence


def parse_methods(text: str, torch_problem: str | None) -> tuple[list[str], list[str]]:
    """(methods, notes) from ``--methods``: names and group names, comma-separated.

    Raises:
        UsageError: an unknown name, or torch-spawn asked for without torch.
    """
    wanted: list[str] = []
    notes: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item == "all":
            names = list(ALL_METHODS)
            if torch_problem is not None:
                names.remove("torch-spawn")
                notes.append(f"torch-spawn left out: {torch_problem}")
        elif item in GROUPS:
            names = GROUPS[item]
        elif item in METHOD_HELP:
            names = [item]
        else:
            raise UsageError(
                f"unknown method {item!r} in --methods; valid: {', '.join(ALL_METHODS)}, "
                f"or a group: {', '.join(GROUPS)}, all"
            )
        if "torch-spawn" in names and item != "all" and torch_problem is not None:
            raise UsageError(
                f"torch-spawn needs torch, but {torch_problem}: install torch, or leave "
                "torch-spawn out of --methods"
            )
        wanted.extend(n for n in names if n not in wanted)
    if not wanted:
        raise UsageError("--methods names no method")
    # The table and the plot follow the canonical order, whatever the command line's.
    return [m for m in ALL_METHODS if m in wanted], notes


def parse_nprocs(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise UsageError(
            f"--nprocs takes positive integers separated by commas, like 1,8,64; got {text!r}"
        )
    return values


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64K``, ``1M`` or ``1G`` (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in units:
        number, unit = cleaned[:-1], cleaned[-1]
    try:
        value = int(number) * units[unit]
    except ValueError:
        raise UsageError(
            f"--payload-bytes takes a size like 4096, 64K or 1M; got {text!r}"
        ) from None
    if value < 0:
        raise UsageError(f"--payload-bytes must not be negative; got {text!r}")
    return value


# A longer pause is a mistake (minutes, milliseconds?), not a measurement.
MAX_PAUSE = 60.0


def parse_pause(text: str) -> float:
    """--pause's seconds: a number from 0 to MAX_PAUSE."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--pause takes seconds, like 0.5; got {text!r}") from None
    if not 0 <= value <= MAX_PAUSE:  # NaN fails both
        raise UsageError(f"--pause must be from 0 to {MAX_PAUSE:g} seconds; got {text!r}")
    return value


def torch_problem() -> str | None:
    """Why torch.multiprocessing cannot be used here, or None when it can."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        importlib.import_module("torch.multiprocessing")
    except Exception as exc:
        return f"import torch failed ({type(exc).__name__}: {exc})"
    return None


def _check_output(path: str | None, flag: str) -> None:
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: the folder {folder} does not exist")


def _check_plot(path: str | None) -> None:
    if path is None:
        return
    _check_output(path, "--plot")
    import subprocess

    # In a child: matplotlib in the bench itself would make every fork-based
    # method fork a bigger process.
    done = subprocess.run(
        [sys.executable, "-c", "import matplotlib"], capture_output=True, text=True
    )
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["import failed"])[-1]
        raise UsageError(
            f"--plot needs matplotlib, which this Python cannot import ({why}): "
            "pip install 'fastspawn[plot]', or leave --plot out"
        )


def import_all(modules: Sequence[str]) -> None:
    """Import --import's modules here first: fork-based ranks inherit them,
    and a typo fails now rather than in every rank."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise UsageError(
                f"--import {name}: cannot import it here ({type(exc).__name__}: {exc})"
            ) from None


DESCRIPTION = """\
Measure how long starting worker processes takes on this machine, for
fastspawn and the usual alternatives, in one run whose rounds interleave the
methods (so drift on a noisy machine hits them all alike).

Methods (--methods: names or groups fastspawn, mp, torch, floor, binary;
default: all, torch-spawn only where torch imports):
{methods}

How long: by default nprocs 1,8,64 with 3 rounds each, torch-spawn (whose
every rank imports torch, a second or more of CPU each) kept small: launch
rounds only, up to nprocs 8; under 2 minutes on 2 cores.  --full is the long
sweep: 5 rounds, torch-spawn in full (about 14 minutes on 2 cores).  Before measuring, the bench
launches every method once with one rank and once with a few, untimed, and
from those says how long the run will take; then it shows the rounds done
and the time left (a status line on a terminal, a line every 10 s
elsewhere).

The floor is what forking a rank costs at the least on this machine: a small
helper interpreter (python -I -S importing os, select, signal, struct and
time; no fastspawn, no multiprocessing), started untimed, forks the ranks in
a bare os.fork() loop when the bench asks over a socketpair, and reaps them.
t0 is taken before the request, so its round trip counts, as a launch call
counts for the others.  Its ranks run the same function as every method's
(they report, wait and exit or fail), but import nothing (--import and
--payload-bytes do not apply), and the failure round SIGKILLs the others.
floor-sized is the same loop in a helper the size of a zygote serving a
small program (the same modules and --import's, gc.freeze(), its arenas in
huge pages as the zygote's): a fork costs more from a bigger process, and
this is what one of the zygote's size costs.  floor-preforked and
floor-preforked-sized are the floor of ready workers: the same helpers fork
each round's ranks ahead, untimed, each waiting on a pipe, and the timed
request wakes each with one write.  fastspawn-zygote-warm forks every rank
at launch (its prepare turns ready workers off); fastspawn-zygote-ready
launches from ready workers (its prepare calls fastspawn.prefork(nprocs));
fastspawn-zygote-refilled is the second of two same-size launches with no
prefork() call (its prepare launches once, untimed, and waits until the
zygote has made the workers ready again in the background and each has
warmed up).  Each round's launch follows its preparation at once; --pause
puts that many seconds of sleep between them (every method alike, outside
the timing): a launch after the machine sat idle, which on some machines
costs more, the more memory the ranks touch.

Phases, per round, from t0 just before the launch call:
  created          the launch call returned: start_processes(join=False), the
                   last Process.start(), torch spawn(join=False), the last
                   binary launch or Popen, floor's pids back from its helper
  all running      every rank is inside fn: latest rank entry time - t0
                   (CLOCK_MONOTONIC is system-wide)
  exit->joined     last rank's return from fn to the join returning
  failure->reaped  a separate round: once all ranks run one raises, the others
                   sleep; from its raise until the caller has its exception and
                   every rank is reaped (multiprocessing: wait on the sentinels,
                   terminate the rest, join all, as users write it)
  USS              psutil USS summed over the ranks while all are alive (the
                   zygote's or forkserver's own USS is in the JSON)
  CPU              time on a CPU from t0 until the bench had every rank's
                   entry: the ranks' (a ready or pre-forked rank's from its
                   wake), the helpers' (zygote, forkserver, a floor's helper;
                   a fork is its parent's) and the caller's, the bench's own
  all reaped       binary methods: call to every process reaped
Each cell is the median (min-p90) over --repeat rounds.  The ratio column is
a method's "all running" median over mp-spawn's ("all reaped" over
binary-popen's for binaries); below 1 is faster.  Where floor ran, "vs floor"
divides a Python method's "all running" median by floor's: how far above the
floor each launcher starts its ranks.

Spawn-like ranks re-import the caller's main module; the bench hides its own
(this CLI), so they import only the rank function's module and --import's:
add your program's heavy imports with --import to see what your ranks pay.
With torch-spawn or --import torch the bench process itself imports torch,
so fork-based methods then fork a process that holds torch.

Exit status: 0 done; 1 a measurement failed (the message names the round
and why; the rounds finished before it are printed and written to --json);
2 bad options, a sweep over RLIMIT_NPROC or RLIMIT_NOFILE, --plot without
matplotlib (checked before measuring anything); 130 on Ctrl-C (143 on SIGTERM),
after every process the bench started is killed and reaped.
"""

EPILOG = """\
examples:
  fastspawn bench
  fastspawn bench --methods fastspawn,mp --nprocs 1,8,64,256 --repeat 5 --json bench.json
  fastspawn bench --import torch --methods fastspawn-zygote-warm,mp-spawn,torch-spawn --nprocs 8
  fastspawn bench --methods fastspawn,mp,binary --nprocs 1,8,64 --repeat 3 --plot bench.png
  fastspawn bench --methods floor,fastspawn,mp --nprocs 8,64 --repeat 3
  fastspawn bench --mp --quick
"""


MP_FLAG = "--mp"
DEFAULT_NPROCS = "1,8,64"
QUICK_REPEAT = 3
FULL_REPEAT = 5
QUICK_TORCH_NPROCS = 8


def build_parser() -> argparse.ArgumentParser:
    import argparse

    methods = "\n".join(f"  {name:24} {text}" for name, text in METHOD_HELP.items())
    parser = argparse.ArgumentParser(
        prog="fastspawn bench",
        description=DESCRIPTION.format(methods=methods),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        MP_FLAG,
        action="store_true",
        help="the other mode: multiprocessing contexts (fastspawn's and multiprocessing's) "
        "in a torch DataLoader, a ProcessPoolExecutor and Process loops, torch imported; "
        "its own options: fastspawn bench --mp --help",
    )
    parser.add_argument(
        "--methods",
        default="all",
        metavar="LIST",
        help="comma list of methods or groups (default: all)",
    )
    parser.add_argument(
        "--nprocs",
        default=None,
        metavar="LIST",
        help=f"comma list of rank counts (default: {DEFAULT_NPROCS})",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        metavar="R",
        help=f"rounds per method and nprocs (default: {QUICK_REPEAT}; with --full {FULL_REPEAT})",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the long sweep: {FULL_REPEAT} rounds, torch-spawn in full "
        "(about 14 minutes on 2 cores with torch)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        default="",
        metavar="MODULES",
        help="comma list of modules every rank imports on entry, as your fn's module "
        "would (the zygote and forkservers preload them), e.g. torch",
    )
    parser.add_argument(
        "--payload-bytes",
        default="0",
        metavar="SIZE",
        help="pass a bytes argument of this size (4096, 64K, 1M, ...) to every rank (default: 0)",
    )
    parser.add_argument(
        "--pause",
        default="0",
        metavar="SECONDS",
        help="sleep this long before each timed launch, every method, after its preparation "
        "(default: 0): a launch after the machine sat idle",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write every raw sample and the machine here"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw latency against nprocs per method (needs matplotlib: fastspawn[plot])",
    )
    return parser


class Options:
    """The command line, checked.

    Raises:
        UsageError: from the constructor, naming the bad option.
    """

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        items = {part.strip() for part in args.methods.split(",")}
        # torch is imported only where torch-spawn may run (it takes seconds).
        problem = torch_problem() if items & {"all", "torch", "torch-spawn"} else None
        self.methods, self.notes = parse_methods(args.methods, problem)
        self.nprocs = parse_nprocs(args.nprocs or DEFAULT_NPROCS)
        repeat = args.repeat
        if repeat is None:
            repeat = FULL_REPEAT if args.full else QUICK_REPEAT
        if repeat < 1:
            raise UsageError(f"--repeat must be at least 1; got {repeat}")
        self.repeat: int = repeat
        self.full: bool = args.full
        # The default run keeps torch-spawn small (launch rounds only, up to
        # nprocs 8): each of its ranks imports torch.  With --nprocs given,
        # it runs at every size asked.
        self.caps: dict[str, int] = (
            {"torch-spawn": QUICK_TORCH_NPROCS}
            if "torch-spawn" in self.methods and not args.full and args.nprocs is None
            else {}
        )
        self.imports = [m.strip() for m in args.imports.split(",") if m.strip()]
        self.payload_bytes = parse_size(args.payload_bytes)
        self.pause = parse_pause(args.pause)
        _check_output(args.json, "--json")
        _check_plot(args.plot)
        self.json: str | None = args.json
        self.plot: str | None = args.plot
        self.argv = list(argv)
