"""fastspawn: orphan-safe, low-latency process launching for Linux.

A drop-in for ``torch.multiprocessing``'s ``spawn`` / ``start_processes`` /
``ProcessContext``, built on pidfds, PR_SET_PDEATHSIG with its race check and
one epoll waiter per job.
"""

from fastspawn._context import (
    ENV_VAR_PARALLEL_START,
    ProcessContext,
    SpawnContext,
    spawn,
    start_processes,
)
from fastspawn._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
)
from fastspawn._launch import preload
from fastspawn._launch import stop_server as stop_zygote
from fastspawn._process import Process
from fastspawn._torch import patch_torch, unpatch_torch

__version__ = "0.1.0"

__all__ = [
    "ENV_VAR_PARALLEL_START",
    "Process",
    "patch_torch",
    "unpatch_torch",
    "preload",
    "stop_zygote",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]
