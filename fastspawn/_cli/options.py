"""``fastspawn run``'s options: torchrun's, each read from the command line
or its ``PET_*`` variable, checked as it is parsed."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fastspawn import elastic
from fastspawn._launch.methods import registry
from fastspawn._os import limits as _limits
from fastspawn._os import numa as _numa

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
imported already (as `python -u`; docs/elastic.md, "What each rank runs",
says what differs from a fresh interpreter); --exec starts a fresh
interpreter per rank instead.
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


def _filters(text: str) -> list[str]:
    """torchrun's filter list: comma-separated, a doubled comma standing for
    a comma inside a filter (``"a,,b,c"``: ``a,b`` and ``c``)."""
    return [part.replace("\0", ",") for part in text.replace(",,", "\0").split(",")]


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
    for stream in ("stdout", "stderr"):
        _option(
            parser,
            f"--duplicate-{stream}-filters",
            type=_filters,
            default=_pet(f"duplicate_{stream}_filters", None),
            metavar="LIST",
            help=f"copy each tee'd {stream} line that contains any of these comma-separated "
            f"strings (',,' for a comma) to {{attempt}}/filtered_{stream}.log, with its prefix",
        )
    _option(
        parser,
        "--numa-binding",
        choices=_numa.MODES,
        default=None,
        help="bind each rank to the CPUs near its GPU (local rank i: GPU i), as torch's "
        "NUMA binding modes do",
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
    torch's elastic agent (fastspawn._torch.torchrun)."""
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
