"""What ``fastspawn run`` is to run, and where: the program, the ranks per
node, the nodes and this node's place among them, each rank's environment."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import os
import socket
import sys
from collections.abc import Mapping

from fastspawn import elastic
from fastspawn._cli.options import UsageError, _port, parse_nnodes
from fastspawn._os import limits as _limits
from fastspawn._worker import script_rank
from fastspawn._worker import stacks as worker_stacks


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


def topology(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[int, int, str, int]:
    """(nnodes, node_rank, master_addr, master_port) of the static
    rendezvous: from flags (--master-addr and --master-port, else a static
    --rdzv-endpoint HOST:PORT, as torchrun reads it), then Slurm.

    Raises:
        UsageError: the node rank is not below the number of nodes, or
            SLURM_NNODES / SLURM_NODEID is not a number (or below 1 / 0).
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
        nnodes = _slurm_count(environ, "SLURM_NNODES", 1) if slurm else 1
    if node_rank is None:
        node_rank = _slurm_count(environ, "SLURM_NODEID", 0) if slurm else 0
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


def _slurm_count(environ: Mapping[str, str], name: str, least: int) -> int:
    """Slurm's ``name`` (SLURM_NNODES, SLURM_NODEID) as a number, at least
    ``least`` (``least`` itself when unset).

    Raises:
        UsageError: it is set to anything else, naming it and its value.
    """
    text = environ.get(name)
    if text is None:
        return least
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise UsageError(
            f"{name}={text!r} in the environment is not a whole number of at least "
            f"{least}; fix or unset it, or give "
            f"{'--nnodes' if name == 'SLURM_NNODES' else '--node-rank'}"
        )
    return value


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


@dataclasses.dataclass(frozen=True)
class Program:
    """What each rank runs: a binary and its arguments, or a Python script
    or module run as ``__main__`` in a zygote worker (``script_rank.PythonMain``)
    with the modules to preload there."""

    name: str  # as given: named when it cannot start
    entrypoint: str | script_rank.PythonMain
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
    main = script_rank.PythonMain(program, args.module)
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
        UsageError: torch is needed and missing, the devices counted are
            not there, or the count is above the limits on processes or open
            files.
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
        try:
            count = int(determine_local_world_size(value))
        except ValueError as exc:  # torch's "Cuda is not available."
            raise UsageError(
                f"--nproc-per-node {value}: {str(exc).rstrip('.')}: give a number, or cpu or auto"
            ) from None
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
class NumaMode:
    """--numa-binding, as the ``numa_options`` fastspawn.elastic takes
    (torch's ``NumaOptions``, whose fields these are, without torch)."""

    affinity_mode: str
    should_fall_back_if_binding_fails: bool = False


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
    entrypoint: str | script_rank.PythonMain
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
    # --duplicate-stdout-filters, --duplicate-stderr-filters
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()
    numa: NumaMode | None = None  # --numa-binding

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nprocs + local_rank

    def rank_argv(self, local_rank: int) -> tuple[str, ...]:
        """A rank's arguments: a .py script exec'd by this Python (--exec)
        goes through the bootstrap that arms its stack dump, unless
        --no-stacks."""
        if self.stacks and self.python_program:
            rank = self.global_rank(local_rank)
            return tuple(worker_stacks.python_rank_argv(rank, self.program, self.argv[2:]))
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
        stdout_filters=tuple(args.duplicate_stdout_filters or ()),
        stderr_filters=tuple(args.duplicate_stderr_filters or ()),
        numa=None if args.numa_binding is None else NumaMode(args.numa_binding),
    )
