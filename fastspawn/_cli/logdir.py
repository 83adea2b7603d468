"""``fastspawn run``'s log directory: one it made (temporary) or the one
given (empty, or made), and what is removed again on a failure."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile

from fastspawn import elastic
from fastspawn.elastic import logs as elastic_logs


def _missing_ancestor(path: str) -> str | None:
    """The topmost directory of ``path`` (itself included) that does not exist
    yet: what ``os.makedirs(path)`` will create.  None when it exists."""
    path = os.path.abspath(path)
    top = None
    while not os.path.lexists(path):
        top = path
        path = os.path.dirname(path)
    return top


def remove_created(attempt_dir: str | None, log_dir: str, created: str | None) -> None:
    """After a start failed: remove the attempt directory (if any), then each
    directory this run created from ``log_dir`` up to ``created`` (rmdir: only
    while empty, so nothing of anyone else's goes)."""
    if attempt_dir is not None:
        shutil.rmtree(attempt_dir, ignore_errors=True)
    if created is None:
        return
    path = os.path.abspath(log_dir)
    while True:
        try:
            os.rmdir(path)
        except OSError:
            return
        if path == created:
            return
        path = os.path.dirname(path)


# The signals fastspawn.elastic turns into SignalException.


class LogDirError(Exception):
    """The logs have no usable directory; the message says why and what to
    give instead.  ``fastspawn run`` prints it and exits 2."""


def _log_dir_error(log_dir: str, exc: OSError) -> LogDirError:
    """Say why ``log_dir`` cannot hold the logs, as the non-empty case does."""
    why = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError):  # makedirs(exist_ok=True) on a file
        why = "it is not a directory"
    return LogDirError(
        f"fastspawn run: cannot use --log-dir {log_dir}: {why}; give a new or empty "
        "directory that you can write to"
    )


@dataclasses.dataclass(frozen=True)
class LogDir:
    """The directory that holds one ``attempt_N/`` per attempt."""

    # Absolute: the ranks get error file paths under it, and a rank that
    # changes its working directory (Hydra does) must still find them.
    path: str
    created: str | None  # the directory this run made to hold path (itself included)
    given: str | None  # --log-dir as given; None for a temporary directory
    # (st_dev, st_ino) of the directory checked at the start: each attempt
    # makes its directory in that one, or in none.
    identity: tuple[int, int] | None = None

    def make_attempt_dir(self, attempt: int) -> str:
        """Make ``attempt_N/`` (0700) in the directory checked at the start,
        through a descriptor of it, once it is checked again.  Raises
        LogDirError, after removing what this run created, when it cannot."""
        name = f"attempt_{attempt}"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._check_again(fd)
                os.mkdir(name, 0o700, dir_fd=fd)
            finally:
                os.close(fd)
        except LogDirError:
            raise
        except OSError as exc:  # an empty directory we may not write to
            remove_created(None, self.path, self.created)
            raise _log_dir_error(self.given or self.path, exc) from exc
        return os.path.join(self.path, name)

    def _check_again(self, fd: int) -> None:
        st = os.fstat(fd)
        what = self.given or self.path
        if self.identity is not None and (st.st_dev, st.st_ino) != self.identity:
            raise LogDirError(
                f"fastspawn run: --log-dir {what} is no longer the directory the run "
                "started with (someone moved it, and put another in its place): "
                "stopping rather than write the logs there"
            )
        problem = elastic_logs.log_dir_problem(st)
        if problem is not None:
            raise _not_private(what, problem)


def open_log_dir(args: argparse.Namespace) -> LogDir | None:
    """The directory for the logs, before anything starts: --log-dir, made
    or checked empty, else a new temporary directory when --redirects or
    --tee names a stream or a --duplicate-*-filters option gives filters
    (their lines go to a file); None when none gives the logs a directory.

    Raises:
        LogDirError: the directory cannot be made, is not empty, or is not
            private: another user's, or one others may write in.
    """
    log_dir = args.log_dir
    wants_files = (
        args.redirects != elastic.Std.NONE
        or args.tee != elastic.Std.NONE
        or bool(args.duplicate_stdout_filters or args.duplicate_stderr_filters)
    )
    created: str | None  # the directory this run made to hold log_dir (itself included)
    if log_dir is None and wants_files:
        log_dir = created = make_temporary_log_dir()
    elif log_dir is not None:
        created = _make_empty_log_dir(log_dir)
    else:
        return None
    st = os.stat(log_dir)
    return LogDir(os.path.abspath(log_dir), created, args.log_dir, (st.st_dev, st.st_ino))


def make_temporary_log_dir() -> str:
    try:
        return tempfile.mkdtemp(prefix="fastspawn-run-")
    except OSError as exc:
        # Not gettempdir(): where no candidate is usable, it raises again.
        where = f" in {tempfile.tempdir}" if tempfile.tempdir else ""
        raise LogDirError(
            f"fastspawn run: cannot make a log directory{where}: {exc.strerror or exc}; "
            "give --log-dir, or set TMPDIR to a directory you can write to"
        ) from exc


def _make_empty_log_dir(log_dir: str) -> str | None:
    """Make ``log_dir`` (its parents too) unless it exists, and check that it
    is empty; the topmost directory made, None when it existed."""
    created = _missing_ancestor(log_dir)
    try:
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        not_empty = bool(os.listdir(log_dir))
    except OSError as exc:
        if created is not None:
            remove_created(None, log_dir, created)
        raise _log_dir_error(log_dir, exc) from exc
    if not_empty:
        raise LogDirError(
            f"fastspawn run: --log-dir {log_dir} is not empty; give a new or empty "
            "directory (each run writes attempt_N/ there)"
        )
    problem = elastic_logs.log_dir_problem(os.stat(log_dir))
    if problem is not None:
        if created is not None:
            remove_created(None, log_dir, created)
        raise _not_private(log_dir, problem)
    return created


def check_agent_log_dir(log_dir: str) -> None:
    """--log-dir for torch's agent (which makes it when missing, and a
    private run directory in it): refused, as for the static rendezvous,
    when it exists and is another user's or others may write in it.

    Raises:
        LogDirError: saying whose it is, its mode, and what to do.
    """
    try:
        st = os.stat(log_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _log_dir_error(log_dir, exc) from exc
    problem = elastic_logs.log_dir_problem(st)
    if problem is not None:
        raise _not_private(log_dir, problem)


def _not_private(log_dir: str, problem: str) -> LogDirError:
    return LogDirError(
        f"fastspawn run: cannot use --log-dir {log_dir}: {problem}; another user could "
        "read or replace the ranks' logs, error files and stack dumps there. Give a "
        "directory of your own that only you can write in (mkdir -m 700 DIR, or "
        "chmod go-w DIR), or leave --log-dir out for a new private one"
    )
