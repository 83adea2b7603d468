"""TorchElastic-style launching: N copies of a function or a binary, with
per-rank args and envs, log files, tee and error files.

The surface follows ``torch.distributed.elastic.multiprocessing``
(``start_processes``, ``Std``, ``RunProcsResult``, ``ProcessFailure``,
``SignalException``, the ``{rank}/stdout.log|stderr.log|error.json`` layout
and ``TORCHELASTIC_ERROR_FILE``).  Underneath, every rank is a fastspawn
worker: orphan-safe (a rank and its children die with the launcher), waited
on through pidfds, tee'd by one event loop.
"""

from __future__ import annotations

import abc
import atexit
import datetime
import enum
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from fastspawn import _context, _launch, _limits, _numa, _stacks
from fastspawn._elastic_worker import ERROR_FILE_ENV, exec_binary, run_function
from fastspawn._errors import ProcessException
from fastspawn._methods import registry
from fastspawn._process import checked_seconds
from fastspawn._tee import LineFilter, Tee

log = logging.getLogger(__name__)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "start_processes",
    "to_map",
]

_NOT_AVAILABLE = "<N/A>"
_EMPTY_ERROR_DATA = {"message": "<NONE>"}
# torch's ProcessFailure.message for a rank that exited (not signalled)
# without an error file; users and tests match it byte for byte.
_NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
# ... and what torch adds to its error_file_data then.
_NO_ERROR_FILE_TRAITS = {"category": "system_terminated_error", "retryability": "False"}
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

# The contexts started and not yet closed, and for each one that was live
# when a SignalException was raised here, that signal: interpreter exit
# closes those still live with it (see _close_after_signal).  Contexts
# started after a signal the caller handled are waited for as usual.
_live_contexts: set[PContext] = set()  # held: a dropped one is closed too
_signalled: dict[PContext, signal.Signals] = {}


def _forget_in_child() -> None:
    # A process forked from ours exits without closing our ranks.
    _signalled.clear()
    _live_contexts.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _forget_context(context: PContext) -> None:
    _live_contexts.discard(context)
    _signalled.pop(context, None)


class SignalException(Exception):
    """The launcher got a termination signal; ``sigval`` says which, so the
    caller can ``close(e.sigval)``."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def _note_signal(sigval: signal.Signals) -> None:
    """Mark every live context to be closed with ``sigval`` at interpreter
    exit, should the exception a handler raises for it escape the caller."""
    for context in _live_contexts:
        _signalled.setdefault(context, sigval)


def _raise_signal_exception(signum: int, frame: Any) -> None:
    sigval = signal.Signals(signum)
    _note_signal(sigval)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


class Std(enum.IntFlag):
    """Which standard streams to redirect or tee."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, value: str) -> Std | dict[int, Std]:
        """``"0"``..``"3"`` for every rank, or ``"rank:value,..."`` per rank
        (``"0:1,1:2"``).

        Raises:
            ValueError: anything else (``"11"``, ``"0:1,"``, ``"1,0:1"``).
        """
        if re.fullmatch(r"[0-3]", value):
            return cls(int(value))
        if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", value):
            result: dict[int, Std] = {}
            for item in value.split(","):
                rank, std = item.split(":")
                result[int(rank)] = cls(int(std))
            return result
        raise ValueError(
            f"{value!r} is not a Std spec: give one of 0 (none), 1 (stdout), 2 (stderr), "
            "3 (both), or rank:value pairs such as '0:1,1:2'"
        )


def to_map(value: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand ``value`` to every rank in ``range(local_world_size)``; ranks a
    mapping leaves out get ``Std.NONE``."""
    if isinstance(value, Std):
        return dict.fromkeys(range(local_world_size), value)
    return {rank: Std(value.get(rank, Std.NONE)) for rank in range(local_world_size)}


@dataclass
class ProcessFailure:
    """A failed rank: its exit code and what its error file says.

    ``rank_stacks`` (fastspawn's addition): ``{local rank: text}``, the
    Python stacks of the ranks that still ran when this one failed, taken
    before they were stopped (empty with ``stacks=False``).
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)
    message: str = field(init=False)
    timestamp: int = field(init=False)
    rank_stacks: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.error_file_data = dict(_EMPTY_ERROR_DATA)
        self.message = ""
        self.timestamp = int(time.time())
        if os.path.islink(self.error_file):
            # Not the rank's (it never writes through a link): what it
            # points to may be anything.
            log.warning(
                "rank %d: its error file %s is a symbolic link, which fastspawn does not "
                "follow; reporting its exit code instead",
                self.local_rank,
                self.error_file,
            )
            self.error_file = _NOT_AVAILABLE
        elif os.path.isfile(self.error_file):
            try:
                self._read_error_file()
            except (OSError, ValueError, LookupError, TypeError) as exc:
                # Cut short (the rank was killed while writing it), or not
                # ours: the exit code says what is known.
                log.warning(
                    "rank %d: its error file %s could not be read (%s: %s); reporting "
                    "its exit code instead",
                    self.local_rank,
                    self.error_file,
                    type(exc).__name__,
                    exc,
                )
                self.error_file_data = dict(_EMPTY_ERROR_DATA)
                self.message = ""
        else:
            self.error_file = _NOT_AVAILABLE
        if not self.message:
            if self.exitcode < 0:
                self.message = (
                    f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                )
            else:
                # torch's words: sys.exit(), os._exit() or a binary that
                # records nothing; exitcode says the rest.
                self.error_file_data["errorTraits"] = dict(_NO_ERROR_FILE_TRAITS)
                self.message = _NO_ERROR_FILE_MESSAGE

    def _read_error_file(self) -> None:
        # O_NOFOLLOW: a link put there since the check above is not followed.
        with open(os.open(self.error_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) as f:
            data = json.load(f)
        message = data["message"]
        if isinstance(message, str):
            self.message = message
            self.timestamp = int(data.get("timestamp", 0))
        else:
            self.message = str(message["message"])
            self.timestamp = int(message["extraInfo"]["timestamp"])
        self.error_file_data = data

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time, ``YYYY-MM-DD_HH:MM:SS`` (what torch's
        ``ChildFailedError`` shows)."""
        return datetime.datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def signal_name(self) -> str:
        """``SIGSEGV`` for a rank killed by signal 11; ``<N/A>`` for one
        that exited, or died by a signal without a name (as in torch)."""
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                pass
        return _NOT_AVAILABLE


@dataclass
class RunProcsResult:
    """What ``wait`` returns: all succeeded, or the failure(s) that ended the
    run; after a failure, ``rank_stacks`` (fastspawn's addition) holds the
    Python stacks of the ranks that still ran then, by local rank."""

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    rank_stacks: dict[int, str] = field(default_factory=dict, repr=False)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


def _validate_full_rank(mapping: Mapping[int, Any], nprocs: int, what: str) -> None:
    actual = set(mapping)
    expected = set(range(nprocs))
    if actual != expected:
        raise RuntimeError(
            f"{what}, local rank mapping mismatch, expected: {sorted(expected)}, "
            f"actual: {sorted(actual, key=str)}"
        )


def _resolve_binary(entrypoint: str, env: Mapping[str, str]) -> str:
    """The path to exec, or FileNotFoundError / PermissionError naming it.

    OSError's str() appends the filename (``[Errno 2] text: 'path'``), so the
    text leaves the path out and says what to do instead.
    """
    if "/" in entrypoint:
        path = entrypoint
        if not os.path.exists(path):
            raise FileNotFoundError(
                errno.ENOENT,
                "binary not found (check the path, or give a name to look up on PATH)",
                path,
            )
    else:
        search = env.get("PATH", os.defpath)
        found = shutil.which(entrypoint, path=search)
        if found is None:
            raise FileNotFoundError(
                errno.ENOENT,
                f"binary not found on PATH={search} (give its full path, or add its "
                "directory to PATH)",
                entrypoint,
            )
        path = found
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise PermissionError(
            errno.EACCES,
            "not an executable file (chmod +x it, or give the path of a binary)",
            path,
        )
    return path


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _open_log(path: str) -> int:
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
            _rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs, shown)
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


class PContext:
    """The ranks of one ``start_processes`` call."""

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, Sequence[Any]],
        envs: Mapping[int, Mapping[str, str]],
        stdouts: Mapping[int, str],
        stderrs: Mapping[int, str],
        tee_stdouts: Mapping[int, bool],
        tee_stderrs: Mapping[int, bool],
        error_files: Mapping[int, str],
        start_method: str,
        log_line_prefixes: Mapping[int, str] | None,
        binary_path: str | None = None,
        filtered: Mapping[str, tuple[str, Sequence[str]]] | None = None,
        numa: _numa.NumaBinding | None = None,
        stacks: bool = True,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = dict(args)
        self.envs = {rank: dict(env) for rank, env in envs.items()}
        self.nprocs = len(args)
        self.stdouts = dict(stdouts)
        self.stderrs = dict(stderrs)
        self.tee_stdouts = dict(tee_stdouts)
        self.tee_stderrs = dict(tee_stderrs)
        self.error_files = dict(error_files)
        self.start_method = start_method
        self.log_line_prefixes = dict(log_line_prefixes or {})
        # The resolved binary (start_processes resolves it before it creates
        # any file); start() resolves it when None.
        self._binary_path = binary_path
        # "stdout"/"stderr" -> (file, needles): the filtered copy of the
        # tee'd ranks' lines (torch's duplicate_*_filters), its file made at
        # start, by it (removed again if the start fails).
        self.filtered = {
            console: (path, list(needles)) for console, (path, needles) in (filtered or {}).items()
        }
        self._line_filters: dict[str, LineFilter] = {}
        self.numa = numa  # numa_options, checked: see _numa
        self.stacks = stacks
        self._ctx: _context.ProcessContext | None = None
        self._tee = Tee()
        self._result: RunProcsResult | None = None

    def __repr__(self) -> str:
        return (
            f"<fastspawn.elastic.PContext name={self.name!r} nprocs={self.nprocs} "
            f"pids={self.pids()}>"
        )

    # ------------------------------------------------------------- start

    def start(self) -> None:
        """Install the SignalException handlers (main thread only), then
        start every rank.

        On failure nothing is left open: no pipe, no log file handle, no
        rank (the log files themselves are for the caller to remove).
        """
        if threading.current_thread() is threading.main_thread():
            for sig in _HANDLED_SIGNALS:
                signal.signal(sig, _raise_signal_exception)
        else:
            log.warning(
                "start_processes called from a thread other than the main one: no "
                "SignalException handlers installed"
            )
        made: list[str] = []  # the filtered copies' files this start created
        try:
            if isinstance(self.entrypoint, str) and self._binary_path is None:
                self._binary_path = _resolve_binary(
                    self.entrypoint, {**os.environ, **self.envs.get(0, {})}
                )
            self._open_filters(made)
            stdio, child_fds = self._open_stdio()
            try:
                self._ctx = _context.launch_context(self._request(stdio))
            finally:
                for fd in child_fds:
                    os.close(fd)
            self._tee.start()
        except BaseException:
            if self._ctx is not None:  # the ranks run, but their output has no reader
                self.close(signal.SIGKILL)
            self._tee.close()
            for path in made:
                _remove_file(path)
            raise
        _live_contexts.add(self)

    def _open_filters(self, made: list[str]) -> None:
        """Create the filtered copies' files (see ``filtered``), owned by
        the Tee from then on; append each path made to ``made``."""
        for console, (path, needles) in self.filtered.items():
            if not needles or path == os.devnull:
                continue
            file = open(_open_log(path), "wb")
            made.append(path)
            self._line_filters[console] = self._tee.add_filter(file, needles)

    def _prefix(self, rank: int) -> str:
        return self.log_line_prefixes.get(rank, f"[{self.name}{rank}]:")

    def _open_stdio(self) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """Per rank (stdout fd, stderr fd) for the child; the fds to close
        here once the children have their copies."""
        stdio: dict[int, tuple[int, int]] = {}
        child_fds: list[int] = []
        try:
            for rank in range(self.nprocs):
                pair = []
                for path, tee, console in (
                    (self.stdouts[rank], self.tee_stdouts.get(rank, False), "stdout"),
                    (self.stderrs[rank], self.tee_stderrs.get(rank, False), "stderr"),
                ):
                    if not path and not tee:
                        pair.append(-1)
                        continue
                    if tee:
                        read_end, write_end = os.pipe2(os.O_CLOEXEC)
                        child_fds.append(write_end)
                        try:
                            log_file: BinaryIO | None = (
                                open(_open_log(path), "wb") if path and path != os.devnull else None
                            )
                        except BaseException:
                            os.close(read_end)
                            raise
                        # The tee owns read_end and log_file from here on.
                        self._tee.add(
                            read_end,
                            log_file,
                            console,
                            self._prefix(rank),
                            self._line_filters.get(console),
                        )
                        pair.append(write_end)
                    else:
                        fd = _open_log(path)
                        child_fds.append(fd)
                        pair.append(fd)
                stdio[rank] = (pair[0], pair[1])
        except BaseException:
            for fd in child_fds:
                os.close(fd)
            raise
        return stdio, child_fds

    def _request(self, stdio: dict[int, tuple[int, int]]) -> _launch.LaunchRequest:
        binary: tuple[str, dict[int, list[str]]] | None = None
        if isinstance(self.entrypoint, str):
            binary = self._binary_argvs()
            fn: Callable[..., Any] = exec_binary
            fn_args: tuple[Any, ...] = binary
            method = registry.get(registry.DEFAULT)  # the zygote adopts orphans
        else:
            fn = run_function
            fn_args = (self.entrypoint, self.args, self.numa)
            method = registry.get(self.start_method)
        return _launch.LaunchRequest(
            fn=fn,
            args=fn_args,
            nprocs=self.nprocs,
            daemon=False,
            method=method,
            envs=self.envs,
            stdio=stdio,
            process_group=binary is None,
            # A binary reads the launcher's stdin, as under torch's
            # subprocess handler; function ranks read /dev/null.
            keep_stdin=binary is not None,
            binary=binary,
            stacks=self.stacks,
        )

    def _binary_argvs(self) -> tuple[str, dict[int, list[str]]]:
        """What each binary rank execs: the binary, or numactl running it
        where the ranks are bound (as torch runs them)."""
        assert self._binary_path is not None, "resolved in start()"
        argvs = {
            rank: [str(self.entrypoint), *(str(a) for a in self.args[rank])]
            for rank in range(self.nprocs)
        }
        if self.numa is None or not self.numa.numactl:
            return self._binary_path, argvs
        return self.numa.numactl, {
            rank: self.numa.wrap_argv(rank, [self._binary_path, *argv[1:]])
            for rank, argv in argvs.items()
        }

    # -------------------------------------------------------------- wait

    def pids(self) -> dict[int, int]:
        """``{rank: pid}``."""
        if self._ctx is None:
            return {}
        return dict(enumerate(self._ctx.pids()))

    def dump_stacks(self, timeout: float = _stacks.DEMAND_TIMEOUT) -> dict[int, str]:
        """``{rank: text}``: the Python stacks of every thread of each rank
        still running, taken without stopping it (see
        :meth:`fastspawn.ProcessContext.dump_stacks`).  A binary rank has
        none: it gets a line on its state in the kernel instead."""
        if self._ctx is None:
            return {}
        return self._ctx.dump_stacks(timeout)

    def _poll(self, timeout: float | None) -> RunProcsResult | None:
        assert self._ctx is not None, "start() first"
        if self._result is not None:
            return self._result
        try:
            done = self._ctx.join(timeout=timeout)
        except ProcessException as exc:
            # The other ranks are stopped and every rank is reaped.
            self._tee.join(idle_timeout=5.0)
            _forget_context(self)
            self._result = RunProcsResult(
                failures=self._failures(exc),
                stdouts=self.stdouts,
                stderrs=self.stderrs,
                rank_stacks=exc.rank_stacks,
            )
            return self._result
        if not done:
            return None
        self._tee.join(idle_timeout=5.0)
        _forget_context(self)
        self._result = self._success()
        return self._result

    def _failures(self, exc: ProcessException) -> dict[int, ProcessFailure]:
        """The failures to report once ``exc`` (the first rank to fail) ended
        the run, as torch reports them: that rank alone for function ranks;
        for binaries also every other rank that did not end with exit code
        0 (stopped by the SIGTERM that followed the failure, most often:
        exit code -15)."""
        assert self._ctx is not None
        first = self._ctx.processes[exc.error_index]
        ranks = [first]
        if isinstance(self.entrypoint, str):
            ranks += [p for p in self._ctx.processes if p is not first and p.exitcode != 0]
        failures = {}
        for proc in ranks:
            code = proc.exitcode
            failures[proc.rank] = ProcessFailure(
                local_rank=proc.rank,
                pid=proc.pid,
                exitcode=code if code is not None else 1,
                error_file=self.error_files[proc.rank],
                # Where the others were when the first failed: its alone.
                rank_stacks=exc.rank_stacks if proc is first else {},
            )
        return failures

    def _success(self) -> RunProcsResult:
        """The result once every rank has exited 0."""
        assert self._ctx is not None
        if isinstance(self.entrypoint, str):
            values: dict[int, Any] = dict.fromkeys(range(self.nprocs))
        else:
            values = dict(self._ctx.return_values)
            for rank in range(self.nprocs):
                values.setdefault(rank, None)
        return RunProcsResult(return_values=values, stdouts=self.stdouts, stderrs=self.stderrs)

    def _closed_result(self) -> RunProcsResult:
        """The result of ranks that close() ended, all reaped: every rank
        that ended non-zero (killed by the close signal, most often) is a
        failure; a success only if every rank had exited 0."""
        assert self._ctx is not None
        failures = {}
        for proc in self._ctx.processes:
            code = proc.exitcode
            if code != 0:
                failures[proc.rank] = ProcessFailure(
                    local_rank=proc.rank,
                    pid=proc.pid,
                    exitcode=-signal.SIGKILL if code is None else code,
                    error_file=self.error_files[proc.rank],
                )
        if not failures:
            return self._success()
        return RunProcsResult(failures=failures, stdouts=self.stdouts, stderrs=self.stderrs)

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait for all ranks to succeed or any to fail.

        Args:
            timeout: seconds; 0 polls once, a negative value (or ``inf``)
                waits for ever.
            period: accepted for compatibility; fastspawn waits on events
                rather than polling, so it is not used.

        Returns:
            The result, or None if ``timeout`` ran out first.  After a
            failure the other ranks have been stopped.

        Raises:
            TypeError, ValueError: ``timeout`` is not a number, or nan.
        """
        seconds = checked_seconds(timeout, "timeout", none_allowed=False)
        assert seconds is not None
        if seconds == 0:
            return self._poll(0)
        deadline = None if seconds < 0 or seconds == math.inf else time.monotonic() + seconds
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            result = self._poll(left)
            if result is not None:
                return result

    # ------------------------------------------------------------- close

    def close(self, death_sig: signal.Signals | int | None = None, timeout: float = 30) -> None:
        """Stop every rank: ``death_sig`` (SIGTERM by default) to each, to its
        whole process group for binaries; after ``timeout`` seconds in all,
        SIGKILL; then reap.

        A later ``wait`` reports the ranks that did not end with exit code 0
        as failures (``exitcode`` minus the signal for a killed rank), unless
        it had returned a result before the close.

        Raises:
            TypeError, ValueError: ``timeout`` is not a number, or nan
                (``inf``: no SIGKILL, however long the ranks take).
        """
        limit = checked_seconds(timeout, "timeout", none_allowed=False)
        assert limit is not None
        if self._ctx is None:
            return
        _forget_context(self)
        sig = signal.SIGTERM if death_sig is None else death_sig
        procs = [p for p in self._ctx.processes if p._exitcode is None]
        self._stop_ranks(procs, sig, limit)
        self._drain_join_reports()
        self._tee.join(idle_timeout=5.0)
        if self._result is None:
            self._result = self._closed_result()

    def _stop_ranks(self, procs: list[Any], sig: signal.Signals | int, timeout: float) -> None:
        """``sig`` to each of ``procs``; SIGKILL to those still alive after
        ``timeout`` seconds in all; then reap them all."""
        for proc in procs:
            self._signal(proc, sig)
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                log.warning(
                    "rank %d (pid %d) ignored %s; sending SIGKILL", proc.rank, proc.pid, sig
                )
                self._signal(proc, signal.SIGKILL)
        for proc in procs:
            proc.join()

    def _drain_join_reports(self) -> None:
        """Let the ranks' context report every rank done, once all are reaped."""
        assert self._ctx is not None
        # Every rank is reaped: join() now raises once for each rank that
        # ended badly, then returns True.  It never blocks here (timeout=0);
        # the bound, twice what that takes, only guards against a spin.
        for _ in range(2 * self.nprocs + 2):
            try:
                if self._ctx.join(timeout=0):
                    break
            except ProcessException:
                pass  # stopped on purpose; _closed_result reports it
        else:
            log.warning("close(): the ranks' context did not report them all done")

    def _kill_now(self) -> None:
        """SIGKILL every rank not known to have exited (a binary rank's
        whole session), waiting for nothing and reading no state: safe in a
        signal handler that interrupts ``close()``."""
        if self._ctx is None:
            return
        for proc in self._ctx.processes:
            if isinstance(self.entrypoint, str) and proc._exitcode is None:
                try:
                    # It leads its own session; unreaped, its pid (the
                    # group's id) cannot have gone to anyone else.
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass  # gone already
            proc._signal(signal.SIGKILL)

    def _signal(self, proc: Any, sig: int) -> None:
        if isinstance(self.entrypoint, str) and proc._exitcode is None and proc.is_alive():
            try:
                os.killpg(proc.pid, sig)  # its own session: reach its children
                return
            except (ProcessLookupError, PermissionError):
                pass
        proc._signal(sig)


@atexit.register
def _close_after_signal() -> None:
    """At interpreter exit after a SignalException (one left uncaught, most
    often), close every context still live with that signal: SPEC section 3,
    no worker outlives a signalled launcher.  Without this, _context's exit
    hook would wait for the ranks to end by themselves.

    Registered when this module is imported, after _context (imported
    above) registered its hook, so it runs first: atexit is LIFO.
    """
    to_close = [(ctx, sig) for ctx, sig in _signalled.items() if ctx in _live_contexts]
    if not to_close:
        return
    # A second signal now ends the launcher at once (the ranks die with it,
    # PR_SET_PDEATHSIG) rather than raising in the middle of the close.
    for handled in _HANDLED_SIGNALS:
        try:
            if signal.getsignal(handled) is _raise_signal_exception:
                signal.signal(handled, signal.SIG_DFL)
        except ValueError:  # not the main thread
            break
    for context, sig in to_close:
        try:
            context.close(sig)
        except Exception:
            log.exception("fastspawn: could not close %r at exit after %s", context, sig.name)


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, Sequence[Any]],
    envs: Mapping[int, Mapping[str, str]],
    log_dir: str | os.PathLike[str] | LogsSpecs | None = None,
    start_method: registry.StartMethodName | None = registry.DEFAULT,
    redirects: Std | Mapping[int, Std] = Std.NONE,
    tee: Std | Mapping[int, Std] = Std.NONE,
    log_line_prefixes: Mapping[int, str] | None = None,
    *,
    logs_specs: LogsSpecs | None = None,
    duplicate_stdout_filters: Sequence[str] | None = None,
    duplicate_stderr_filters: Sequence[str] | None = None,
    numa_options: Any = None,
    stacks: bool = True,
) -> PContext:
    """Start ``len(args)`` copies of ``entrypoint``, a function or a binary.

    Logs are given either way torch has taken them: ``log_dir`` with
    ``redirects`` and ``tee`` (torch before 2.3), or a ``logs_specs`` object
    (torch 2.3 and later; in the fifth place, or by keyword).

    Args:
        name: a short name, shown in tee'd lines as ``[{name}{rank}]:``.
        entrypoint: a callable (``entrypoint(*args[rank])``) or a binary path
            or name (``args[rank]`` converted with ``str()``).
        args: per rank, the entrypoint's arguments, keyed exactly ``0..n-1``.
        envs: per rank, the variables set in it, keyed exactly ``0..n-1``.
        log_dir: an existing, empty directory (or ``os.devnull`` for no
            files); each rank gets ``{rank}/stdout.log`` and ``stderr.log``
            there for the streams redirected or tee'd, and ``error.json``
            if a function rank fails, created 0600.
        start_method: for function ranks (``None``, as in torch: the
            method multiprocessing uses by default); binaries always start
            from the zygote, which adopts and kills what their children
            leave.
        redirects: streams written to the rank's log file.
        tee: streams written to the log file and shown on the console.
        log_line_prefixes: per rank prefix in place of ``[{name}{rank}]:``.
        logs_specs: in place of ``log_dir``, ``redirects`` and ``tee``: a
            ``LogsSpecs`` (``DefaultLogsSpecs``, torch's own, or any object
            with torch's ``reify(envs) -> LogsDest``).  Ranks without an
            error file in its ``LogsDest`` get an empty
            ``TORCHELASTIC_ERROR_FILE``.
        duplicate_stdout_filters: as in torch: when not empty, every
            stdout line of the ranks tee'd to the console that contains any
            of these strings is also written, with its prefix, to one file
            for all ranks: the ``LogsDest``'s ``filtered_stdout`` (with
            ``log_dir``: ``{log_dir}/filtered_stdout.log``).
        duplicate_stderr_filters: the same for stderr lines, into
            ``filtered_stderr`` (``{log_dir}/filtered_stderr.log``).
        numa_options: torch's ``NumaOptions`` (or an object with its
            ``affinity_mode`` and ``should_fall_back_if_binding_fails``):
            bind rank ``i`` to the CPUs near GPU ``i`` as torch defines it
            (see ``fastspawn._numa``); function ranks bind themselves
            before the function runs, binaries run through ``numactl``.
            Checked here first: where it cannot apply (no NUMA information,
            no torch, fewer GPUs than ranks, no ``numactl`` for binaries)
            ``RuntimeError``, or with ``should_fall_back_if_binding_fails``
            a warning and no binding.
        stacks: function ranks arm a dump of their Python stacks, so that
            a failure records where the other ranks were
            (``RunProcsResult.rank_stacks``, ``ProcessFailure.rank_stacks``,
            a WARNING) and :meth:`PContext.dump_stacks` works; binary ranks
            get a line on their kernel state.  False: none of it.

    Raises:
        TypeError: both or neither of ``log_dir`` and ``logs_specs``, or
            ``redirects``/``tee`` given beside ``logs_specs``.
        RuntimeError: ``args``/``envs`` keys are not ``0..n-1``, or
            ``log_dir`` is not empty.
        NotADirectoryError, FileNotFoundError: ``log_dir`` is a file or
            missing.
        ValueError: a ``LogsDest`` tees a rank's stream from a file other
            than the one the stream is written to.
        FileExistsError: a log file the ``LogsDest`` names exists already.
        FileNotFoundError, PermissionError: the binary cannot be found or run.
        ValueError: an unknown ``start_method`` (the message lists the valid
            ones), more ranks than the limits on processes or open files
            allow (the message names the limit), or filters given where the
            ``LogsDest`` names no filtered file.
        TypeError: a filter list that is a string, or holds a non-string.
        RuntimeError: ``numa_options`` cannot apply here (see above).
    """
    # Before anything is made: an unknown one names the valid ones.
    method_name = registry.get(start_method).name
    directory, logs_specs = _checked_log_args(log_dir, logs_specs, redirects, tee)
    nprocs = len(args)
    _limits.check_nprocs(nprocs, f"a launch of {nprocs} ranks (len(args))")
    _validate_full_rank(args, nprocs, "args")
    _validate_full_rank(envs, nprocs, "envs")
    if isinstance(redirects, str) or isinstance(tee, str):
        raise TypeError("redirects and tee take Std values or maps; use Std.from_str for strings")
    filters = {
        "stdout": _checked_filters(duplicate_stdout_filters, "duplicate_stdout_filters"),
        "stderr": _checked_filters(duplicate_stderr_filters, "duplicate_stderr_filters"),
    }
    rank_envs = {rank: {k: str(v) for k, v in envs[rank].items()} for rank in range(nprocs)}
    binary_path = None
    rank0_env = {**os.environ, **rank_envs.get(0, {})}
    if isinstance(entrypoint, str):
        # Before any file is created: a missing binary leaves nothing behind.
        binary_path = _resolve_binary(entrypoint, rank0_env)
    numa = None
    if numa_options is not None:
        numa = _numa.binding(numa_options, nprocs, binary_path, rank0_env)
    rank_dirs: list[str] = []  # created by this call: removed if the start fails
    try:
        dest = _logs_dest(directory, logs_specs, redirects, tee, rank_envs, rank_dirs)
        stdouts = {rank: dest.stdouts.get(rank, "") for rank in range(nprocs)}
        stderrs = {rank: dest.stderrs.get(rank, "") for rank in range(nprocs)}
        tee_out = _tee_flags(dest.tee_stdouts, stdouts, "stdout")
        tee_err = _tee_flags(dest.tee_stderrs, stderrs, "stderr")
        error_files = {rank: dest.error_files.get(rank, os.devnull) for rank in range(nprocs)}
        for rank, path in error_files.items():
            rank_envs[rank].setdefault(ERROR_FILE_ENV, "" if path == os.devnull else path)
        context = PContext(
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=rank_envs,
            stdouts=stdouts,
            stderrs=stderrs,
            tee_stdouts=tee_out,
            tee_stderrs=tee_err,
            error_files=error_files,
            start_method=method_name,
            log_line_prefixes=log_line_prefixes,
            binary_path=binary_path,
            filtered=_filtered_copies(dest, filters),
            numa=numa,
            stacks=stacks,
        )
        context.start()  # leaves no fd and no rank behind when it fails
    except BaseException:
        for rank_dir in rank_dirs:
            shutil.rmtree(rank_dir, ignore_errors=True)
        raise
    return context


def _checked_filters(filters: Sequence[str] | None, what: str) -> list[str]:
    """``filters`` as a list of strings (None: none).  A string would be
    taken one character at a time: refused."""
    if filters is None:
        return []
    if isinstance(filters, (str, bytes)) or not all(isinstance(f, str) for f in filters):
        raise TypeError(f"{what} takes a list of strings, got {filters!r:.80}")
    return list(filters)


def _filtered_copies(
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


def _checked_log_args(
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
    if directory is not None and directory != os.devnull and os.listdir(directory):
        raise RuntimeError(f"log_dir: {directory} is not empty, please provide an empty log_dir")
    return directory, logs_specs


def _logs_dest(
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
        _rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs)
    return dest


def _rank_files(
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


def _tee_flags(
    tee_files: Mapping[int, str], files: Mapping[int, str], what: str
) -> dict[int, bool]:
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
