"""One line to switch existing torch code: ``fastspawn.patch_torch()``."""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastspawn._launch import api, context, errors
from fastspawn._launch.methods import helpers
from fastspawn._torch import agent as _agent
from fastspawn._torch import spawn_context

# What patch_torch() rebinds in torch.multiprocessing, by the names torch
# gives them (each of ours bears the same name).
_NAMES: dict[str, Any] = {
    obj.__name__: obj
    for obj in (
        api.spawn,
        api.start_processes,
        context.ProcessContext,
        spawn_context.SpawnContext,
        errors.ProcessException,
        errors.ProcessRaisedException,
        errors.ProcessExitedException,
    )
}

_originals: dict[tuple[str, str], Any] = {}
_ABSENT = object()  # a name the module did not have (older torch): deleted again
# torch logs its terminate/kill warnings under its module's name; patched,
# fastspawn's go there too, so logging set up for torch's keeps working.
_TORCH_LOGGER = "torch.multiprocessing.spawn"
_own_logger = context.log


def _modules() -> list[Any]:
    import torch.multiprocessing  # noqa: F401  (loads the spawn module too)

    # torch.multiprocessing.spawn is the function; the module is only in
    # sys.modules under that name.
    return [sys.modules["torch.multiprocessing"], sys.modules["torch.multiprocessing.spawn"]]


def patch_torch(preload: bool = True) -> None:
    """Make ``torch.multiprocessing.spawn`` / ``start_processes`` (and the
    ``ProcessContext`` and exception names) those of fastspawn, logging its
    warnings under torch's logger name (``torch.multiprocessing.spawn``);
    and make torch's elastic agent (``torchrun``, ``elastic_launch``) start
    its workers through ``fastspawn.elastic``, so that they, and their
    children, die with the agent however it dies.

    Call it before importing code that copies these names at import time
    (``from torch.multiprocessing.spawn import ProcessExitedException``).
    For ``torchrun``, call it from a site hook (see docs/elastic.md).

    Args:
        preload: also start the zygote now and import torch in it, so
            workers do not pay for that import.

    Raises:
        ImportError: torch is not installed.
    """
    for module in _modules():
        for name, ours in _NAMES.items():
            key = (module.__name__, name)
            if key not in _originals:
                _originals[key] = getattr(module, name, _ABSENT)
            setattr(module, name, ours)
    context.log = logging.getLogger(_TORCH_LOGGER)
    try:
        _agent.route()
    except ImportError:
        pass  # a torch built without torch.distributed: no agent to route
    if preload:
        helpers.preload(["torch"])


def unpatch_torch() -> None:
    """Restore what :func:`patch_torch` replaced."""
    for (module_name, name), original in _originals.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if original is _ABSENT:
            if hasattr(module, name):
                delattr(module, name)
        else:
            setattr(module, name, original)
    _originals.clear()
    context.log = _own_logger
    _agent.unroute()
