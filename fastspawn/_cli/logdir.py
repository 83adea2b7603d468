"""``fastspawn run``'s log directory: one it made (temporary) or the one
given (empty, or made), and what is removed again on a failure."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile

from fastspawn import elastic


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

    def make_attempt_dir(self, attempt: int) -> str:
        """Make ``attempt_N/``.  Raises LogDirError, after removing what this
        run created, when it cannot."""
        attempt_dir = os.path.join(self.path, f"attempt_{attempt}")
        try:
            os.mkdir(attempt_dir, 0o700)
        except OSError as exc:  # an empty directory we may not write to
            remove_created(None, self.path, self.created)
            raise _log_dir_error(self.given or self.path, exc) from exc
        return attempt_dir


def open_log_dir(args: argparse.Namespace) -> LogDir | None:
    """The directory for the logs, before anything starts: --log-dir, made
    or checked empty, else a new temporary directory when --redirects or
    --tee names a stream or a --duplicate-*-filters option gives filters
    (their lines go to a file); None when none gives the logs a directory.

    Raises:
        LogDirError: the directory cannot be made, or is not empty.
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
    return LogDir(os.path.abspath(log_dir), created, args.log_dir)


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
    return created
