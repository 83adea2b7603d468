"""``import fastspawn as mp``: the names of ``multiprocessing`` (and of
``torch.multiprocessing``), backed by fastspawn's default context, so that
``mp.Process``, ``mp.Pool``, ``mp.Queue`` ... are multiprocessing's own
objects whose processes fastspawn starts; and what else a program reaches
through ``multiprocessing``'s module: its logging levels and its submodules
(``mp.connection.wait``, ``mp.pool.ThreadPool``, ``mp.shared_memory``)."""

from __future__ import annotations

import functools
import importlib
import multiprocessing

# Not "context": that name is multiprocessing.context's here (submodules()).
from fastspawn._mp import context as _contexts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# multiprocessing's public names, each an attribute of a context (Process:
# fastspawn's, which follows fastspawn's default).
MULTIPROCESSING_NAMES = tuple(sorted(multiprocessing.__all__))
# torch.multiprocessing's, beyond multiprocessing's: torch's own functions.
TORCH_NAMES = ("get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy")
# multiprocessing's module attributes beyond __all__: its two logging levels.
LEVELS = ("SUBDEBUG", "SUBWARNING")


@functools.cache
def submodules() -> frozenset[str]:
    """multiprocessing's submodules, imported on first use as ``import
    multiprocessing.pool`` would (all but its Windows one; "spawn" among
    them, but fastspawn's own table, read first, keeps that name for its
    function, as torch.multiprocessing does).  Listed from the package once:
    which there are differs between versions."""
    import pkgutil

    found = pkgutil.iter_modules(multiprocessing.__path__)
    return frozenset(m.name for m in found if not m.name.endswith("_win32"))


def provides(name: str) -> bool:
    """Whether ``name`` is one of those this module gives fastspawn."""
    return (
        name in MULTIPROCESSING_NAMES
        or name in TORCH_NAMES
        or name in LEVELS
        or name in submodules()
    )


def torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def __getattr__(name: str) -> Any:
    if name in TORCH_NAMES:
        try:
            import torch.multiprocessing
        except ImportError as exc:
            raise AttributeError(
                f"fastspawn.{name} is torch.multiprocessing's, and torch cannot be imported "
                f"here ({exc}); install torch to use it"
            ) from None
        return getattr(torch.multiprocessing, name)
    if name in MULTIPROCESSING_NAMES:
        return getattr(_contexts.DEFAULT, name)
    if name in LEVELS:
        return getattr(multiprocessing, name)
    if name in submodules():
        return importlib.import_module(f"multiprocessing.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
