"""fastspawn: orphan-safe, low-latency process launching for Linux.

A drop-in for ``torch.multiprocessing``'s ``spawn`` / ``start_processes`` /
``ProcessContext``, built on pidfds, PR_SET_PDEATHSIG with its race check and
one epoll waiter per job; and for ``multiprocessing`` itself: every name of
``multiprocessing`` (and ``torch.multiprocessing``) is here, backed by
fastspawn's contexts (``import fastspawn as mp``), whose names
("fastspawn", "fastspawn-spawn", ...) multiprocessing knows once fastspawn
is imported.

The public names load on first use (PEP 562): a spawned worker imports
``fastspawn._worker`` on every start, and must not pay for the launcher side.
"""

from __future__ import annotations

import multiprocessing as _multiprocessing

# Registers fastspawn's contexts with multiprocessing by name: one small
# module over multiprocessing's context module, which every worker loads anyway.
from fastspawn._mp import context as _mp_context  # noqa: F401

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
    "prefork": "fastspawn._launch.methods.helpers",
    "preload": "fastspawn._launch.methods.helpers",
    "stop_zygote": "fastspawn._launch.methods.helpers",
    "Process": "fastspawn._mp.context",
    "ProcessHandle": "fastspawn._launch.process",
    "patch_torch": "fastspawn._torch.patch",
    "unpatch_torch": "fastspawn._torch.patch",
}

# fastspawn's own names, then multiprocessing's (from fastspawn's default
# context); torch.multiprocessing's sharing-strategy functions are names too,
# where torch is installed, but not in __all__ (not there without torch).
__all__ = [
    "ENV_VAR_PARALLEL_START",
    "Process",
    "ProcessHandle",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "patch_torch",
    "prefork",
    "preload",
    "spawn",
    "start_processes",
    "stop_zygote",
    "unpatch_torch",
]
__all__ += [name for name in _multiprocessing.__all__ if name not in __all__]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        from fastspawn._mp import face

        if not face.provides(name):
            raise AttributeError(f"module 'fastspawn' has no attribute {name!r}")
        module = face.__name__
    # Imported with signals held where this is its first use: a Ctrl-C
    # then comes as KeyboardInterrupt once the import is whole, not from
    # inside it (where Python 3.10 turned one that landed in a class's
    # __set_name__, platform's, into a RuntimeError, and the module was
    # left unimported).
    from fastspawn._os.held import import_held

    value = getattr(import_held(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    from fastspawn._mp import face

    torch = list(face.TORCH_NAMES) if face.torch_installed() else []
    return sorted(
        {*globals(), *_WHERE, *face.MULTIPROCESSING_NAMES, *face.LEVELS, *face.submodules(), *torch}
    )


if TYPE_CHECKING:
    from fastspawn._launch.api import ENV_VAR_PARALLEL_START, spawn, start_processes
    from fastspawn._launch.context import ProcessContext
    from fastspawn._launch.errors import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
    )
    from fastspawn._launch.methods.helpers import prefork, preload, stop_zygote
    from fastspawn._launch.process import Process as ProcessHandle
    from fastspawn._mp.context import Process
    from fastspawn._torch.patch import patch_torch, unpatch_torch
    from fastspawn._torch.spawn_context import SpawnContext
