"""The one place start-method names map to methods.

A new start method is a module with a StartMethod instance and one
``register`` line here (or a call to ``register`` from the module that
defines it, for a method that lives outside fastspawn).
"""

from __future__ import annotations

from fastspawn._methods import fork, forkserver, spawn, zygote
from fastspawn._methods.base import StartMethod

_methods: dict[str, StartMethod] = {}


def register(method: StartMethod) -> StartMethod:
    """Make ``method`` available as ``start_method=method.name``."""
    if not method.name or not isinstance(method.name, str):
        raise ValueError(f"a start method needs a name (str), got {method.name!r}")
    if method.name in _methods:
        raise ValueError(f"start_method {method.name!r} is registered already")
    _methods[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered with ``register`` (tests, plug-ins)."""
    _methods.pop(name, None)


def methods() -> list[StartMethod]:
    """The registered methods, in registration order."""
    return list(_methods.values())


def names() -> list[str]:
    """The registered names, in registration order."""
    return list(_methods)


def get(name: object) -> StartMethod:
    """The method called ``name``; ValueError naming the valid ones if none is."""
    method = _methods.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(
            f"unknown start_method {name!r}; choose one of "
            + ", ".join(repr(known) for known in _methods)
        )
    return method


for _method in (zygote.METHOD, spawn.METHOD, fork.METHOD, forkserver.METHOD):
    register(_method)
del _method

DEFAULT = zygote.METHOD.name
