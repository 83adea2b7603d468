"""``fastspawn`` on the command line: ``fastspawn run`` (and ``python -m
fastspawn run``) starts N ranks of a program per node, torchrun-style."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fastspawn import _cli_stacks, _limits, _script, _stacks, _zygote_client, elastic
from fastspawn._methods import registry

RUN_DESCRIPTION = """\
Start N copies (ranks) of a program on this node, each with the environment
torch.distributed expects: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT (plus TORCHELASTIC_RESTART_COUNT,
TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_ERROR_FILE).  The options are
torchrun's, with torchrun's names and meanings (each also under its
underscore spelling, --nproc_per_node): a torchrun command line works with
the program name swapped.  Every rank, and every child of a rank, dies with
this command, however it is stopped.

A Python program (a .py file, or -m module) runs in each rank as __main__ in
a worker forked from fastspawn's zygote, which has the --preload modules
imported already (as `python -u`; see the README for what differs from a
fresh interpreter); --exec starts a fresh interpreter per rank instead.
Anything else is exec'd as a binary.

Rendezvous: the static one by default (no torch needed): --nnodes N,
--node-rank, --master-addr, --master-port.  A dynamic one (--rdzv-backend
c10d, --standalone, --nnodes MIN:MAX) runs torch's own elastic agent, with
fastspawn starting the workers: it needs torch.

Exit status: 0 when every rank succeeded; else the first failed rank's exit
code (128+N for a rank killed by signal N), with a one-line summary on stderr.

Ctrl-C or SIGTERM stops every rank (SIGKILL after 10 s) and exits
128+signal; a second Ctrl-C or SIGTERM kills every rank at once.

Where the ranks are: when a rank fails, the Python stacks of every thread
of the ranks still running are shown before they are stopped, and written
to stacks.log in each rank's log directory; SIGUSR1 to this command shows
them at any time, `fastspawn stacks PID` from another shell, and
--hang-timeout when the job stops making progress (--hang-action kill then
stops it, exit status 124).  A Python program gets them in its zygote
worker (with --exec, through a small bootstrap: python -u -c ...
program.py); another program shows its state in the kernel only.
--no-stacks: none of it, SIGUSR1 left at its default.

Inside a Slurm job step (under srun: SLURM_STEP_ID is set), --nnodes,
--node-rank and --master-addr default to SLURM_NNODES, SLURM_NODEID and the
first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_NODELIST,
else SLURM_JOB_NODELIST).  A plain salloc or sbatch shell is not a step: there
give the flags, or start fastspawn run with srun.  torchrun's PET_* variables
(PET_NNODES, PET_NPROC_PER_NODE, ...) give defaults too, as they do torchrun's.
"""

RUN_EPILOG = """\
examples:
  fastspawn run --nproc-per-node 4 train.py --epochs 3
  fastspawn run --preload torch --standalone --nproc-per-node 8 train.py
  fastspawn run --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint node0:29400 --rdzv-id job7 --max-restarts 3 train.py
  fastspawn run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
      --nproc-per-node 8 train.py
  fastspawn run --nproc-per-node 8 --log-dir logs --tee 3 -- ./worker --flag
"""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``node[03-05,07],gpu1`` -> ``node03``,
    ``rack1-n[7-8]-ib`` -> ``rack1-n7-ib``, ``r[1-2]n[5-6]`` -> ``r1n5``.

    Raises:
        ValueError: the list is empty or its brackets do not pair up.
    """
    text = nodelist.strip()
    host = []
    pos = 0
    while pos < len(text):
        char = text[pos]
        if char == ",":  # a comma outside brackets ends the first host
            break
        if char == "]":
            raise ValueError(f"cannot read the Slurm node list {nodelist!r}: unpaired ']'")
        if char == "[":
            close = text.find("]", pos)
            if close < 0:
                raise ValueError(f"cannot read the Slurm node list {nodelist!r}: unpaired '['")
            # "03-05,07": the first item, and of a range its first number
            # (kept as written: Slurm's zero padding is part of the name).
            host.append(text[pos + 1 : close].split(",")[0].split("-")[0].strip())
            pos = close + 1
            continue
        host.append(char)
        pos += 1
    if not "".join(host):
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}: no host")
    return "".join(host)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class UsageError(Exception):
    """Options that do not go together, or a value that cannot be used,
    found after parsing (some once the environment, Slurm or torch, has
    completed them): ``fastspawn run`` shows its usage and the message and
    exits 2, as for the errors argparse finds itself."""


def _pet(dest: str, default: str | None) -> str | None:
    """torchrun's environment defaults: an option may come from
    ``PET_<DEST>`` (cluster launchers such as Kubeflow's set PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK, ...).  argparse applies the option's
    type to a string default."""
    return os.environ.get(f"PET_{dest.upper()}", default)


def _pet_flag(dest: str) -> bool:
    return os.environ.get(f"PET_{dest.upper()}", "0") == "1"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# torchrun's --nproc-per-node words: resolved to a number when the run starts.
_NPROC_WORDS = ("cpu", "gpu", "xpu", "auto")


def _ranks(text: str) -> int | str:
    """--nproc-per-node: a number at least 1, and no more than the limits on
    processes and open files allow (an absurd count is a usage error, not
    a launch that takes every free pid on the machine); or one of torchrun's
    words (cpu, gpu, xpu, auto), resolved at the start (resolve_nprocs)."""
    if text in _NPROC_WORDS:
        return text
    try:
        value = _positive(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give a number or one of {', '.join(_NPROC_WORDS)}, got {text!r}"
        ) from None
    try:
        _limits.check_nprocs(value, f"a launch of {value} ranks", "lower --nproc-per-node")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` (torchrun's --nnodes) as (min, max).

    Raises:
        ValueError: anything else, or not 1 <= MIN <= MAX.
    """
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"{text!r} is not N or MIN:MAX")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise ValueError(f"{text!r}: need 1 <= MIN <= MAX")
    return low, high


def _nnodes(text: str) -> str:
    try:
        parse_nnodes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"give N or MIN:MAX: {exc}") from None
    return text


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def _std(text: str) -> elastic.Std | dict[int, elastic.Std]:
    try:
        return elastic.Std.from_str(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ranks_filter(text: str) -> frozenset[int] | None:
    """--local-ranks-filter: ``"0,2"``; empty for every rank."""
    if not text:
        return None
    try:
        return frozenset(int(rank) for rank in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give local ranks separated by commas, like 0,1, got {text!r}"
        ) from None


def _modules(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, **kwargs: Any
) -> None:
    """Add an option under ``flags``, and torchrun's underscore spelling of
    each dashed long flag (``--nproc_per_node``) as a hidden alias with the
    same dest: an error names the spelling that was used."""
    action = parser.add_argument(*flags, **kwargs)
    twins = ["--" + flag[2:].replace("-", "_") for flag in flags if flag.startswith("--")]
    twins = [twin for twin in twins if twin not in flags]
    if twins:
        alias = {**kwargs, "dest": action.dest, "default": argparse.SUPPRESS}
        parser.add_argument(*twins, **{**alias, "help": argparse.SUPPRESS})


def run_parser(parser: argparse.ArgumentParser) -> None:
    _option(
        parser,
        "--nproc-per-node",
        "--nprocs-per-node",
        dest="nproc_per_node",
        type=_ranks,
        default=_pet("nproc_per_node", "1"),
        metavar="N",
        help="ranks to start on this node: a number, or cpu, gpu, xpu or auto (default: 1)",
    )
    _option(
        parser,
        "--nnodes",
        type=_nnodes,
        default=_pet("nnodes", None),
        metavar="N|MIN:MAX",
        help="number of nodes, or its range for an elastic job (a dynamic rendezvous) "
        "(default: SLURM_NNODES in a Slurm step, else 1)",
    )
    _option(
        parser,
        "--node-rank",
        type=_non_negative,
        default=_pet("node_rank", None),
        help="this node's index, static rendezvous (default: SLURM_NODEID in a Slurm step, else 0)",
    )
    _option(
        parser,
        "--master-addr",
        default=_pet("master_addr", None),
        help="address of node 0, static rendezvous (default: the first host of the Slurm "
        "step, else 127.0.0.1)",
    )
    _option(
        parser,
        "--master-port",
        type=_port,
        default=_pet("master_port", None),
        help="port on node 0, static rendezvous (default: a free port on one node, 29500 "
        "on several)",
    )
    _option(
        parser,
        "--log-dir",
        default=_pet("log_dir", None),
        help="static rendezvous: an empty directory for {attempt}/{rank}/stdout.log|"
        "stderr.log of the streams --redirects or --tee name (default: a new private "
        "temporary directory when they name any); dynamic: torch's layout, "
        "{rdzv_id}_*/attempt_N/{rank}/",
    )
    _option(
        parser,
        "-r",
        "--redirects",
        type=_std,
        default=_pet("redirects", "0"),
        metavar="STD",
        help="streams to write to log files only: 0 none, 1 stdout, 2 stderr, "
        "3 both, or per rank like 0:3,1:1",
    )
    _option(
        parser,
        "-t",
        "--tee",
        type=_std,
        default=_pet("tee", "0"),
        metavar="STD",
        help="streams to write to log files and show with a [name rank]: prefix",
    )
    _option(
        parser,
        "--local-ranks-filter",
        type=_ranks_filter,
        default=_pet("local_ranks_filter", ""),
        metavar="RANKS",
        help="show only these local ranks' output on the console, like 0,1 (log files "
        "still get every rank's)",
    )
    _option(
        parser,
        "--max-restarts",
        type=_non_negative,
        default=_pet("max_restarts", "0"),
        metavar="K",
        help="restart the whole group up to K times after a failure",
    )
    _option(
        parser,
        "--name",
        default=None,
        help="prefix name for tee'd lines (default: program; under torch's agent, --role)",
    )
    parser.add_argument(
        "--no-stacks",
        dest="stacks",
        action="store_false",
        help="show no rank's stacks: the ranks do not arm the dump (with --exec, a .py "
        "program runs as plain `python -u program`), and SIGUSR1 keeps its default "
        "action (it ends the run)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="show every rank's stacks once no rank has written anything (output, or "
        "to any file or socket) and none has exited for SECONDS",
    )
    parser.add_argument(
        "--hang-action",
        choices=("dump", "kill"),
        default="dump",
        help="after a --hang-timeout dump: keep running (dump, the default: again after "
        "another quiet SECONDS) or stop every rank and exit 124 (kill)",
    )
    _program_options(parser)
    _rendezvous_options(parser)
    _agent_options(parser)
    parser.add_argument("program", help="the program (a .py file runs under this Python)")
    parser.add_argument("program_args", nargs=argparse.REMAINDER, help="its arguments")


def _program_options(parser: argparse.ArgumentParser) -> None:
    """How each rank runs the program."""
    group = parser.add_argument_group("the program")
    _option(
        group,
        "-m",
        "--module",
        action="store_true",
        default=_pet_flag("module"),
        help="the program is a Python module, run as with python -m",
    )
    _option(
        group,
        "--no-python",
        action="store_true",
        default=_pet_flag("no_python"),
        help="exec the program as a binary, even if it ends in .py",
    )
    _option(
        group,
        "--run-path",
        action="store_true",
        default=_pet_flag("run_path"),
        help="the program is a Python script, whatever its name (torchrun's runpy mode; "
        "fastspawn runs .py programs so by default)",
    )
    _option(
        group,
        "--exec",
        action="store_true",
        help="start each Python rank as a fresh interpreter (python -u program), not "
        "from the zygote",
    )
    _option(
        group,
        "--preload",
        type=_modules,
        default=(),
        metavar="MODULES",
        help="modules the zygote imports once, before the Python ranks start, like "
        "torch,numpy (FASTSPAWN_PRELOAD in the environment adds to them)",
    )


def _rendezvous_options(parser: argparse.ArgumentParser) -> None:
    """torchrun's rendezvous options: any but the static backend runs
    torch's elastic agent (_torchrun)."""
    group = parser.add_argument_group(
        "rendezvous (torchrun's): a backend other than static runs torch's elastic agent "
        "(needs torch)"
    )
    for flag, default, text in (
        ("rdzv-backend", "static", "static (default), c10d, etcd, etcd-v2"),
        ("rdzv-endpoint", "", "HOST[:PORT] of the rendezvous store (static: node 0's)"),
        ("rdzv-id", "none", "the job's id: the nodes with the same id form one job"),
        ("rdzv-conf", "", "KEY=VALUE,... for the backend (join_timeout, last_call_timeout, "
         "is_host, ...)"),
    ):  # fmt: skip
        dest = flag.replace("-", "_")
        _option(group, f"--{flag}", default=_pet(dest, default), help=text)
    _option(
        group,
        "--standalone",
        action="store_true",
        default=_pet_flag("standalone"),
        help="one node, a c10d rendezvous on a free port (what torchrun does on one node "
        "by default; fastspawn's default there is the static one, which needs no torch)",
    )
    _option(
        group,
        "--local-addr",
        default=_pet("local_addr", None),
        help="this node's address for the rendezvous (default: its FQDN)",
    )
    _option(
        group,
        "--monitor-interval",
        type=float,
        default=_pet("monitor_interval", "0.1"),
        metavar="SECONDS",
        help="how often torch's agent checks the workers (the static rendezvous waits on "
        "events instead)",
    )
    _option(
        group,
        "--role",
        default=_pet("role", "default"),
        help="the workers' role (ROLE_NAME; the prefix of tee'd lines under the agent)",
    )


def _agent_options(parser: argparse.ArgumentParser) -> None:
    """torchrun's options that only its elastic agent reads: passed on to it."""
    group = parser.add_argument_group("torch's elastic agent (dynamic rendezvous only)")
    _option(
        group,
        "--start-method",
        choices=registry.names(),
        default=None,
        help="accepted for torchrun command lines; fastspawn starts Python ranks from its zygote",
    )
    for flag, text in (
        ("event-log-handler", "torch's event log handler"),
        ("logs-specs", "a torchrun.logs_specs entry point name"),
        ("signals-to-handle", "the signals that stop the workers (default: "
         "SIGTERM,SIGINT,SIGHUP,SIGQUIT)"),
    ):  # fmt: skip
        dest = flag.replace("-", "_")
        _option(group, f"--{flag}", default=_pet(dest, None), help=text)
    _option(
        group,
        "--shutdown-timeout",
        type=_non_negative,
        default=_pet("shutdown_timeout", None),
        metavar="SECONDS",
        help="SIGTERM to SIGKILL when the agent stops the workers (default: 30)",
    )
    _option(
        group,
        "--virtual-local-rank",
        action="store_true",
        default=_pet_flag("virtual_local_rank"),
        help="LOCAL_RANK 0 in every worker, each seeing its own GPU as device 0",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastspawn", description="fastspawn: orphan-safe, fast process launching."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="start N ranks of a program",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_parser(run)
    run.set_defaults(command_parser=run)  # for the usage errors found after parsing
    stacks = commands.add_parser(
        "stacks",
        help="print the Python stacks of every rank of a running job",
        description="Print the Python stacks of every thread of every rank below process "
        "PID: a `fastspawn run`, or a program that started ranks with fastspawn (only "
        "this user's processes).  The ranks keep running.",
    )
    stacks.add_argument("pid", type=_positive, metavar="PID")
    stacks.add_argument(
        "--timeout",
        type=_seconds,
        default=_stacks.DEMAND_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the ranks' answers (default {_stacks.DEMAND_TIMEOUT:g})",
    )
    bench = commands.add_parser(
        "bench", help="measure launch overhead on this machine", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def topology(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[int, int, str, int]:
    """(nnodes, node_rank, master_addr, master_port) of the static
    rendezvous: from flags (--master-addr and --master-port, else a static
    --rdzv-endpoint HOST:PORT, as torchrun reads it), then Slurm.

    Raises:
        UsageError: the node rank is not below the number of nodes.
    """
    nnodes = None if args.nnodes is None else parse_nnodes(str(args.nnodes))[0]
    node_rank = args.node_rank
    addr, port = _static_endpoint(args)
    # Only a job step (srun) describes this node's place: in a plain salloc or
    # sbatch shell SLURM_NNODES counts the whole allocation and SLURM_NODEID
    # is that of the batch host, whichever nodes the user then starts us on.
    # SLURM_STEPID is the older spelling, still set beside the newer one.
    slurm = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    if nnodes is None:
        nnodes = int(environ.get("SLURM_NNODES", "1")) if slurm else 1
    if node_rank is None:
        node_rank = int(environ.get("SLURM_NODEID", "0")) if slurm else 0
    if addr is None:
        addr = "127.0.0.1"
        # SLURM_NNODES and SLURM_NODEID are the step's, so node 0 is the
        # first host of the step, which need not be the job's first host.
        nodelist = (
            environ.get("SLURM_STEP_NODELIST")
            or environ.get("SLURM_NODELIST")
            or environ.get("SLURM_JOB_NODELIST")
        )
        if slurm and nodelist and nnodes > 1:
            try:
                addr = first_slurm_host(nodelist)
            except ValueError as exc:
                raise SystemExit(f"fastspawn run: {exc}; give --master-addr") from None
    if node_rank >= nnodes:
        rank_from = "SLURM_NODEID" if args.node_rank is None else "--node-rank"
        nodes_from = "SLURM_NNODES" if args.nnodes is None and slurm else "--nnodes"
        raise UsageError(f"{rank_from} {node_rank} is not below {nodes_from} {nnodes}")
    if port is None:
        port = free_port() if nnodes == 1 else 29500
    return nnodes, node_rank, addr, port


def _static_endpoint(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """Node 0's address and port as given: --master-addr and --master-port,
    each else from a static --rdzv-endpoint HOST[:PORT]."""
    addr, port = args.master_addr, args.master_port
    endpoint = getattr(args, "rdzv_endpoint", "") or ""
    if endpoint:
        host, _, port_text = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
        if addr is None:
            addr = host.strip("[]")  # an IPv6 address in brackets
        if port is None and port_text:
            try:
                port = _port(port_text)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise UsageError(f"--rdzv-endpoint {endpoint}: {exc}") from None
    return addr, port


def rank_envs(
    nprocs: int, nnodes: int, node_rank: int, addr: str, port: int, restart: int, max_restarts: int
) -> dict[int, dict[str, str]]:
    envs = {}
    for local in range(nprocs):
        envs[local] = {
            "RANK": str(node_rank * nprocs + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(nnodes * nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(nnodes),
            "ROLE_RANK": str(node_rank * nprocs + local),
            "ROLE_WORLD_SIZE": str(nnodes * nprocs),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        }
    return envs


def describe(failure: elastic.ProcessFailure, global_rank: int) -> str:
    """The one-line summary of a failed rank."""
    if failure.exitcode < 0:
        cause = f"was killed by signal {failure.signal_name()}"
    else:
        cause = f"failed with exit code {failure.exitcode}"
    detail = ""
    if failure.error_file != "<N/A>":
        # The message may be a whole traceback: keep the summary one line,
        # and say where the rest is.
        lines = [line.strip() for line in failure.message.splitlines() if line.strip()]
        if lines:
            detail = f": {lines[0]}"
            if len(lines) > 1:
                detail += f" (+{len(lines) - 1} more lines in {failure.error_file})"
    return (
        f"fastspawn run: rank {global_rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{cause}{detail}"
    )


def exit_code(code: int) -> int:
    return 128 - code if code < 0 else (code or 1)


def _missing_ancestor(path: str) -> str | None:
    """The topmost directory of ``path`` (itself included) that does not exist
    yet: what ``os.makedirs(path)`` will create.  None when it exists."""
    path = os.path.abspath(path)
    top = None
    while not os.path.lexists(path):
        top = path
        path = os.path.dirname(path)
    return top


def _remove_created(attempt_dir: str | None, log_dir: str, created: str | None) -> None:
    """After a start failed: remove the attempt directory (if any), then each
    directory this run created from ``log_dir`` up to ``created`` (rmdir: only
    while empty, so nothing of anyone else's goes)."""
    if attempt_dir is not None:
        shutil.rmtree(attempt_dir, ignore_errors=True)
    if created is None:
        return
    path = os.path.abspath(log_dir)
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == created:
            return
        path = os.path.dirname(path)


# The signals fastspawn.elastic turns into SignalException.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _StopSignals:
    """The launcher's handlers for the stop signals while one attempt's ranks
    run: the first raises SignalException, as elastic's own handlers do; a
    later one, while ``stop`` closes the ranks, SIGKILLs every rank at once.

    elastic's handlers raise at every signal, and one raised in the middle of
    close() abandons it (and leaves the ranks to end by themselves).  The
    handler notes the first signal before it raises, so a second one that
    comes at once (a tty's Ctrl-C beside a wrapper's SIGTERM) already finds
    it: there is no moment in which it would raise again.
    """

    def __init__(self, ctx: elastic.PContext) -> None:
        self.ctx = ctx
        self.first: signal.Signals | None = None
        self.closed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # elastic installed none either
        for sig in _STOP_SIGNALS:
            signal.signal(sig, functools.partial(self._handle, signal.getsignal(sig)))

    def _handle(self, previous: object, signum: int, frame: object) -> None:
        if self.first is None:
            self.first = signal.Signals(signum)
            if callable(previous):
                # elastic's handler: it raises, and marks the ranks to be
                # closed at exit should the exception escape us.
                previous(signum, frame)
            raise elastic.SignalException(
                f"Process {os.getpid()} got signal: {self.first}", sigval=self.first
            )
        if self.closed:
            return  # the launcher is on its way out with 128+the first signal
        try:
            # No print() in a handler: it may interrupt a print of the main code.
            os.write(2, b"fastspawn run: got another signal, killing every rank\n")
        except OSError:
            pass
        # Each rank, and a binary rank's whole session (its children); a
        # Python rank's children die with it (the zygote kills orphans).
        self.ctx._kill_now()

    def stop(self, sigval: signal.Signals) -> None:
        """Stop every rank after the launcher got ``sigval``: that signal to
        each rank's process group, SIGKILL after 10 s, or at once on a
        second signal.  The handlers stay, doing nothing, after the close."""
        if self.first is None:  # raised by elastic's handler, before install()
            self.first = sigval
            self.install()
        print(f"fastspawn run: got {sigval.name}, stopping every rank", file=sys.stderr)
        try:
            self.ctx.close(sigval, timeout=10)
        finally:
            self.closed = True


class LogDirError(Exception):
    """The logs have no usable directory; the message says why and what to
    give instead.  ``fastspawn run`` prints it and exits 2."""


def _log_dir_error(log_dir: str, exc: OSError) -> LogDirError:
    """Say why ``log_dir`` cannot hold the logs, as the non-empty case does."""
    why = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError):  # makedirs(exist_ok=True) on a file
        why = "it is not a directory"
    return LogDirError(
        f"fastspawn run: cannot use --log-dir {log_dir}: {why}; give a new or empty "
        "directory that you can write to"
    )


@dataclasses.dataclass(frozen=True)
class Program:
    """What each rank runs: a binary and its arguments, or a Python script
    or module run as ``__main__`` in a zygote worker (``_script.PythonMain``)
    with the modules to preload there."""

    name: str  # as given: named when it cannot start
    entrypoint: str | _script.PythonMain
    argv: tuple[str, ...]
    preload: tuple[str, ...] = ()
    script: str | None = None  # the Python script, which must exist


def program_of(args: argparse.Namespace) -> Program:
    """The program the options describe, as torchrun reads them: ``-m`` a
    module, ``--no-python`` a binary; a ``.py`` file (or any file with
    ``--run-path``) a Python script; anything else a binary.  Python runs in
    the zygote's workers unless ``--exec`` asks for a fresh interpreter.

    Raises:
        UsageError: options that contradict each other.
    """
    program = args.program
    # argparse has removed the first "--" (the one before the program, when
    # given); a later one is the program's own and stays.
    rest = tuple(args.program_args)
    if args.module and args.no_python:
        raise UsageError("--module and --no-python contradict each other")
    python = args.module or args.run_path or (program.endswith(".py") and not args.no_python)
    if args.preload and (not python or args.exec):
        raise UsageError(
            "--preload is for Python ranks started from the zygote (a .py "
            "program or -m module, without --exec or --no-python)"
        )
    if not python:
        return Program(program, program, rest)
    script = None if args.module else program
    if args.exec:
        flags = ("-u", "-m") if args.module else ("-u",)
        return Program(program, sys.executable, (*flags, program, *rest), script=script)
    main = _script.PythonMain(program, args.module)
    return Program(program, main, rest, tuple(args.preload), script)


def check_program(program: Program) -> None:
    """Before anything starts: a script that is not there is named once,
    here, rather than by every rank.

    Raises:
        FileNotFoundError: the script is missing.
    """
    if program.script is not None and not os.path.exists(program.script):
        raise FileNotFoundError(errno.ENOENT, "no such Python script", program.script)


def resolve_nprocs(value: int | str) -> int:
    """--nproc-per-node as a number: torchrun's words resolved (cpu: the
    CPUs this process may use; gpu, xpu, auto: as torchrun counts them,
    which needs torch, but auto without torch counts CPUs).

    Raises:
        UsageError: torch is needed and missing, or the count is above the
            limits on processes or open files.
    """
    if isinstance(value, int):
        return value
    if value == "cpu" or (value == "auto" and importlib.util.find_spec("torch") is None):
        count = len(os.sched_getaffinity(0))
    else:
        try:
            from torch.distributed.run import determine_local_world_size
        except ImportError:
            raise UsageError(
                f"--nproc-per-node {value} counts devices through torch, "
                "which is not installed: give a number"
            ) from None
        count = int(determine_local_world_size(value))
    try:
        _limits.check_nprocs(count, f"a launch of {count} ranks", "lower --nproc-per-node")
    except ValueError as exc:
        raise UsageError(f"--nproc-per-node {value}: {exc}") from None
    return count


def wants_agent(args: argparse.Namespace) -> bool:
    """Whether the options ask for a dynamic rendezvous: torch's agent."""
    low, high = parse_nnodes(str(args.nnodes)) if args.nnodes is not None else (1, 1)
    return bool(args.standalone) or args.rdzv_backend != "static" or low != high


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One ``fastspawn run`` with the static rendezvous, read from its
    arguments: what each rank runs, where this node sits among the others,
    and how often to restart."""

    nprocs: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    program: str  # as given: named when it cannot start
    entrypoint: str | _script.PythonMain
    argv: tuple[str, ...]
    name: str  # prefix of tee'd lines
    redirects: elastic.Std | dict[int, elastic.Std]
    tee: elastic.Std | dict[int, elastic.Std]
    max_restarts: int
    stacks: bool = True  # --no-stacks: False
    hang_timeout: float | None = None
    hang_action: str = "dump"
    python_program: bool = False  # a .py program, run by this Python
    local_ranks_filter: frozenset[int] | None = None
    role: str = "default"
    run_id: str = "none"

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank

    def rank_argv(self, local_rank: int) -> tuple[str, ...]:
        """A rank's arguments: a .py script exec'd by this Python (--exec)
        goes through the bootstrap that arms its stack dump, unless
        --no-stacks."""
        if self.stacks and self.python_program:
            rank = self.global_rank(local_rank)
            return tuple(_stacks.python_rank_argv(rank, self.program, self.argv[2:]))
        return self.argv


def run_config(
    args: argparse.Namespace, environ: Mapping[str, str], program: Program | None = None
) -> RunConfig:
    """The run the parsed ``args`` describe, its topology completed from
    ``environ`` (Slurm); ``program``: ``program_of(args)``, if known."""
    nnodes, node_rank, addr, port = topology(args, environ)
    program = program or program_of(args)
    return RunConfig(
        nprocs=resolve_nprocs(args.nproc_per_node),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        program=program.name,
        entrypoint=program.entrypoint,
        argv=program.argv,
        name=args.name or os.path.basename(program.name),
        redirects=args.redirects,
        tee=args.tee,
        max_restarts=args.max_restarts,
        stacks=args.stacks,
        hang_timeout=args.hang_timeout,
        hang_action=args.hang_action,
        python_program=program.entrypoint == sys.executable and program.script is not None,
        local_ranks_filter=args.local_ranks_filter,
        role=args.role,
        run_id=args.rdzv_id,
    )


@dataclasses.dataclass(frozen=True)
class LogDir:
    """The directory that holds one ``attempt_N/`` per attempt."""

    # Absolute: the ranks get error file paths under it, and a rank that
    # changes its working directory (Hydra does) must still find them.
    path: str
    created: str | None  # the directory this run made to hold path (itself included)
    given: str | None  # --log-dir as given; None for a temporary directory

    def make_attempt_dir(self, attempt: int) -> str:
        """Make ``attempt_N/``.  Raises LogDirError, after removing what this
        run created, when it cannot."""
        attempt_dir = os.path.join(self.path, f"attempt_{attempt}")
        try:
            os.mkdir(attempt_dir, 0o700)
        except OSError as exc:  # an empty directory we may not write to
            _remove_created(None, self.path, self.created)
            raise _log_dir_error(self.given or self.path, exc) from exc
        return attempt_dir


def open_log_dir(args: argparse.Namespace) -> LogDir | None:
    """The directory for the logs, before anything starts: --log-dir, made
    or checked empty, else a new temporary directory when --redirects or
    --tee names a stream; None when neither gives the logs a directory.

    Raises:
        LogDirError: the directory cannot be made, or is not empty.
    """
    log_dir = args.log_dir
    wants_files = args.redirects != elastic.Std.NONE or args.tee != elastic.Std.NONE
    created: str | None  # the directory this run made to hold log_dir (itself included)
    if log_dir is None and wants_files:
        log_dir = created = _make_temporary_log_dir()
    elif log_dir is not None:
        created = _make_empty_log_dir(log_dir)
    else:
        return None
    return LogDir(os.path.abspath(log_dir), created, args.log_dir)


def _make_temporary_log_dir() -> str:
    try:
        return tempfile.mkdtemp(prefix="fastspawn-run-")
    except OSError as exc:
        raise LogDirError(
            f"fastspawn run: cannot make a log directory in {tempfile.gettempdir()}: "
            f"{exc.strerror or exc}; give --log-dir or set TMPDIR"
        ) from exc


def _make_empty_log_dir(log_dir: str) -> str | None:
    """Make ``log_dir`` (its parents too) unless it exists, and check that it
    is empty; the topmost directory made, None when it existed."""
    created = _missing_ancestor(log_dir)
    try:
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        not_empty = bool(os.listdir(log_dir))
    except OSError as exc:
        if created is not None:
            _remove_created(None, log_dir, created)
        raise _log_dir_error(log_dir, exc) from exc
    if not_empty:
        raise LogDirError(
            f"fastspawn run: --log-dir {log_dir} is not empty; give a new or empty "
            "directory (each run writes attempt_N/ there)"
        )
    return created


def run(args: argparse.Namespace) -> int:
    try:
        program = program_of(args)
        if wants_agent(args):
            return run_with_agent(args, program)
        config = run_config(args, os.environ, program)
        try:
            check_program(program)
        except OSError as exc:
            return _cannot_start(program.name, exc)
        log_dir = open_log_dir(args)
        if program.preload:
            _zygote_client.preload(program.preload)  # imported there while we go on
        return run_attempts(config, log_dir)
    except LogDirError as exc:
        print(exc, file=sys.stderr)
        return 2


def _dynamic_rendezvous(args: argparse.Namespace) -> str:
    """The option that asked for torch's agent, as given."""
    if args.standalone:
        return "--standalone"
    if args.rdzv_backend != "static":
        return f"--rdzv-backend {args.rdzv_backend}"
    return f"--nnodes {args.nnodes}"


@contextlib.contextmanager
def _agent_log_dir(args: argparse.Namespace) -> Iterator[str]:
    """Where torch's agent puts its logs: --log-dir; else a new private
    temporary directory, named on stderr and kept when --redirects or --tee
    asks for log files, removed at the end otherwise (it holds the ranks'
    error files only, read by then; torchrun would leave one behind per
    run)."""
    if args.log_dir is not None:
        yield args.log_dir
        return
    temporary = _make_temporary_log_dir()
    keep = args.redirects != elastic.Std.NONE or args.tee != elastic.Std.NONE
    if keep:
        print(f"fastspawn run: logs in {temporary}", file=sys.stderr)
    try:
        yield temporary
    finally:
        if not keep:
            shutil.rmtree(temporary, ignore_errors=True)


def run_with_agent(args: argparse.Namespace, program: Program) -> int:
    """A dynamic rendezvous: torch's elastic agent runs the job, fastspawn
    starts its workers (_torchrun); the launcher's exit status."""
    from fastspawn import _torchrun

    nprocs = resolve_nprocs(args.nproc_per_node)
    try:
        check_program(program)
        with _agent_log_dir(args) as log_dir:
            outcome = _torchrun.run(
                args, nprocs, program.entrypoint, program.argv, program.preload, log_dir
            )
    except _torchrun.TorchMissing as exc:
        print(
            f"fastspawn run: {_dynamic_rendezvous(args)} runs torch's elastic agent, which "
            f"needs torch ({exc}); install torch, or use the static rendezvous, which does "
            "not: --nnodes N --node-rank R --master-addr HOST --master-port PORT",
            file=sys.stderr,
        )
        return 2
    except _torchrun.AgentError as exc:
        print(f"fastspawn run: the rendezvous failed: {exc}", file=sys.stderr)
        return 1
    except elastic.SignalException as exc:
        print(f"fastspawn run: got {exc.sigval.name}, stopped every rank", file=sys.stderr)
        return 128 + int(exc.sigval)
    except OSError as exc:
        return _cannot_start(program.name, exc)
    if outcome is None:
        return 0
    global_rank, failure = outcome
    print(describe(failure, global_rank), file=sys.stderr)
    return exit_code(failure.exitcode)


def run_attempts(config: RunConfig, log_dir: LogDir | None) -> int:
    """Run the group, again after a failure up to --max-restarts times; the
    launcher's exit status."""
    requests = _cli_stacks.DumpRequests() if config.stacks else None
    # The ranks' stacks at a failure: shown by run_attempt, with global ranks.
    drop = _cli_stacks.DropStacksRecord()
    context_log = logging.getLogger("fastspawn._context")
    context_log.addFilter(drop)
    if requests is not None:
        requests.install()
    try:
        return _run_attempts(config, log_dir, requests)
    finally:
        if requests is not None:
            requests.uninstall()
        context_log.removeFilter(drop)


def _run_attempts(
    config: RunConfig, log_dir: LogDir | None, requests: _cli_stacks.DumpRequests | None
) -> int:
    try:
        for attempt in range(config.max_restarts + 1):
            outcome = run_attempt(config, log_dir, attempt, requests)
            if isinstance(outcome, int):
                return outcome
            if attempt < config.max_restarts:
                print(
                    f"fastspawn run: restarting the group ({attempt + 1}/{config.max_restarts})",
                    file=sys.stderr,
                )
                continue
            return exit_code(outcome.exitcode)
    except elastic.SignalException as exc:
        # Between two attempts (the last one's ranks closed, the next not
        # started yet): nothing runs, so just stop.
        print(f"fastspawn run: got {exc.sigval.name}, stopping", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 1  # pragma: no cover - the loop always returns


def run_attempt(
    config: RunConfig,
    log_dir: LogDir | None,
    attempt: int,
    requests: _cli_stacks.DumpRequests | None = None,
) -> int | elastic.ProcessFailure:
    """Start the group once and wait for it: the launcher's exit status when
    this ends the run (every rank succeeded, a stop signal, a program that
    cannot start, a hang stopped by --hang-action kill), else the first
    failed rank's failure, the other ranks stopped.

    Raises:
        LogDirError: the attempt's log directory cannot be made.
    """
    attempt_dir = os.devnull if log_dir is None else log_dir.make_attempt_dir(attempt)
    envs = rank_envs(
        config.nprocs,
        config.nnodes,
        config.node_rank,
        config.master_addr,
        config.master_port,
        attempt,
        config.max_restarts,
    )
    for env in envs.values():
        env.update(_agent_envs(config))
    ctx = None
    stop_signals = None
    try:
        ctx = _start_ranks(config, envs, attempt_dir, log_dir)
        stop_signals = _StopSignals(ctx)
        stop_signals.install()
        if attempt == 0 and log_dir is not None and log_dir.given is None:
            print(f"fastspawn run: logs in {log_dir.path}", file=sys.stderr)
        labels = _cli_stacks.RankLabels(config.global_rank, ctx.pids(), attempt_dir)
        watch = _cli_stacks.RunWatch(ctx, labels, requests, config.hang_timeout, config.hang_action)
        result = watch.wait()
        if result is None:  # a hang, with --hang-action kill
            print("fastspawn run: stopping every rank (--hang-action kill)", file=sys.stderr)
            ctx.close(timeout=10)
            return _cli_stacks.HANG_EXIT
        if not result.is_failed():
            return 0
        # The first failure comes first; the ranks stopped after it follow.
        local, failure = next(iter(result.failures.items()))
        print(describe(failure, config.global_rank(local)), file=sys.stderr)
        if result.rank_stacks:
            labels.show(
                f"where the other ranks were when rank {config.global_rank(local)} failed",
                result.rank_stacks,
            )
        # Inside the try: a signal while the other ranks stop is handled
        # as one while they run.
        ctx.close(timeout=10)
        return failure
    except elastic.SignalException as exc:
        if ctx is None:  # start_processes stopped what it had started
            print(f"fastspawn run: got {exc.sigval.name}, stopping", file=sys.stderr)
        else:
            (stop_signals or _StopSignals(ctx)).stop(exc.sigval)
        return 128 + int(exc.sigval)
    except OSError as exc:
        return _cannot_start(config.program, exc)


def _agent_envs(config: RunConfig) -> dict[str, str]:
    """What torchrun's agent gives every worker beside the rank variables:
    the role, the run id, and OMP_NUM_THREADS=1 for several ranks on a node
    unless it is set."""
    envs = {"ROLE_NAME": config.role, "TORCHELASTIC_RUN_ID": config.run_id}
    if config.nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        envs["OMP_NUM_THREADS"] = "1"
    return envs


class _AttemptLogs(elastic.LogsSpecs):
    """fastspawn run's layout for one attempt: ``{attempt_dir}/{rank}/``
    holding ``stdout.log``, ``stderr.log`` (for the streams redirected or
    tee'd) and ``error.json``; ``os.devnull``: no files.  Ranks left out by
    --local-ranks-filter show nothing on the console (their log files still
    get everything)."""

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> elastic.LogsDest:
        dest = elastic.LogsDest()
        attempt_dir = self.root_log_dir
        redirects = elastic.to_map(self._redirects, len(envs))
        tees = elastic.to_map(self._tee, len(envs))
        for rank in envs:
            shown = self._local_ranks_filter is None or rank in self._local_ranks_filter
            if attempt_dir == os.devnull:
                dest.stdouts[rank] = dest.stderrs[rank] = "" if shown else os.devnull
                dest.error_files[rank] = os.devnull
                continue
            rank_dir = os.path.join(attempt_dir, str(rank))
            os.mkdir(rank_dir, 0o700)
            elastic._rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs, shown)
        return dest


def _start_ranks(
    config: RunConfig,
    envs: dict[int, dict[str, str]],
    attempt_dir: str,
    log_dir: LogDir | None,
) -> elastic.PContext:
    shown = config.local_ranks_filter
    logs = _AttemptLogs(
        attempt_dir, config.redirects, config.tee, None if shown is None else set(shown)
    )
    try:
        return elastic.start_processes(
            name=config.name,
            entrypoint=config.entrypoint,
            args={rank: config.rank_argv(rank) for rank in range(config.nprocs)},
            envs=envs,
            logs_specs=logs,
            log_line_prefixes={
                rank: f"[{config.name}{config.global_rank(rank)}]:" for rank in range(config.nprocs)
            },
            stacks=config.stacks,
        )
    except BaseException:
        # Nothing ran: keep no empty log directories.  start_processes
        # removed the rank directories it made.
        if log_dir is not None:
            # rmdir stops at the first directory not empty: one that
            # holds an earlier attempt's logs, or the user's files.
            _remove_created(attempt_dir, log_dir.path, log_dir.created)
        raise


def _cannot_start(program: str, exc: OSError) -> int:
    """Say why ``program`` could not start; the launcher's exit status, as a
    shell's: 127 when it is not found, else 126."""
    # OSError's str() ends with the filename: name it once, up front.
    what = program if exc.filename is None else exc.filename
    why = exc.strerror if exc.filename is not None and exc.strerror else str(exc)
    print(f"fastspawn run: cannot start {what!r}: {why}", file=sys.stderr)
    return 127 if isinstance(exc, FileNotFoundError) else 126


def _package_version() -> str:
    from fastspawn import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser().print_help()  # no command: what there is to run
        return 2
    if argv and argv[0] == "bench":
        from fastspawn._bench import main as bench_main

        return int(bench_main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "stacks":
        return _cli_stacks.stacks_command(args.pid, args.timeout)
    try:
        return run(args)
    except UsageError as exc:
        parser: argparse.ArgumentParser = args.command_parser
        parser.error(str(exc))  # exits 2


def console_main() -> None:
    # `fastspawn bench | head` ends quietly, as Unix tools do.  `fastspawn
    # run` keeps Python's handling: its tee stops writing to a console that
    # went away (| head -1) and the run goes on, with every line in the logs,
    # rather than the launcher dying and taking the ranks with it.
    if sys.argv[1:2] == ["bench"]:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
