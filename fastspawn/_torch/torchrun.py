"""``fastspawn run`` with a dynamic rendezvous (``--rdzv-backend c10d``,
``--standalone``, ``--nnodes MIN:MAX``): torch's own elastic agent,
configured from the command line exactly as ``torchrun`` configures it
(torch's ``config_from_args``), with fastspawn starting the workers (see
``agent``).  Rendezvous, restarts, scale-down and the workers' environment
are torch's; what each rank runs is fastspawn's (a Python script from the
zygote, by default).

Nothing here prints: ``fastspawn._cli`` says what happened.
"""

from __future__ import annotations

import argparse
import os
import signal
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from fastspawn._launch.methods import helpers
from fastspawn._torch import agent as _agent
from fastspawn.elastic import api as elastic_api
from fastspawn.elastic import pcontext
from fastspawn.elastic.api import ProcessFailure, Std

# The options fastspawn run shares with torchrun, by their argparse dest,
# passed on to torch's configuration as given (None: torch's default).
_SHARED = (
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "no_python",
    "run_path",
    "log_dir",
    "local_addr",
    "node_rank",
    "master_addr",
    "master_port",
    "event_log_handler",
    "logs_specs",
    "signals_to_handle",
    "shutdown_timeout",
    "virtual_local_rank",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "numa_binding",
)


SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class TorchMissing(Exception):
    """torch (with torch.distributed) is not installed."""


class AgentError(Exception):
    """torch's rendezvous failed (timed out, closed, could not connect)."""


def std_text(value: Std | dict[int, Std]) -> str:
    """A ``Std`` value as ``Std.from_str`` reads it: ``"3"``, ``"0:1,1:2"``."""
    if isinstance(value, dict):
        return ",".join(f"{rank}:{int(std)}" for rank, std in sorted(value.items()))
    return str(int(value))


def torch_args(args: argparse.Namespace, nprocs: int, torchrun: Any) -> argparse.Namespace:
    """torchrun's parsed arguments for what ``args`` asks: every option torch
    reads, at torch's defaults (its ``PET_*`` variables included), overlaid
    with what was given, and torchrun's own adjustments before it
    configures (``--standalone``, the default master port)."""
    namespace: argparse.Namespace = torchrun.get_args_parser().parse_args(["program"])
    for dest in _SHARED:
        value = getattr(args, dest, None)
        if value is not None:
            setattr(namespace, dest, value)
    namespace.nnodes = str(args.nnodes or "1")
    namespace.nproc_per_node = str(nprocs)
    namespace.redirects = std_text(args.redirects)
    namespace.tee = std_text(args.tee)
    ranks = args.local_ranks_filter
    namespace.local_ranks_filter = ",".join(str(r) for r in sorted(ranks)) if ranks else ""
    if namespace.standalone:  # as torch.distributed.run.run does
        namespace.rdzv_backend = "c10d"
        namespace.rdzv_endpoint = "localhost:0"
        namespace.rdzv_id = str(uuid.uuid4())
    if namespace.master_port is None:
        namespace.master_port = 29500
    return namespace


def restarts_possible(namespace: argparse.Namespace) -> bool:
    """Whether torch's agent may start a second round of workers: after a
    failure (--max-restarts), or when nodes join an elastic job (MIN < MAX)."""
    low, _, high = str(namespace.nnodes).partition(":")
    return int(namespace.max_restarts) > 0 or (bool(high) and int(high) > int(low))


def run(
    args: argparse.Namespace,
    nprocs: int,
    entrypoint: Callable[..., Any] | str,
    argv: Sequence[str],
    preload: Sequence[str],
    log_dir: str,
    options: _agent.GroupOptions | None = None,
) -> tuple[int, ProcessFailure] | None:
    """Run torch's elastic agent until the job ends: None when it
    succeeded, else ``(global rank, failure)`` of the first rank to fail.
    ``log_dir``: where torch's logs specs lay out the logs; ``options``:
    how each worker group starts and is watched (agent.GroupOptions).
    An exception the watch raises ends the job, every worker stopped by
    the agent, and comes out of here.

    Raises:
        TorchMissing: torch.distributed cannot be imported.
        AgentError: the rendezvous failed.
        fastspawn.elastic.SignalException: a termination signal (Ctrl-C included)
            stopped the job; every worker is stopped.
        FileNotFoundError, PermissionError: the binary cannot be run.
    """
    if preload:
        # First: the zygote imports these while torch loads here.
        helpers.preload(preload)
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError
        from torch.distributed.launcher.api import elastic_launch
    except ImportError as exc:
        raise TorchMissing(str(exc)) from exc
    if isinstance(entrypoint, str):
        # Before the rendezvous: a binary that is not there fails this
        # node alone, at once, not every node after the rendezvous.
        pcontext.resolve_binary(entrypoint, os.environ)
    namespace = torch_args(args, nprocs, torchrun)
    if restarts_possible(namespace):
        # torch 2.13's agent shares its rendezvous TCPStore with the workers
        # and keeps it from round to round, and init_process_group then
        # prefixes nothing per attempt: after a restart, gloo reads the last
        # attempt's peer addresses and fails to connect or hangs (torchrun
        # itself does; see benchmarks/README.md).  torch's own opt-out gives
        # each round a store of its own (hosted by rank 0, as without an
        # agent).  Without restarts, torch's default stays.
        os.environ.setdefault(SHARE_STORE_ENV, "1")
    namespace.log_dir = log_dir
    config, _cmd, _cmd_args = torchrun.config_from_args(namespace)
    _agent.route(options)
    try:
        elastic_launch(config, entrypoint)(*argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        # fastspawn.elastic's: the agent reports what our PContext returned.
        return int(rank), cast(ProcessFailure, failure)
    except SignalException as exc:  # torch's, as fastspawn.elastic's
        raise elastic_api.SignalException(str(exc), sigval=exc.sigval) from None
    except KeyboardInterrupt:
        # Ctrl-C before the workers started (torch handles signals from then on).
        raise elastic_api.SignalException("interrupted", sigval=signal.SIGINT) from None
    except RendezvousError as exc:
        raise AgentError(f"{type(exc).__name__}: {exc}") from exc
    return None
