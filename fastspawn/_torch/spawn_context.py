"""``SpawnContext``: torch's deprecated name for ProcessContext, in both of
the shapes it is called with.

fastspawn's own ``SpawnContext(processes, receiver)`` is a ProcessContext.
Code written against torch calls ``SpawnContext(processes, error_files)``:
``multiprocessing.Process`` objects it started itself and, per rank, the
path torch's worker wrapper pickles a traceback to (before torch 1.12, a
SimpleQueue it puts the traceback on).  That call gets a
:class:`StartedProcessesContext`, which joins those processes as torch's
ProcessContext does.
"""

from __future__ import annotations

import io
import logging
import multiprocessing.connection
import os
import pickle
import stat
import time
import warnings
from collections.abc import Sequence
from typing import Any

from fastspawn._launch import context as _context
from fastspawn._launch.context import ProcessContext
from fastspawn._launch.errors import exited_exception, raised_exception
from fastspawn._wire.channel import Receiver

log = logging.getLogger(__name__)

# torch's wrapper pickles one traceback string; anything larger is not one.
_MAX_ERROR_FILE = 16 << 20


class SpawnContext(ProcessContext):
    """Deprecated alias of :class:`ProcessContext`, warning as torch does.

    Called as torch calls it, ``SpawnContext(processes, error_files)``, it
    gives a :class:`StartedProcessesContext` over those processes.
    """

    def __new__(cls, processes: Sequence[Any], receiver: Any, daemon: bool = False) -> SpawnContext:
        message = "SpawnContext is renamed to ProcessContext since 1.4 release."
        if cls is SpawnContext and not isinstance(receiver, Receiver):
            cls = StartedProcessesContext
            # torch's words first (filters match them); then why they do not
            # apply: fastspawn.ProcessContext(processes, error_files) raises,
            # naming SpawnContext, and the advice would go round in a loop.
            message += (
                " fastspawn's ProcessContext is made by start_processes and takes no error "
                "files: for processes started otherwise, keep SpawnContext(processes, "
                "error_files)."
            )
        warnings.warn(message, stacklevel=2)
        return super().__new__(cls)

    def __init__(self, processes: Sequence[Any], receiver: Any, daemon: bool = False) -> None:
        super().__init__(list(processes), receiver, daemon)


class _TracebackUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a pickle that names any class or function
    (the way a pickle runs code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"an error file holds a traceback string, not {module}.{name}")


def read_traceback(path: str | None) -> str | None:
    """The traceback torch's worker wrapper pickled to ``path``, then the
    file removed; None when there is none to read.

    A rank that exited without raising wrote no file.  The file is read only
    if it is a regular file this user owns (torch names it in the shared
    temp directory, where another user could plant one), without following
    a symlink, and unpickled as plain data (a pickle naming any class is
    refused), so reading it runs no code.
    """
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            log.warning("error file %s is not a file of this user's: not read", path)
            return None
        with open(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_ERROR_FILE + 1)
    finally:
        os.close(fd)
    try:
        os.unlink(path)  # read: leave nothing behind, as fastspawn's own ranks do
    except OSError:
        pass
    try:
        value = _TracebackUnpickler(io.BytesIO(data[:_MAX_ERROR_FILE])).load()
    except Exception as exc:
        log.warning("error file %s holds no traceback (%s)", path, exc)
        return None
    return value if isinstance(value, str) else None


def rank_traceback(source: Any) -> str | None:
    """The traceback a rank left in ``source``: a path (see
    :func:`read_traceback`), or an error queue as torch used before 1.12
    (anything with ``empty()`` and ``get()``), or None."""
    if source is None or isinstance(source, (str, os.PathLike)):
        return read_traceback(None if source is None else os.fspath(source))
    if callable(getattr(source, "empty", None)) and callable(getattr(source, "get", None)):
        value = None if source.empty() else source.get()
        return value if isinstance(value, str) else None
    log.warning("error source %r is neither a file path nor a queue: not read", source)
    return None


class StartedProcessesContext(SpawnContext):
    """What ``SpawnContext(processes, error_files)`` gives: a context over
    started ``multiprocessing.Process`` objects (or any with their
    ``sentinel``, ``pid``, ``exitcode``, ``join``, ``is_alive``,
    ``terminate`` and ``kill``), joined as torch's ProcessContext joins
    them.

    ``join`` waits on the processes' sentinels; on a non-zero exit it stops
    the others (grace period, SIGTERM, SIGKILL, logged as torch logs them)
    and raises ProcessRaisedException with the traceback from the rank's
    error file (see :func:`read_traceback`), else ProcessExitedException;
    later calls raise for each other rank that ended badly, then return
    True.  There are no return values (torch has none), and the processes
    are multiprocessing's: none of fastspawn's own launch guarantees
    (orphan safety, pidfds) applies to them.

    Attributes:
        processes: the processes, by rank.
        error_files: each rank's error file (None: none), or error queue.
        sentinels: ``{sentinel: rank}`` of the processes not yet joined.
    """

    def __init__(
        self,
        processes: Sequence[Any],
        error_files: Sequence[Any] | None,
        daemon: bool = False,
    ) -> None:
        # Not ProcessContext.__init__: there is no launch channel here, and
        # no pidfd of ours to watch.
        self.processes = list(processes)
        files = [None] * len(self.processes) if error_files is None else list(error_files)
        if len(files) != len(self.processes):
            raise ValueError(
                f"SpawnContext(processes, error_files): {len(self.processes)} processes but "
                f"{len(files)} error files; give one path (or None) per process"
            )
        self.error_files = files
        self.daemon = daemon
        self.sentinels: dict[Any, int] = {}
        for rank, proc in enumerate(self.processes):
            try:
                self.sentinels[proc.sentinel] = rank
            except (AttributeError, ValueError) as exc:
                raise ValueError(
                    f"SpawnContext(processes, error_files): process {rank} ({proc!r}) has no "
                    f"sentinel ({exc}); give started multiprocessing.Process objects"
                ) from None

    def __repr__(self) -> str:
        return (
            f"<fastspawn.StartedProcessesContext nprocs={len(self.processes)} "
            f"running={len(self.sentinels)} pids={self.pids()[:8]}>"
        )

    @property
    def return_values(self) -> dict[int, Any]:
        """Always empty: torch's processes send no return value back."""
        return {}

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for any process to exit; on a failure, stop the rest and
        raise (see the class docstring).

        Returns:
            True once every process exited with code 0 (and on every later
            call); False while some still run.
        """
        if not self.sentinels:
            return True
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        failed = None
        for sentinel in ready:
            rank = self.sentinels.pop(sentinel)
            proc = self.processes[rank]
            proc.join()
            if proc.exitcode != 0:
                failed = rank
                break
        if failed is None:
            return not self.sentinels
        self._stop_started(grace_period)
        proc = self.processes[failed]
        traceback = rank_traceback(self.error_files[failed])
        if traceback is not None:
            raise raised_exception(failed, proc.pid, traceback)
        code = proc.exitcode
        assert code is not None  # joined above
        raise exited_exception(failed, proc.pid, code)

    def _join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))

    def _stop_started(self, grace_period: float | None) -> None:
        """After a failure: the grace period, SIGTERM, the grace period
        again (30 s when None), SIGKILL; every process joined."""
        if grace_period is not None:
            self._join_all(grace_period)
        for proc in self.processes:
            if proc.is_alive():
                _context.log.warning("Terminating process %s via signal SIGTERM", proc.pid)
                proc.terminate()
        self._join_all(30 if grace_period is None else grace_period)
        for proc in self.processes:
            if proc.is_alive():
                _context.log.warning(
                    "Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL",
                    proc.pid,
                )
                proc.kill()
            proc.join()
