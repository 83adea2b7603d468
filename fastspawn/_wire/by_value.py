"""By-value pickling of what a ``__main__`` the workers cannot import defines.

A notebook cell, the interactive prompt, ``python -c`` and a script read
from stdin define functions in a ``__main__`` that has no file: a worker
(spawned, or forked from the zygote) has no such module to import, so a
function pickled by reference, as ``pickle`` does, names an attribute its
``__main__`` lacks.  Here those functions, lambdas and classes (and so
instances of them) travel by value, with what they refer to (the globals
they use, their closures and defaults), through cloudpickle; everything
importable keeps travelling by reference.  A function redefined in a
re-run cell is sent anew at the next launch: nothing is cached in the
zygote.

This module is imported only when ``__main__`` is of that kind
(pickling.main_is_importable): cloudpickle then loads in the caller, and
in the zygote or a spawned worker when it unpickles such a payload; an
ordinary launch never imports it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from typing import Any

import cloudpickle


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler, with multiprocessing's reducers (connections,
    sockets: the fds they carry) as ForkingPickler has them.

    cloudpickle sends by value the functions and classes of ``__main__``,
    and those that cannot be found under their name in their module: a
    lambda, a nested function, and a wrapper a notebook puts in place of
    a builtin (IPython's ``open``, which every cell function that opens a
    file refers to, names ``io.open`` but is not it).  The rest by name."""

    def __init__(self, file: Any, protocol: int) -> None:
        # cloudpickle's reducers (code objects, cells, modules, ...: what a
        # function's state holds), then copyreg's, then multiprocessing's.
        # Set before the C pickler's __init__, which reads it then: after,
        # this would only shadow cloudpickle's class attribute, unread.
        self.dispatch_table = {
            **cloudpickle.Pickler.dispatch_table,
            **reduction.ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        }
        super().__init__(file, protocol)


def _by_value(obj: Any) -> bool:
    """Whether a function or class travels by value (see Pickler): it is
    of ``__main__``, or its module has something else under its name."""
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        return True
    found: Any = sys.modules.get(module or "")
    for part in getattr(obj, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is not obj


# ------------------------------------------------ naming what cannot travel


def _global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _function_parts(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    name = f"{fn.__qualname__}()"
    for key in sorted(_global_names(fn.__code__)):
        if key in fn.__globals__:
            yield f"global {key!r} of {name}", fn.__globals__[key]
    for key, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"variable {key!r} that {name} closes over", cell.cell_contents
        except ValueError:
            pass  # an empty cell: nothing to pickle
    for default in fn.__defaults__ or ():
        yield f"a default argument of {name}", default
    for key, default in (fn.__kwdefaults__ or {}).items():
        yield f"the default of {key!r} of {name}", default


def _class_parts(cls: type) -> Iterator[tuple[str, Any]]:
    for key, value in vars(cls).items():
        if key not in ("__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"):
            yield f"attribute {key!r} of class {cls.__qualname__}", value


def _container_parts(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"item {key!r}", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, value in enumerate(obj):
            yield f"item {index}", value


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """What pickling ``obj`` by value pickles in turn, each with where it
    sits: the globals, closure and defaults of a function sent by value,
    the attributes of a class sent by value and of an instance of one, a
    container's items."""
    if isinstance(obj, types.FunctionType):
        if _by_value(obj):
            yield from _function_parts(obj)
    elif isinstance(obj, type):
        if _by_value(obj):
            yield from _class_parts(obj)
    elif _by_value(type(obj)) and isinstance(getattr(obj, "__dict__", None), dict):
        for key, value in vars(obj).items():
            yield f"attribute {key!r} of a {type(obj).__qualname__}", value
    else:
        yield from _container_parts(obj)


def _culprit(
    obj: Any, fails: Callable[[Any], Exception | None], seen: set[int], depth: int = 0
) -> list[tuple[str, Any, Exception]]:
    """The path, from ``obj`` (which fails to pickle) down to the innermost
    part that fails on its own: ``[(where, part, exception), ...]``; empty
    when no part of ``obj`` fails alone (``obj`` itself is the culprit)."""
    if depth > 8:
        return []
    for where, part in _parts(obj):
        if id(part) in seen:
            continue
        seen.add(id(part))
        exc = fails(part)
        if exc is not None:
            return [(where, part, exc), *_culprit(part, fails, seen, depth + 1)]
    return []


def culprit(
    obj: Any, fails: Callable[[Any], Exception | None]
) -> tuple[str, Any, Exception] | None:
    """What, inside ``obj`` (which fails to pickle), cannot be pickled on
    its own: ``(where it sits, that part, its exception)``, ``where`` a path
    such as ``"global 'q' of work() -> item 0"``; None when no part of
    ``obj`` fails alone (``obj`` itself is the culprit)."""
    path = _culprit(obj, fails, {id(obj)})
    if not path:
        return None
    _where, part, exc = path[-1]
    return " -> ".join(step for step, _part, _exc in path), part, exc
