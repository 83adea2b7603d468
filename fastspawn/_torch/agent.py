"""torch's elastic agent starting its workers through ``fastspawn.elastic``.

torch's ``LocalElasticAgent`` starts each worker group with
``torch.distributed.elastic.multiprocessing.start_processes``, a name it
imports into its own module.  :func:`start_processes` here takes the same
arguments and starts the group with ``fastspawn.elastic`` instead (binaries
by the zygote's C launcher, functions as zygote workers), so that rendezvous,
restarts and scale-down stay torch's while every worker, and every child of a
worker, dies with the agent however it dies.  :func:`route` rebinds that name
in both modules (``fastspawn run`` with a dynamic rendezvous, and
``fastspawn.patch_torch()`` for ``torchrun`` itself); :func:`unroute` puts
torch's back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType, ModuleType
from typing import Any

from fastspawn._launch.methods import registry
from fastspawn.elastic import pcontext
from fastspawn.elastic import start as elastic_start
from fastspawn.elastic.api import RunProcsResult
from fastspawn.elastic.pcontext import PContext

log = logging.getLogger(__name__)

# Where torch's agent finds start_processes: the package (read by code that
# imports it later) and the agent's module (which imported it already).
_MODULES = (
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)
_NAME = "start_processes"
_DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

_originals: dict[str, Any] = {}

# What fastspawn run gives each worker group, for its SIGUSR1 dumps and its
# hang watch: called with the group's context and environments once it
# has started, it returns a look, called at each of the agent's looks at
# the workers (every --monitor-interval), which may raise to stop the job.
GroupWatch = Callable[[PContext, Mapping[int, Mapping[str, str]]], Callable[[], None]]


class GroupOptions:
    """How this process's agent starts its worker groups: ``stacks``, as
    ``fastspawn.elastic.start_processes`` takes it; ``watch``, a GroupWatch
    or None.  ``fastspawn run`` sets them (see ``route``)."""

    def __init__(self, stacks: bool = True, watch: GroupWatch | None = None) -> None:
        self.stacks = stacks
        self.watch = watch


_options = GroupOptions()


def _modules() -> list[ModuleType]:
    import importlib

    return [importlib.import_module(name) for name in _MODULES]


def route(options: GroupOptions | None = None) -> None:
    """Make torch's elastic agent start its workers with :func:`start_processes`.

    Args:
        options: how to start and watch each worker group (default: stacks
            armed, no watch).

    Raises:
        ImportError: torch (or its ``torch.distributed``) is not installed.
    """
    global _options
    _options = options or GroupOptions()
    for module in _modules():
        current = getattr(module, _NAME)
        if current is not start_processes:
            _originals[module.__name__] = current
            setattr(module, _NAME, start_processes)


def unroute() -> None:
    """Give torch's agent its own ``start_processes`` back."""
    import sys

    global _options
    for name, original in _originals.items():
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, _NAME, original)
    _originals.clear()
    _options = GroupOptions()


def routed() -> bool:
    return bool(_originals)


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: Any,
    log_line_prefixes: Mapping[int, str] | None = None,
    start_method: str = registry.DEFAULT,
    numa_options: Any = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> PContext | WatchedGroup:
    """torch's ``start_processes`` (2.3 and later), served by
    ``fastspawn.elastic``.

    ``start_method`` is not used: function workers always start from the
    zygote (spawn-safe: a clean interpreter, arguments pickled, as torch's
    default "spawn"), binaries with its C launcher.  ``numa_options`` and
    the duplicate filters are not applied (a warning says so).  The
    termination signals torch's agent handles (``TORCHELASTIC_SIGNALS_TO_HANDLE``)
    raise torch's ``SignalException``, so the agent stops the workers as it
    would its own; a second signal while it does kills them at once.
    What ``route`` was given (GroupOptions) says whether the workers arm
    their stack dump and, with a watch, returns the group's context
    wrapped (WatchedGroup) so that each of the agent's looks runs it.
    """
    if numa_options is not None or duplicate_stdout_filters or duplicate_stderr_filters:
        log.warning(
            "fastspawn starts these workers: numa_options and duplicate_*_filters are not applied"
        )
    context = elastic_start.start_processes(
        name,
        entrypoint,
        args,
        envs,
        logs_specs=logs_specs,
        log_line_prefixes=log_line_prefixes,
        stacks=_options.stacks,
    )
    _AgentSignals(context).install()
    if _options.watch is None:
        return context
    try:
        look = _options.watch(context, envs)
    except BaseException:
        context.close()
        raise
    return WatchedGroup(context, look)


class WatchedGroup:
    """A worker group's context whose ``wait`` first runs fastspawn run's
    look (GroupWatch): torch's agent calls ``wait(0)`` at each of its looks
    at the workers, from its main loop, where the static path's own wait
    loop serves SIGUSR1 and watches for a hang.  Everything else is the
    group's context's, which owns the group."""

    def __init__(self, context: PContext, look: Callable[[], None]) -> None:
        self.context = context
        self.look = look

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)

    def __repr__(self) -> str:
        return f"<WatchedGroup of {self.context!r}>"

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        self.look()
        return self.context.wait(timeout, period)


class _AgentSignals:
    """The agent's signal handlers while one worker group runs: the first
    signal raises torch's ``SignalException`` (the agent then closes the
    group with it); a later one, while it does, SIGKILLs every worker.

    torch's own handler raises at every signal, and one raised in the
    middle of the close abandons it; this one raises once.
    """

    def __init__(self, context: PContext) -> None:
        self.context = context
        self.first: signal.Signals | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # elastic.start_processes warned already
        names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _DEFAULT_SIGNALS)
        for sig_name in names.split(","):
            sig = getattr(signal, sig_name.strip(), None)
            if isinstance(sig, signal.Signals):
                try:
                    signal.signal(sig, self.handle)
                except (OSError, ValueError):
                    log.warning("could not handle %s", sig.name)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.first is None:
            self.first = signal.Signals(signum)
            from torch.distributed.elastic.multiprocessing.api import SignalException

            # Also noted for fastspawn.elastic: should the exception escape
            # the agent, interpreter exit closes the group with this signal.
            pcontext.note_signal(self.first)
            raise SignalException(
                f"Process {os.getpid()} got signal: {self.first}", sigval=self.first
            )
        try:
            # No print() in a handler: it may interrupt a print of the main code.
            os.write(2, b"fastspawn: got another signal, killing every worker\n")
        except OSError:
            pass
        self.context._kill_now()
