"""PContext: the ranks of one ``start_processes`` call, their logs and tee,
waited for and closed; and the ranks left live when a signal ended the
launcher, closed at exit."""

from __future__ import annotations

import atexit
import errno
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO

from fastspawn._launch import api as launch_api
from fastspawn._launch import context as _context
from fastspawn._launch import stacks as _stacks
from fastspawn._launch.errors import ProcessException
from fastspawn._launch.methods import base, registry
from fastspawn._launch.process import checked_seconds
from fastspawn._os import numa as _numa
from fastspawn._worker.elastic_rank import exec_binary, run_function
from fastspawn.elastic.api import ProcessFailure, RunProcsResult, SignalException
from fastspawn.elastic.logs import open_log, remove_file
from fastspawn.elastic.tee import LineFilter, Tee

log = logging.getLogger(__name__)


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


def note_signal(sigval: signal.Signals) -> None:
    """Mark every live context to be closed with ``sigval`` at interpreter
    exit, should the exception a handler raises for it escape the caller."""
    for context in _live_contexts:
        _signalled.setdefault(context, sigval)


def _raise_signal_exception(signum: int, frame: Any) -> None:
    sigval = signal.Signals(signum)
    note_signal(sigval)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def resolve_binary(entrypoint: str, env: Mapping[str, str]) -> str:
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


def fds_per_rank(
    stdouts: Mapping[int, str],
    stderrs: Mapping[int, str],
    tee_stdouts: Mapping[int, bool],
    tee_stderrs: Mapping[int, bool],
) -> int:
    """The most fds the launcher holds for one rank at once while the ranks
    start (see ``PContext._open_stdio``): its pidfd, and per stream a pipe
    and a log file where it is tee'd, a log file where it is redirected."""

    def stream(path: str, tee: bool) -> int:
        if tee:
            return 2 + (1 if path and path != os.devnull else 0)
        return 1 if path else 0

    return 1 + max(
        (
            stream(stdouts[rank], tee_stdouts.get(rank, False))
            + stream(stderrs[rank], tee_stderrs.get(rank, False))
            for rank in stdouts
        ),
        default=0,
    )


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
        self.numa = numa  # numa_options, checked: see fastspawn._os.numa
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
                self._binary_path = resolve_binary(
                    self.entrypoint, {**os.environ, **self.envs.get(0, {})}
                )
            self._open_filters(made)
            stdio, child_fds = self._open_stdio()
            try:
                self._ctx = launch_api.launch_context(self._request(stdio))
            finally:
                for fd in child_fds:
                    os.close(fd)
            self._tee.start()
        except BaseException:
            if self._ctx is not None:  # the ranks run, but their output has no reader
                self.close(signal.SIGKILL)
            self._tee.close()
            for path in made:
                remove_file(path)
            raise
        _live_contexts.add(self)

    def _open_filters(self, made: list[str]) -> None:
        """Create the filtered copies' files (see ``filtered``), owned by
        the Tee from then on; append each path made to ``made``."""
        for console, (path, needles) in self.filtered.items():
            if not needles or path == os.devnull:
                continue
            file = open(open_log(path), "wb")
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
                                open(open_log(path), "wb") if path and path != os.devnull else None
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
                        fd = open_log(path)
                        child_fds.append(fd)
                        pair.append(fd)
                stdio[rank] = (pair[0], pair[1])
        except BaseException:
            for fd in child_fds:
                os.close(fd)
            raise
        return stdio, child_fds

    def _request(self, stdio: dict[int, tuple[int, int]]) -> base.LaunchRequest:
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
        return base.LaunchRequest(
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
    no worker outlives a signalled launcher.  Without this, the launches'
    exit hook (fastspawn._launch.exiting) would wait for the ranks to end
    by themselves.

    Registered when this module is imported, after that hook (imported
    with the launch API above), so it runs first: atexit is LIFO.
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
