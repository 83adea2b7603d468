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
    "ENV_VAR_PARALLEL_START": "fastspawn._launch.api",
    "ProcessContext": "fastspawn._launch.context",
    "SpawnContext": "fastspawn._torch.spawn_context",
    "spawn": "fastspawn._launch.api",
    "start_processes": "fastspawn._launch.api",
    "ProcessException": "fastspawn._launch.errors",
    "ProcessExitedException": "fastspawn._launch.errors",
    "ProcessRaisedException": "fastspawn._launch.errors",
    "preload": "fastspawn._launch.methods.helpers",
    "stop_zygote": "fastspawn._launch.methods.helpers",
    "Process": "fastspawn._launch.process",
    "patch_torch": "fastspawn._torch.patch",
    "unpatch_torch": "fastspawn._torch.patch",
}

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
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:
    from fastspawn._launch.api import ENV_VAR_PARALLEL_START, spawn, start_processes
    from fastspawn._launch.context import ProcessContext
    from fastspawn._launch.errors import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
    )
    from fastspawn._launch.methods.helpers import preload, stop_zygote
    from fastspawn._launch.process import Process
    from fastspawn._torch.patch import patch_torch, unpatch_torch
    from fastspawn._torch.spawn_context import SpawnContext
