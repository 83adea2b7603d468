"""Pickling for spawn-like launches, fds included.

multiprocessing objects that carry file descriptors (Connection, Queue,
SimpleQueue, ...) pickle themselves only while a "spawning popen" is set:
they hand it their fds and pickle an index instead.  ``FdCollector`` plays
that part, so the same objects travel to fastspawn workers as to
multiprocessing's own; the launcher then passes the collected fds to the
children (inherited across exec, or as SCM_RIGHTS to the fork server), and
``InheritedFd.detach`` finds them there.

What a ``__main__`` the workers cannot import defines (a notebook cell, the
interactive prompt, ``python -c``, a script read from stdin) travels by
value: functions, lambdas, classes, and what they refer to there (see
by_value, which brings in cloudpickle for that case only).  Everything
importable travels by reference, as multiprocessing sends it.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections.abc import Sequence
from multiprocessing import context as mp_context
from multiprocessing import reduction
from types import FunctionType

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

# The fds the current process received from its launcher, by index.  Set in
# the child before it unpickles its payload.
inherited_fds: list[int] = []


def keep_tracker_at_fork(keep: bool) -> None:
    """Whether a fork from this thread keeps multiprocessing's resource
    tracker pipe open in the child, as multiprocessing's own fork does: the
    ranks of a launch share the caller's tracker (their semaphores and
    shared memory are the caller's to clean up, not a tracker of their own
    that ends with them).  Since CPython gh-146313 (in 3.14.10), an at-fork
    handler closes the pipe in the child of a bare os.fork() unless the
    forking thread says to keep it; without the module imported there is
    no handler."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    intent = getattr(tracker, "_fork_intent", None)
    if intent is not None:
        intent.preserve_fd = keep


class InheritedFd:
    """Stands for a collected fd inside a pickle; ``detach`` gives a private dup."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return os.dup(inherited_fds[self.index])


class FdCollector:
    """A stand-in "spawning popen" that records the fds pickled objects share."""

    DupFd = InheritedFd

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1


def main_is_importable() -> bool:
    """Whether ``__main__`` is a module the workers can import (as
    ``__mp_main__``, when they prepare as multiprocessing's spawn children
    do; see also fastspawn._worker.spawned.preparation_data), so that what it defines is
    found there by name.  Not for a notebook or the interactive prompt (no
    ``__file__``), ``python -c`` and stdin (no file), nor a script deleted
    since.  (``python -m pkg`` counts as importable, as multiprocessing
    takes it.)  A few attribute reads and one stat: every launch asks."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return False
    from multiprocessing import process

    if not os.path.isabs(path) and process.ORIGINAL_DIR is not None:  # type: ignore[attr-defined]
        path = os.path.join(process.ORIGINAL_DIR, path)  # type: ignore[attr-defined]
    stem = os.path.splitext(os.path.basename(path))[0]
    return stem != "ipython" and os.path.isfile(path)


def dump(objects: Sequence[Any], collector: FdCollector, file: IO[bytes]) -> None:
    """Pickle ``objects`` one after the other into ``file``; by value what
    a ``__main__`` the workers cannot import defines (main_is_importable)."""
    pickler: Callable[[IO[bytes], int], pickle.Pickler]
    if main_is_importable():
        pickler = reduction.ForkingPickler
    else:
        from fastspawn._wire import by_value  # cloudpickle: only here

        pickler = by_value.Pickler
    previous = mp_context.get_spawning_popen()
    # multiprocessing only duck-types this object (duplicate_for_child, DupFd).
    mp_context.set_spawning_popen(collector)  # type: ignore[arg-type]
    try:
        for obj in objects:
            pickler(file, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        mp_context.set_spawning_popen(previous)


def dumps(objects: Sequence[Any], collector: FdCollector) -> bytes:
    """``dump`` into one buffer."""
    buf = io.BytesIO()
    dump(objects, collector, buf)
    return buf.getvalue()


def _pickles(obj: Any) -> Exception | None:
    """None if ``obj`` pickles for a launch, else the exception it raised."""
    try:
        dumps([obj], FdCollector())
    except Exception as exc:  # pickling raises many types
        return exc
    return None


def describe_unpicklable(fn: Any, args: Sequence[Any], start_method: str) -> str | None:
    """Name the first of ``fn`` and ``args`` that cannot be pickled, and
    what to do, or None.  Where it travels by value, the message names the
    object inside it that failed (a global the function uses, say)."""
    candidates = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
    for label, obj in candidates:
        exc = _pickles(obj)
        if exc is None:
            continue
        what = (
            f"{label} ({type(obj).__name__} {obj!r:.80}) cannot be pickled for "
            f"start_method={start_method!r}"
        )
        if not main_is_importable():
            from fastspawn._wire import by_value

            found = by_value.culprit(obj, _pickles)
            if found is not None:
                where, part, inner = found
                return (
                    f"{what}: it refers to {where}, a {type(part).__name__} ({part!r:.60}), "
                    f"which cannot be pickled ({type(inner).__name__}: {inner}). "
                    + _what_to_do(inner, by_value=True)
                )
        return f"{what}: {type(exc).__name__}: {str(exc).rstrip('.')}. {_what_to_do(exc)}"
    return None


def _what_to_do(exc: BaseException, by_value: bool = False) -> str:
    """The advice for an object that cannot be pickled: one that works when
    followed (fastspawn.spawn() takes only spawn-safe methods, so "use
    fork" is advice for start_processes).  ``by_value``: the object is
    something a function or class of a ``__main__`` without a file refers
    to, which travels with it."""
    fork_only = "start them with fastspawn.start_processes(..., start_method='fork')"
    if "fork context" in str(exc):
        # A Queue, Lock, Event, Value... made by multiprocessing's default
        # context on Linux (fork, before Python 3.14): its semaphore cannot
        # reach a worker that was not forked from this process.
        return (
            "It was made for the fork start method (by multiprocessing's default "
            "context on Linux): make it, and what shares it, from "
            "multiprocessing.get_context('spawn') (torch: torch.multiprocessing."
            f"get_context('spawn')), which every start method can take; or {fork_only}."
        )
    if by_value:
        # Not "in an importable module" alone: imported into __main__ with
        # "from module import name", the object still travels by value.
        return (
            "Functions and classes defined in this __main__ (a notebook, the interactive "
            "prompt, python -c, stdin) travel to the workers by value, with what they "
            "refer to: create such an object inside the function, define the function in "
            "an importable module (it then travels by name, and finds the object there), "
            f"pass what the object is made from in args, or {fork_only}, which pickles "
            "nothing."
        )
    return (
        f"Define functions at module top level and pass picklable arguments, or {fork_only}, "
        "which pickles nothing."
    )


def main_attribute(qualname: str) -> Any:
    """The object called ``qualname`` in this process's ``__main__``: how a
    worker's return value refers to a class or function of the caller's
    ``__main__`` that came to the worker by value (see dumps_result)."""
    obj: Any = sys.modules["__main__"]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _MainByName(pickle.Pickler):
    """A pickler that writes classes and functions of ``__main__`` as
    main_attribute(qualname): found in the caller's ``__main__`` when it
    unpickles, though this process's ``__main__`` has no such name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, FunctionType)):
            qualname = getattr(obj, "__qualname__", "")
            if getattr(obj, "__module__", None) == "__main__" and "<locals>" not in qualname:
                return main_attribute, (qualname,)
        return NotImplemented


def dumps_result(value: Any) -> bytes:
    """A worker's return value, pickled for the caller.  A class or function
    of the caller's ``__main__`` that reached this worker by value (an
    instance of a notebook's class, say) is not in this process's
    ``__main__``: it is then written as a reference to the caller's.  Plain
    pickling first, so a worker whose value pickles as it is pays nothing."""
    try:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        first = exc
    buf = io.BytesIO()
    try:
        _MainByName(buf, pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:
        raise first from None
    return buf.getvalue()
