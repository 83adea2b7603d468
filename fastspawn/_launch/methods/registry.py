"""The one place start-method names map to methods.

A new start method is a module with a StartMethod instance and one
``register`` line here (or a call to ``register`` from the module that
defines it, for a method that lives outside fastspawn).
"""

from __future__ import annotations

from typing import Literal

from fastspawn._launch.methods import fork, forkserver, spawn, zygote
from fastspawn._launch.methods import names as builtin_names
from fastspawn._launch.methods.base import StartMethod

# The built-in methods' names, for type checkers: a misspelt start_method is
# an error in the user's editor.  (At run time any registered name works.)
StartMethodName = Literal["zygote", "spawn", "fork", "forkserver"]

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


def multiprocessing_default() -> str:
    """The name of the start method multiprocessing uses when given none:
    the one set with ``set_start_method``, else the platform's default (the
    first of ``get_all_start_methods()``).  Read without fixing it, which
    ``multiprocessing.get_start_method()`` would do."""
    import multiprocessing

    return (
        multiprocessing.get_start_method(allow_none=True)
        or (multiprocessing.get_all_start_methods()[0])
    )


def get(name: object) -> StartMethod:
    """The method called ``name``.

    ``None`` means what it means to torch, which hands it to
    ``multiprocessing.get_context``: the method multiprocessing would use
    by default (see :func:`multiprocessing_default`), so that objects made
    from ``multiprocessing.get_context(None)`` (a fork context's queue, say)
    work in the workers; fastspawn's ``DEFAULT`` where it has no method of
    that name.

    Raises:
        ValueError: no method is called ``name``; the message names the
            valid ones.
    """
    if name is None:
        name = multiprocessing_default()
        # fastspawn's own contexts, chosen with multiprocessing's
        # set_start_method: "fastspawn" (the zygote), "fastspawn-spawn", ...
        name = builtin_names.method_of_context(name)
        if name not in _methods:
            name = DEFAULT
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

DEFAULT: StartMethodName = "zygote"
assert DEFAULT == builtin_names.DEFAULT and set(builtin_names.BUILTIN) <= set(_methods)
