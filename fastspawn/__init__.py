"""fastspawn: orphan-safe, low-latency process launching for Linux.

A drop-in for ``torch.multiprocessing``'s ``spawn`` / ``start_processes`` /
``ProcessContext``, built on pidfds, PR_SET_PDEATHSIG with its race check and
one epoll waiter per job.

The public names load on first use (PEP 562): a spawned worker imports
``fastspawn._worker`` on every start, and must not pay for the launcher side.
"""

from __future__ import annotations

import importlib

# Not typing.TYPE_CHECKING: importing typing costs a spawned worker a few ms,
# and mypy reads any TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_WHERE = {
    "ENV_VAR_PARALLEL_START": "fastspawn._context",
    "ProcessContext": "fastspawn._context",
    "SpawnContext": "fastspawn._spawn_context",
    "spawn": "fastspawn._context",
    "start_processes": "fastspawn._context",
    "ProcessException": "fastspawn._errors",
    "ProcessExitedException": "fastspawn._errors",
    "ProcessRaisedException": "fastspawn._errors",
    "preload": "fastspawn._zygote_client",
    "stop_zygote": "fastspawn._zygote_client",
    "Process": "fastspawn._process",
    "patch_torch": "fastspawn._torch",
    "unpatch_torch": "fastspawn._torch",
}
_RENAMED = {"stop_zygote": "stop_server"}

__all__ = [
    "ENV_VAR_PARALLEL_START",
    "Process",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "patch_torch",
    "preload",
    "spawn",
    "start_processes",
    "stop_zygote",
    "unpatch_torch",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fastspawn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:
    from fastspawn._context import (
        ENV_VAR_PARALLEL_START,
        ProcessContext,
        spawn,
        start_processes,
    )
    from fastspawn._errors import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
    )
    from fastspawn._process import Process
    from fastspawn._spawn_context import SpawnContext
    from fastspawn._torch import patch_torch, unpatch_torch
    from fastspawn._zygote_client import preload
    from fastspawn._zygote_client import stop_server as stop_zygote
