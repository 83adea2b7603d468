"""The zygote process's entry: ``python -c ... <control fd> <caller pid>``
runs main(), which forks the zygote proper and stays behind as its guard."""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback

from fastspawn._os import oscall
from fastspawn._os.children import kill_children
from fastspawn._worker import runner
from fastspawn._worker import spawned as worker_spawned
from fastspawn._zygote import protocol
from fastspawn._zygote.launch import import_all
from fastspawn._zygote.server import Zygote
from fastspawn._zygote.signals import exit_on_sigterm, terminating

# Every import here is one the zygote (and each worker, its copy) carries:
# typing only for annotations.  traceback stays: a failing worker formats its
# traceback at once (0.2 ms) instead of importing it first (3.5-4.8 ms more,
# on the path from a failure to the caller's exception).  So does ast, which
# traceback imports (Python 3.11+) to mark the failing expression in each
# frame: 1.3-1.8 ms here, once, against 4.5-5.2 ms in every failing worker.
if sys.version_info >= (3, 11):
    import ast  # noqa: F401
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _failure_of(exc: BaseException) -> tuple[str, Any]:
    """What a spawned worker would have done had importing the main module
    raised ``exc``: exit (SystemExit: an argparse error at import, say) or
    die with the traceback."""
    if isinstance(exc, SystemExit):
        return ("exit", runner.exit_code(exc))
    return (
        "error",
        "the main module could not be imported in the zygote, as a spawned worker "
        "imports it (code outside `if __name__ == '__main__':` runs there too):\n"
        + traceback.format_exc(),
    )


def _guard(zygote: int) -> NoReturn:
    """The process the caller started, once it has forked the zygote proper:
    wait for it; once it is gone, kill what it left.

    The zygote is a child subreaper, so a worker's orphaned descendants come
    to it, and it kills them; had it been SIGKILLed, they would go to init,
    out of everyone's reach (the launch's process group reaches only those
    still in it, not a daemon that started a session of its own).  As the
    zygote's parent and a subreaper itself, this process adopts them then,
    and kills them until no child is left.  The zygote has
    PR_SET_PDEATHSIG(SIGTERM) against it: if this one is SIGKILLed, the
    zygote shuts down in order, adopting and killing the same way.
    """
    zygote_fd = oscall.pidfd_open(zygote)  # ours and unreaped: no reuse

    def pass_on(signum: int, frame: Any) -> None:
        try:
            oscall.pidfd_send_signal(zygote_fd, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, pass_on)  # PR_SET_PDEATHSIG: the caller died
    while True:
        pid, status = os.waitpid(-1, 0)  # retried after pass_on (PEP 475)
        if pid == zygote:
            break
    kill_children(os.getpid())
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    """Entry of the zygote process: ``python -c ... <control fd> <caller pid>``."""
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A caller that ignores SIGCHLD passed that on through exec: the kernel
    # would reap our children, and the guard's wait and ours find none.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    control_fd = int(sys.argv[1])
    parent = int(sys.argv[2])
    parent_fd = oscall.pidfd_open(parent)
    if os.getppid() != parent:
        return  # the caller died before we could watch it (the pidfd may be another's)
    # This process stays behind as the zygote's guard (see _guard); the
    # zygote proper is its child.
    oscall.set_child_subreaper()
    guard = os.getpid()
    pid = os.fork()
    if pid:
        os.close(control_fd)
        os.close(parent_fd)
        _guard(pid)
    oscall.set_pdeathsig(signal.SIGTERM, guard)  # ProcessLookupError: gone already
    control = socket.socket(fileno=control_fd)
    zygote = None
    try:
        zygote = Zygote(control, parent, parent_fd)
        # The first message: the caller's spawn preparation data and preloads.
        data = control.recv(protocol.MAX_MESSAGE)
        if not data:
            return
        hello = protocol.Hello.decode(data)
        runner.capture_worker_exit_handlers()
        try:
            worker_spawned.prepare(hello.preparation)
        except BaseException as exc:
            if terminating():
                raise  # the caller died: our own SIGTERM
            zygote.prepare_failure = _failure_of(exc)
        import_all(hello.preload)
        zygote.signals.reclaim()
        zygote.settle()
        zygote.serve()
    finally:
        while zygote is not None:
            try:
                zygote.shutdown()
                break
            except SystemExit:
                continue  # SIGTERM landed inside the shutdown: run it again
        control.close()
