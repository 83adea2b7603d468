"""``import fastspawn as mp``: the names of ``multiprocessing`` (and of
``torch.multiprocessing``), backed by fastspawn's default context, so that
``mp.Process``, ``mp.Pool``, ``mp.Queue`` ... are multiprocessing's own
objects whose processes fastspawn starts."""

from __future__ import annotations

import multiprocessing

from fastspawn._mp import context

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# multiprocessing's public names, each an attribute of a context (Process:
# fastspawn's, which follows fastspawn's default).
MULTIPROCESSING_NAMES = tuple(sorted(multiprocessing.__all__))
# torch.multiprocessing's, beyond multiprocessing's: torch's own functions.
TORCH_NAMES = ("get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy")


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
        return getattr(context.DEFAULT, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
