"""Pickling for spawn-like launches, fds included.

multiprocessing objects that carry file descriptors (Connection, Queue,
SimpleQueue, ...) pickle themselves only while a "spawning popen" is set:
they hand it their fds and pickle an index instead.  ``FdCollector`` plays
that part, so the same objects travel to fastspawn workers as to
multiprocessing's own; the launcher then passes the collected fds to the
children (inherited across exec, or as SCM_RIGHTS to the fork server), and
``InheritedFd.detach`` finds them there.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from multiprocessing import context as mp_context
from multiprocessing import reduction

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The fds the current process received from its launcher, by index.  Set in
# the child before it unpickles its payload.
inherited_fds: list[int] = []


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


def dumps(objects: Sequence[Any], collector: FdCollector) -> bytes:
    """Pickle ``objects`` one after the other into one buffer."""
    buf = io.BytesIO()
    previous = mp_context.get_spawning_popen()
    # multiprocessing only duck-types this object (duplicate_for_child, DupFd).
    mp_context.set_spawning_popen(collector)  # type: ignore[arg-type]
    try:
        for obj in objects:
            reduction.ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    finally:
        mp_context.set_spawning_popen(previous)
    return buf.getvalue()


def describe_unpicklable(fn: Any, args: Sequence[Any], start_method: str) -> str | None:
    """Name the first of ``fn`` and ``args`` that cannot be pickled, or None."""
    candidates = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
    for label, obj in candidates:
        try:
            dumps([obj], FdCollector())
        except Exception as exc:  # pickling raises many types
            return (
                f"{label} ({type(obj).__name__} {obj!r:.80}) cannot be pickled for "
                f"start_method={start_method!r}: {type(exc).__name__}: {exc}. Define "
                "functions at module top level and pass picklable arguments, or use "
                "start_method='fork'."
            )
    return None
