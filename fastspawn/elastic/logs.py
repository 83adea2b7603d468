"""Where the ranks' output goes: the log-file layout
(``{log_dir}/{rank}/stdout.log``, ``stderr.log``, ``error.json``), torch's
``LogsSpecs`` / ``LogsDest``, tee and the filtered copies."""

from __future__ import annotations

import abc
import errno
import logging
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fastspawn._worker.elastic_rank import ERROR_FILE_ENV
from fastspawn.elastic.api import Std, to_map

log = logging.getLogger(__name__)


def remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_log(path: str) -> int:
    """A new log file, 0600; never one that exists already (another rank's,
    an earlier attempt's, or a link someone planted: O_EXCL does not follow
    a link, O_NOFOLLOW says so again).

    Raises:
        FileExistsError: ``path`` exists, the message saying whether it is
            a symbolic link.
    """
    if path == os.devnull:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        if os.path.islink(path):
            raise FileExistsError(
                errno.EEXIST,
                "log file is a symbolic link, which fastspawn does not follow (someone "
                "may have planted it in the log directory: remove it, or log elsewhere)",
                path,
            ) from None
        raise FileExistsError(
            errno.EEXIST,
            "log file exists already (fastspawn neither appends to nor overwrites a log: "
            "give each rank and each attempt a path of its own)",
            path,
        ) from None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def log_dir_problem(st: os.stat_result) -> str | None:
    """Why a directory with status ``st`` cannot hold a run's logs, or None:
    it must be the caller's own and writable by no one else.  Another user
    who owns it, or may write in it, can swap the directories the run
    makes there for a tree of their own, and read what the ranks write
    (error files with tracebacks, stack dumps), or rename the logs away."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return (
            f"it belongs to {_user(st.st_uid)}, not to you ({_user(os.geteuid())}), mode {mode:04o}"
        )
    if mode & 0o022:
        who = (
            "its group and others"
            if mode & 0o022 == 0o022
            else ("its group" if mode & 0o020 else "others")
        )
        return f"{who} may write in it (mode {mode:04o})"
    return None


class LogDirNotPrivate(PermissionError):
    """A log directory another user owns or may write in: the message names
    it, its owner and mode, and what to do."""


def check_log_dir(path: str, fd: int | None = None) -> None:
    """Refuse ``path`` (or the directory open as ``fd``) as a log directory
    unless it is the caller's and no one else may write in it.  Its
    parents are not checked: a sticky world-writable one (``/tmp``) lets
    no one else move it.

    Raises:
        LogDirNotPrivate: saying whose it is, its mode, and what to do.
    """
    st = os.stat(path) if fd is None else os.fstat(fd)
    problem = log_dir_problem(st)
    if problem is not None:
        raise LogDirNotPrivate(
            errno.EACCES,
            f"log directory not private: {problem}; another user could read or replace "
            "the run's logs and error files there. Give a directory of your own that "
            "only you can write in (mkdir -m 700 DIR, or chmod go-w DIR)",
            path,
        )


@dataclass
class LogsDest:
    """Where each rank's output goes, by local rank: what
    ``LogsSpecs.reify`` returns (torch's ``LogsDest``).

    ``stdouts``/``stderrs``: a file path, ``""`` for the console,
    ``os.devnull`` to discard.  ``tee_stdouts``/``tee_stderrs``: the ranks
    whose stream is also shown on the console, prefixed, mapped to the same
    path as in ``stdouts``/``stderrs`` (``os.devnull`` shows nothing).
    ``error_files``: where each rank's error file goes.
    ``filtered_stdout``/``filtered_stderr``: where
    ``duplicate_stdout_filters``/``duplicate_stderr_filters`` copy the
    matching lines of the ranks tee'd to the console (``os.devnull``:
    nowhere).
    """

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecs(abc.ABC):
    """How ranks' output is kept, as torch 2.3+ takes it in
    ``start_processes(..., logs_specs=...)``: ``reify(envs)`` creates what
    the ranks will write to and says where (a ``LogsDest``).  It may add
    variables to ``envs`` (the per-rank environments about to be used).

    Args:
        log_dir: the directory logs go under.
        redirects: streams written to each rank's log file.
        tee: streams written to the log file and shown on the console.
        local_ranks_filter: when given, only these ranks show output on the
            console; the others' output goes to their files only.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create the ranks' log locations and say where they are."""

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str:
        """The directory the logs go under."""


class DefaultLogsSpecs(LogsSpecs):
    """torch's default layout: ``{log_dir}/{run_id}_{random}/attempt_{n}/{rank}/``
    holding ``stdout.log``, ``stderr.log`` and ``error.json``.

    ``run_id`` and ``n`` come from rank 0's ``TORCHELASTIC_RUN_ID`` and
    ``TORCHELASTIC_RESTART_COUNT`` (``test_run_id`` and ``0`` without them).
    The run directory is made once per object, 0700, and kept for every
    attempt; an attempt's directory is made afresh.  ``log_dir`` is created
    when missing; ``None`` makes a new private directory in the temp dir (it
    is the caller's to remove); ``os.devnull`` keeps nothing and gives ranks
    an empty ``TORCHELASTIC_ERROR_FILE``.

    Raises:
        NotADirectoryError: ``log_dir`` is a file.
        PermissionError: ``log_dir`` is another user's, or others may
            write in it (the message names its owner and mode).
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | Mapping[int, Std] = Std.NONE,
        tee: Std | Mapping[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if log_dir is not None and log_dir != os.devnull:
            log_dir = os.fspath(log_dir)
            if os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file, not a directory")
            os.makedirs(log_dir, mode=0o700, exist_ok=True)
            check_log_dir(log_dir)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs.get(0, {})
        dest = LogsDest()
        if self._root_log_dir == os.devnull:
            for rank in range(nprocs):
                dest.stdouts[rank] = dest.stderrs[rank] = ""
                dest.tee_stdouts[rank] = dest.tee_stderrs[rank] = os.devnull
                dest.error_files[rank] = os.devnull
                envs[rank][ERROR_FILE_ENV] = ""
            dest.filtered_stdout = dest.filtered_stderr = os.devnull
            return dest
        if self._run_log_dir is None:
            if self._root_log_dir is None:
                self._root_log_dir = tempfile.mkdtemp(prefix="torchelastic_")
            check_log_dir(self._root_log_dir)  # still: it may have changed since
            run_id = first.get("TORCHELASTIC_RUN_ID", "test_run_id")
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self._root_log_dir)
            log.info("log directory set to: %s", self._run_log_dir)
        attempt = os.path.join(
            self._run_log_dir, f"attempt_{first.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        shutil.rmtree(attempt, ignore_errors=True)
        os.mkdir(attempt, 0o700)
        dest.filtered_stdout = os.path.join(attempt, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(attempt, "filtered_stderr.log")
        redirects = to_map(self._redirects, nprocs)
        tees = to_map(self._tee, nprocs)
        for rank in range(nprocs):
            rank_dir = os.path.join(attempt, str(rank))
            os.mkdir(rank_dir, 0o700)
            shown = self._local_ranks_filter is None or rank in self._local_ranks_filter
            rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs, shown)
        return dest

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return NotImplemented
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
            and self._local_ranks_filter == other._local_ranks_filter
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and mutable


def checked_filters(filters: Sequence[str] | None, what: str) -> list[str]:
    """``filters`` as a list of strings (None: none).  A string would be
    taken one character at a time: refused."""
    if filters is None:
        return []
    if isinstance(filters, (str, bytes)) or not all(isinstance(f, str) for f in filters):
        raise TypeError(f"{what} takes a list of strings, got {filters!r:.80}")
    return list(filters)


def filtered_copies(
    dest: LogsDest, filters: Mapping[str, list[str]]
) -> dict[str, tuple[str, list[str]]]:
    """``{"stdout"|"stderr": (file, needles)}`` for the filters given."""
    copies = {}
    for console, path in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
        if not filters[console]:
            continue
        if not path:
            raise ValueError(
                f"duplicate_{console}_filters given, but the LogsDest names no "
                f"filtered_{console} file to copy the matching lines to"
            )
        copies[console] = (path, filters[console])
    return copies


def checked_log_args(
    log_dir: str | os.PathLike[str] | LogsSpecs | None,
    logs_specs: LogsSpecs | None,
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
) -> tuple[str | None, LogsSpecs | None]:
    """Where start_processes' logs go, checked: ``(directory, None)`` for a
    ``log_dir`` directory, ``(None, logs_specs)`` for a LogsSpecs, given
    fifth (torch 2.3+) or by keyword.  Raises as start_processes documents."""
    directory: str | None = None
    given = [x for x in (log_dir, logs_specs) if x is not None]
    if isinstance(log_dir, (str, os.PathLike)):
        directory = os.fspath(log_dir)
    elif log_dir is not None:
        logs_specs = log_dir  # torch 2.3+ passes it fifth
    if len(given) != 1:
        raise TypeError(
            "start_processes() takes where logs go as log_dir (a directory) or as "
            "logs_specs (a LogsSpecs such as DefaultLogsSpecs): give exactly one"
        )
    if logs_specs is not None:
        if not callable(getattr(logs_specs, "reify", None)):
            raise TypeError(
                f"logs_specs must be a LogsSpecs (an object with reify(envs)), not "
                f"{type(logs_specs).__name__}"
            )
        if not (redirects is Std.NONE and tee is Std.NONE):
            raise TypeError(
                "redirects and tee are part of logs_specs: give them to the LogsSpecs "
                "(DefaultLogsSpecs(log_dir, redirects=..., tee=...)), not to start_processes"
            )
    if directory is not None and directory != os.devnull:
        if os.listdir(directory):
            raise RuntimeError(
                f"log_dir: {directory} is not empty, please provide an empty log_dir"
            )
        check_log_dir(directory)
    return directory, logs_specs


def logs_dest(
    directory: str | None,
    logs_specs: LogsSpecs | None,
    redirects: Std | Mapping[int, Std],
    tee: Std | Mapping[int, Std],
    envs: dict[int, dict[str, str]],
    created: list[str],
) -> LogsDest:
    """Each rank's log files: the ``directory`` layout (``_rank_dirs``, which
    appends each directory it makes to ``created``), else what
    ``logs_specs`` makes of ``envs``."""
    if directory is not None:
        nprocs = len(envs)
        return _rank_dirs(directory, to_map(redirects, nprocs), to_map(tee, nprocs), envs, created)
    assert logs_specs is not None
    return logs_specs.reify(envs)


def _rank_dirs(
    log_dir: str,
    redirects: dict[int, Std],
    tees: dict[int, Std],
    envs: dict[int, dict[str, str]],
    created: list[str],
) -> LogsDest:
    """The ``log_dir`` layout: ``{log_dir}/{rank}/`` holding ``stdout.log``,
    ``stderr.log`` and ``error.json`` (``os.devnull``: no files, tee'd
    streams shown on the console only).  Appends each directory it makes
    to ``created``."""
    dest = LogsDest()
    if log_dir == os.devnull:
        dest.filtered_stdout = dest.filtered_stderr = os.devnull
    else:
        dest.filtered_stdout = os.path.join(log_dir, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(log_dir, "filtered_stderr.log")
    for rank in envs:
        if log_dir == os.devnull:
            dest.stdouts[rank] = dest.stderrs[rank] = ""
            if tees[rank] & Std.OUT:
                dest.tee_stdouts[rank] = ""
            if tees[rank] & Std.ERR:
                dest.tee_stderrs[rank] = ""
            dest.error_files[rank] = os.devnull
            continue
        rank_dir = os.path.join(log_dir, str(rank))
        os.mkdir(rank_dir, 0o700)
        created.append(rank_dir)
        rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs)
    return dest


def rank_files(
    dest: LogsDest,
    rank: int,
    rank_dir: str,
    redirect: Std,
    tee: Std,
    envs: dict[int, dict[str, str]],
    shown: bool = True,
) -> None:
    """Fill in ``dest`` for one rank whose files go in ``rank_dir``: a log
    file for each stream redirected or tee'd, tee'd ones also on the console
    when the rank is ``shown``; a stream neither goes to the console, or
    nowhere when the rank is not shown.  Its error file, also in ``envs``."""
    for std, name, files, tee_files in (
        (Std.OUT, "stdout.log", dest.stdouts, dest.tee_stdouts),
        (Std.ERR, "stderr.log", dest.stderrs, dest.tee_stderrs),
    ):
        if (redirect | tee) & std:
            files[rank] = os.path.join(rank_dir, name)
            if tee & std and shown:
                tee_files[rank] = files[rank]
        else:
            files[rank] = "" if shown else os.devnull
    dest.error_files[rank] = os.path.join(rank_dir, "error.json")
    envs[rank][ERROR_FILE_ENV] = dest.error_files[rank]


def tee_flags(tee_files: Mapping[int, str], files: Mapping[int, str], what: str) -> dict[int, bool]:
    """Which ranks' stream is shown on the console as well.  fastspawn tees
    the stream itself as it is written (torch tails the file), so a rank's
    tee file must be the file its stream goes to; ``os.devnull`` shows
    nothing."""
    flags = {}
    for rank, path in files.items():
        shown = tee_files.get(rank, os.devnull)
        flags[rank] = shown != os.devnull
        if flags[rank] and shown not in ("", path):
            raise ValueError(
                f"rank {rank}: tee_{what}s names {shown!r} but its {what} goes to "
                f"{path!r}; fastspawn shows a rank's {what} as it is written, so "
                f"tee_{what}s must name the same file as {what}s"
            )
    return flags
