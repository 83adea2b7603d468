"""A multiprocessing process's start inside a fastspawn worker: what
multiprocessing's ``spawn_main`` and fork Popen do once the process object
is there (its ``_bootstrap``, then exit with its code)."""

from __future__ import annotations

import os
from multiprocessing import context as mp_context
from multiprocessing import process as mp_process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

# This process was started by fastspawn's fork or spawn context into a
# process group that the warden of the program's first process watches:
# the processes it starts with those contexts stay in that group, not bound
# to this process (see fastspawn._mp.popen.Popen).
in_watched_group = False


def preparation() -> dict[str, Any]:
    """What of the caller's multiprocessing state the process takes on, as
    spawn's preparation data carries it: the default start method (when
    chosen), and the multiprocessing logger's set-up."""
    from multiprocessing import util

    logger = util._logger  # type: ignore[attr-defined]
    return {
        "start_method": mp_context._default_context.get_start_method(allow_none=True),
        "log_to_stderr": util._log_to_stderr,  # type: ignore[attr-defined]
        "log_level": None if logger is None else logger.getEffectiveLevel(),
    }


def run(rank: int, process_obj: mp_process.BaseProcess, prepared: dict[str, Any]) -> NoReturn:
    """The worker's fn: run ``process_obj`` as multiprocessing's child would,
    after taking on the caller's ``preparation()``.  (fastspawn's contexts
    are registered by name here: importing this module imported
    ``fastspawn``.)"""
    global in_watched_group
    in_watched_group = prepared["in_watched_group"]
    start_method = prepared["start_method"]
    known = mp_context._concrete_contexts  # type: ignore[attr-defined]
    if start_method is not None and start_method in known:
        mp_context._force_start_method(start_method)
    if prepared["log_to_stderr"] or prepared["log_level"] is not None:
        from multiprocessing import util

        if prepared["log_to_stderr"]:
            util.log_to_stderr()
        if prepared["log_level"] is not None:
            util.get_logger().setLevel(prepared["log_level"])
    if "main" in prepared:
        _define_in_main(prepared["main"])
    code = process_obj._bootstrap(parent_sentinel=_parent_sentinel(process_obj._parent_pid))  # type: ignore[attr-defined]
    raise SystemExit(code)


def _define_in_main(definitions: dict[str, bytes]) -> None:
    """Put the caller's ``__main__`` functions and classes (see
    fastspawn._mp.popen.main_definitions) in this process's ``__main__``;
    one that cannot be unpickled here is left out."""
    import pickle
    import sys

    main = sys.modules["__main__"]
    for name, data in definitions.items():
        try:
            setattr(main, name, pickle.loads(data))
        except Exception:  # whatever unpickling raises: a task naming it fails
            pass


def _parent_sentinel(caller: int) -> int:
    """An fd readable once the process that made ``process_obj`` has exited,
    for ``multiprocessing.parent_process()``: the pidfd the worker's start
    opened (fastspawn._worker.runner.set_parent_process) when it is that
    process's, else one opened here; a pipe already at its end if that
    process is gone."""
    parent = mp_process.parent_process()
    sentinel = getattr(parent, "_sentinel", None)
    if parent is not None and parent.pid == caller and isinstance(sentinel, int):
        return sentinel
    from fastspawn._os import oscall

    try:
        return oscall.pidfd_open(caller)
    except OSError:
        read_end, write_end = os.pipe()
        os.close(write_end)
        return read_end
