"""What elastic ranks run inside a fastspawn worker: a function, recording
its error file on failure, or an exec of a binary."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from fastspawn._os.numa import NumaBinding

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def write_error_file(exc: BaseException) -> None:
    """Write TorchElastic's error.json for ``exc`` where TORCHELASTIC_ERROR_FILE
    says (nowhere when it is unset or empty).  The file is created 0600.

    A symbolic link there is never followed (one planted in the log
    directory would have the rank overwrite whatever it points to), nor is
    a file another user owns written into (one planted there, world
    writable, for the rank to fill with its traceback): the file is then
    not written, and a line on stderr names it.  Nor is any other failure
    to write it raised: the rank's own exception is what must reach the
    launcher, and does, with its exit code.
    """
    path = os.environ.get(ERROR_FILE_ENV, "")
    if not path:
        return
    try:
        _write_error_json(path, exc)
    except OSError as error:
        if error.errno == errno.ELOOP:
            why = "it is a symbolic link, which fastspawn does not follow"
        else:
            why = error.strerror or str(error)
        print(f"fastspawn: cannot write the error file {path}: {why}", file=sys.stderr)


def open_private(path: str, append: bool = False) -> int:
    """``path`` opened for writing, readable by this user alone: a new file
    0600, or one that exists already (a LogsSpecs may name the same error
    file for every attempt, and torch overwrites it too) if it is a regular
    file of this user's, its mode made 0600; emptied, or with ``append``
    written at its end (a rank's stacks.log).  Never through a symbolic
    link (ELOOP).

    Raises:
        PermissionError: the file is another user's, or not a regular file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(errno.EPERM, "it is not a regular file")
        if st.st_uid != os.geteuid():
            raise PermissionError(
                errno.EPERM,
                f"it belongs to uid {st.st_uid}, not to this process's user (someone "
                "may have put it there to read what is written into it)",
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        if not append:
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_error_json(path: str, exc: BaseException) -> None:
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(time.time())),
            },
        }
    }
    with open(open_private(path), "w") as f:
        json.dump(data, f)


def run_function(
    rank: int,
    entrypoint: Callable[..., Any],
    args: Mapping[int, Sequence[Any]],
    numa: NumaBinding | None = None,
) -> Any:
    """Bind this rank to its CPUs (``numa``), then call
    ``entrypoint(*args[rank])``; on an exception (a failed binding's too, as
    torch records it) write the error file first, then let the core report
    it.

    Only the rank writes it: a child the rank forked (``os.fork()`` in the
    entrypoint) that raises out of it is not the rank, and the rank's own
    exit status decides whether it failed (see ``fastspawn._worker.runner.run``).
    """
    rank_pid = os.getpid()
    try:
        if numa is not None:
            numa.bind_rank(rank)
        return entrypoint(*args[rank])
    except Exception as exc:
        if os.getpid() == rank_pid:
            write_error_file(exc)
        raise


def exec_binary(rank: int, path: str, argvs: Mapping[int, Sequence[str]]) -> NoReturn:
    """Become the binary: own session (so a signal to its process group
    reaches its children), default signal dispositions, then exec.

    PR_SET_PDEATHSIG, armed when this worker was forked, survives the exec.
    """
    os.setsid()
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.execve(path, list(argvs[rank]), dict(os.environ))
