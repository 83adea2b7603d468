"""A spawned worker (start method spawn): a fresh interpreter exec'd by the
C launcher, prepared from the caller's main module as multiprocessing's
spawn children are (the zygote prepares the same way)."""

from __future__ import annotations

import os
import pickle
import socket
import sys

from fastspawn._os.held import import_held
from fastspawn._wire import channel as _channel
from fastspawn._wire import payload as wire_payload
from fastspawn._wire import pickling
from fastspawn._worker.runner import finish, format_exc, print_exc, run, set_parent_process
from fastspawn._worker.stacks import arm_stacks
from fastspawn._worker.stdio import line_buffer_stdout, quiet_stdin, whole_lines

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NoReturn


# Linux's limit on one string exec passes (MAX_ARG_STRLEN, 32 pages), its
# terminating NUL included: a longer ``NAME=value`` fails the exec (E2BIG).
MAX_ARG_STRLEN = 131072


def check_exec_env(envs: Mapping[int, Mapping[str, str]], nprocs: int, why: str) -> None:
    """Refuse the environments exec would refuse: each ``NAME=value``
    string a rank gets (the caller's environment updated with its
    ``envs[rank]``), encoded as the kernel gets it, must fit
    MAX_ARG_STRLEN.  ``why`` says what execs and what to do instead.

    Raises:
        LimitError: (a ValueError) naming the first variable too long,
            where it comes from, its size and the limit.
    """
    # Here, not at the top: a spawned worker, which imports this module,
    # never checks.
    from fastspawn._os.limits import LimitError

    def check(name: str, value: str, origin: str) -> None:
        size = len(os.fsencode(name)) + 1 + len(os.fsencode(value)) + 1
        if size > MAX_ARG_STRLEN:
            raise LimitError(
                f"the environment variable {name} (from {origin}) is {size - 1} bytes as "
                f"NAME=value, over the {MAX_ARG_STRLEN - 1} bytes Linux lets exec pass in "
                f"one string (MAX_ARG_STRLEN): {why}"
            )

    for rank in range(nprocs):
        for name, value in envs.get(rank, {}).items():
            check(name, value, f"envs[{rank}]")
    for name, value in os.environ.items():
        try:
            check(name, value, "the caller's environment")
        except ValueError:
            # Passed only to the ranks whose envs do not replace it.
            if any(name not in envs.get(rank, {}) for rank in range(nprocs)):
                raise


def entry_code(call: str, first: str = "") -> str:
    """``python -c`` code that imports this very fastspawn, then runs ``call``
    (after the statement ``first``, if given).

    ``-c`` puts the current directory first on sys.path: run from a source
    checkout (a ``fastspawn/`` folder without its built extension), the child
    would import that instead of the installed package.  The caller's package
    directory goes first instead; the caller's full sys.path follows later,
    when the child prepares like a spawn child.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    module, _, function = call.rpartition(".")
    return (
        f"import sys; sys.path[:1] = [{root!r}] + [p for p in sys.path[:1] if p]; "
        f"{first}{'; ' if first else ''}from {module} import {function}; {function}()"
    )


def preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's spawn preparation data for a child named ``name``,
    less a main script that is not a file: a program read from stdin
    (``python -``) or deleted since.  The child then prepares as under
    ``python -c`` (no ``__mp_main__`` to import), where a multiprocessing
    spawn child would die on FileNotFoundError, and with it our zygote."""
    spawn = import_held("multiprocessing.spawn")  # its first use: see there
    data: dict[str, Any] = spawn.get_preparation_data(name)
    path = data.get("init_main_from_path")
    if path is not None and not os.path.isfile(path):
        del data["init_main_from_path"]
    return data


def prepare(preparation: dict[str, Any]) -> None:
    """multiprocessing.spawn.prepare, flagged as bootstrapping: a ``__main__``
    that starts processes at import time (no ``if __name__ == "__main__"``
    guard) then gets multiprocessing's clear RuntimeError instead of
    starting processes without end."""
    from multiprocessing import process, spawn

    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.prepare(preparation)
    finally:
        current._inheriting = False  # type: ignore[attr-defined]


def spawn_main() -> NoReturn:
    """Entry of a spawned worker (a fresh interpreter); never returns.

    argv: rank, payload fd, channel fd, daemon flag, stacks flag (see
    arm_stacks), resource tracker fd (-1: none), line-buffered stdout flag,
    then the inherited fds.
    PR_SET_PDEATHSIG was armed before exec by the C launcher, with the
    parent re-checked.
    """
    rank = int(sys.argv[1])
    payload_fd = int(sys.argv[2])
    tx = socket.socket(fileno=int(sys.argv[3]))
    tx.set_inheritable(False)  # inherited for exec only: not by our children
    daemon = sys.argv[4] == "1"
    if sys.argv[5] == "1":
        arm_stacks(rank)  # first: a main module whose import hangs shows where
    tracker_fd = int(sys.argv[6])
    if sys.argv[7] == "1":
        line_buffer_stdout()
    whole_lines()
    pickling.inherited_fds[:] = [int(fd) for fd in sys.argv[8:]]
    code, signum = 1, 0
    try:
        quiet_stdin()
        # Every rank shares one payload file description, hence one offset:
        # read it with pread, never with read.
        with wire_payload.read_payload(payload_fd) as payload:
            from multiprocessing import process

            if tracker_fd >= 0:
                from multiprocessing import resource_tracker

                resource_tracker._resource_tracker._fd = tracker_fd  # type: ignore[attr-defined]
            try:
                preparation, _work_size = wire_payload.read_trailer(payload)
                prepare(preparation)
                process.current_process()._config["daemon"] = daemon  # type: ignore[attr-defined]
                set_parent_process(os.getppid())
                process.current_process().name = f"fastspawn-worker-{rank}"
                fn, args = pickle.load(payload)
            except BaseException:
                _channel.send(tx, rank, _channel.ERROR, format_exc().encode())
            else:
                for fd in pickling.inherited_fds:
                    os.close(fd)  # the unpickled objects hold their own dups
                code, signum = run(rank, fn, args, tx)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the caller closed its channel: it is gone or gave up on us
    except BaseException:
        print_exc()
    finally:
        finish(code, signum, "all")
