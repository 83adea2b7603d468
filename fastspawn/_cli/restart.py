"""``fastspawn run``'s run: the group of ranks started, watched, and
started again after a failure up to ``--max-restarts`` times; the
launcher's exit status; the signals that stop it."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator

from fastspawn import elastic
from fastspawn._cli import stacks as cli_stacks
from fastspawn._cli import topology
from fastspawn._cli.logdir import (
    LogDir,
    LogDirError,
    check_agent_log_dir,
    make_temporary_log_dir,
    open_log_dir,
    remove_created,
)
from fastspawn._cli.topology import (
    NumaMode,
    Program,
    RunConfig,
    check_program,
    program_of,
    resolve_nprocs,
    run_config,
    wants_agent,
)
from fastspawn._launch import context as launch_context
from fastspawn._launch.methods import helpers
from fastspawn._os import limits as _limits
from fastspawn._os import numa as _numa
from fastspawn.elastic import logs as elastic_logs


def describe(failure: elastic.ProcessFailure, global_rank: int) -> str:
    """The one-line summary of a failed rank."""
    if failure.exitcode < 0:
        cause = f"was killed by signal {failure.signal_name()}"
    else:
        cause = f"failed with exit code {failure.exitcode}"
    detail = ""
    if failure.error_file != "<N/A>":
        # The message may be a whole traceback: keep the summary one line,
        # and say where the rest is.
        lines = [line.strip() for line in failure.message.splitlines() if line.strip()]
        if lines:
            detail = f": {lines[0]}"
            if len(lines) > 1:
                detail += f" (+{len(lines) - 1} more lines in {failure.error_file})"
    return (
        f"fastspawn run: rank {global_rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{cause}{detail}"
    )


def exit_code(code: int) -> int:
    return 128 - code if code < 0 else (code or 1)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _StopSignals:
    """The launcher's handlers for the stop signals while one attempt's ranks
    run: the first raises SignalException, as elastic's own handlers do; a
    later one, while ``stop`` closes the ranks, SIGKILLs every rank at once.

    elastic's handlers raise at every signal, and one raised in the middle of
    close() abandons it (and leaves the ranks to end by themselves).  The
    handler notes the first signal before it raises, so a second one that
    comes at once (a tty's Ctrl-C beside a wrapper's SIGTERM) already finds
    it: there is no moment in which it would raise again.
    """

    def __init__(self, ctx: elastic.PContext) -> None:
        self.ctx = ctx
        self.first: signal.Signals | None = None
        self.closed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # elastic installed none either
        for sig in _STOP_SIGNALS:
            signal.signal(sig, functools.partial(self._handle, signal.getsignal(sig)))

    def _handle(self, previous: object, signum: int, frame: object) -> None:
        if self.first is None:
            self.first = signal.Signals(signum)
            if callable(previous):
                # elastic's handler: it raises, and marks the ranks to be
                # closed at exit should the exception escape us.
                previous(signum, frame)
            raise elastic.SignalException(
                f"Process {os.getpid()} got signal: {self.first}", sigval=self.first
            )
        if self.closed:
            return  # the launcher is on its way out with 128+the first signal
        try:
            # No print() in a handler: it may interrupt a print of the main code.
            os.write(2, b"fastspawn run: got another signal, killing every rank\n")
        except OSError:
            pass
        # Each rank, and a binary rank's whole session (its children); a
        # Python rank's children die with it (the zygote kills orphans).
        self.ctx._kill_now()

    def stop(self, sigval: signal.Signals) -> None:
        """Stop every rank after the launcher got ``sigval``: that signal to
        each rank's process group, SIGKILL after 10 s, or at once on a
        second signal.  The handlers stay, doing nothing, after the close."""
        if self.first is None:  # raised by elastic's handler, before install()
            self.first = sigval
            self.install()
        print(f"fastspawn run: got {sigval.name}, stopping every rank", file=sys.stderr)
        try:
            self.ctx.close(sigval, timeout=10)
        finally:
            self.closed = True


def _later_signals_do_nothing() -> None:
    """A first stop signal decided the exit status and no rank is left to
    stop: later ones do nothing, as _StopSignals's do after its close.
    elastic's handlers, in place outside an attempt's run, would raise from
    the launcher's way out (a SIGTERM right behind a SIGINT, landing as
    run_attempts put the SIGUSR1 handler back: a traceback and exit 1)."""
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            signal.signal(sig, _do_nothing)


def _do_nothing(signum: int, frame: object) -> None:
    pass


def first_signal(exc: elastic.SignalException) -> signal.Signals:
    """The stop signal that came first.  Before the launcher's own handlers
    are in place (_StopSignals), each signal raises: one that comes while
    the first one's exception is handled (the start of the ranks stopping
    what it had started, a Ctrl-C beside a wrapper's SIGTERM) raises again
    from there, and its exception, which Python chains to the first one's
    (``__context__``), is the one that arrives here.  The first decides the
    exit status, as once the handlers are in place."""
    first = exc.sigval
    seen: set[int] = set()
    cause: BaseException | None = exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, elastic.SignalException):
            first = cause.sigval
        cause = cause.__context__
    return first


def run(args: argparse.Namespace) -> int:
    try:
        program = program_of(args)
        if wants_agent(args):
            return run_with_agent(args, program)
        config = run_config(args, os.environ, program)
        try:
            check_program(program)
        except OSError as exc:
            return _cannot_start(program.name, exc)
        if config.numa is not None and (problem := _numa_problem(config.numa, config)):
            print(f"fastspawn run: --numa-binding {problem}", file=sys.stderr)
            return 1
        log_dir = open_log_dir(args)
        if program.preload:
            helpers.preload(program.preload)  # imported there while we go on
        return run_attempts(config, log_dir)
    except LogDirError as exc:
        print(exc, file=sys.stderr)
        return 2


def _numa_problem(numa: NumaMode, config: RunConfig) -> str | None:
    """Why --numa-binding cannot bind the ranks here (no NUMA information,
    no torch to find the GPUs, fewer GPUs than ranks, no numactl for a
    binary), or None: said before anything starts, not as a traceback from
    the first attempt."""
    binary = config.entrypoint if isinstance(config.entrypoint, str) else None
    try:
        _numa.binding(numa, config.nprocs, binary, os.environ)
    except RuntimeError as exc:
        return f"{numa.affinity_mode}: {exc}"
    return None


def _dynamic_rendezvous(args: argparse.Namespace) -> str:
    """The option that asked for torch's agent, as given."""
    if args.standalone:
        return "--standalone"
    if args.rdzv_backend != "static":
        return f"--rdzv-backend {args.rdzv_backend}"
    return f"--nnodes {args.nnodes}"


@contextlib.contextmanager
def _agent_log_dir(args: argparse.Namespace) -> Iterator[tuple[str, bool]]:
    """Where torch's agent puts its logs, and whether they stay: --log-dir;
    else a new private temporary directory, named on stderr and kept when
    --redirects or --tee asks for log files, removed at the end otherwise
    (it holds the ranks' error files only, read by then; torchrun would
    leave one behind per run)."""
    if args.log_dir is not None:
        # Torch's own DefaultLogsSpecs takes it as it is: checked here.
        check_agent_log_dir(args.log_dir)
        yield args.log_dir, True
        return
    temporary = make_temporary_log_dir()
    keep = args.redirects != elastic.Std.NONE or args.tee != elastic.Std.NONE
    if keep:
        print(f"fastspawn run: logs in {temporary}", file=sys.stderr)
    try:
        yield temporary, keep
    finally:
        if not keep:
            shutil.rmtree(temporary, ignore_errors=True)


def run_with_agent(args: argparse.Namespace, program: Program) -> int:
    """A dynamic rendezvous: torch's elastic agent runs the job, fastspawn
    starts its workers (fastspawn._torch.torchrun); the launcher's exit status."""
    from fastspawn._torch import agent as _agent
    from fastspawn._torch import torchrun as _torchrun

    nprocs = resolve_nprocs(args.nproc_per_node)
    # SIGUSR1 and --hang-timeout as on the static path, at each of the
    # agent's looks at its workers (see cli_stacks.agent_watch).
    requests = cli_stacks.DumpRequests() if args.stacks else None
    if requests is not None:
        requests.install()
    try:
        check_program(program)
        with _agent_log_dir(args) as (log_dir, kept):
            watch = cli_stacks.agent_watch(requests, args.hang_timeout, args.hang_action, kept)
            outcome = _torchrun.run(
                args,
                nprocs,
                program.entrypoint,
                program.argv,
                program.preload,
                log_dir,
                _agent.GroupOptions(stacks=args.stacks, watch=watch),
            )
    except cli_stacks.HangStop:
        return cli_stacks.HANG_EXIT  # the agent stopped every rank
    except _torchrun.TorchMissing as exc:
        option = _dynamic_rendezvous(args)
        print(
            f"fastspawn run: {option} runs torch's elastic agent, which needs torch "
            f"({exc}); install torch, or use the static rendezvous in place of {option}, "
            "which does not: --nnodes N --node-rank R --master-addr HOST --master-port PORT",
            file=sys.stderr,
        )
        return 2
    except _torchrun.AgentError as exc:
        print(f"fastspawn run: the rendezvous failed: {exc}", file=sys.stderr)
        return 1
    except elastic.SignalException as exc:
        _later_signals_do_nothing()  # the agent stopped every rank
        first = first_signal(exc)
        print(f"fastspawn run: got {first.name}, stopped every rank", file=sys.stderr)
        return 128 + int(first)
    except OSError as exc:
        return _cannot_start(program.name, exc)
    finally:
        if requests is not None:
            requests.uninstall()
    if outcome is None:
        return 0
    global_rank, failure = outcome
    print(describe(failure, global_rank), file=sys.stderr)
    return exit_code(failure.exitcode)


def run_attempts(config: RunConfig, log_dir: LogDir | None) -> int:
    """Run the group, again after a failure up to --max-restarts times; the
    launcher's exit status."""
    requests = cli_stacks.DumpRequests() if config.stacks else None
    # The ranks' stacks at a failure: shown by run_attempt, with global ranks.
    drop = cli_stacks.DropStacksRecord()
    context_log = logging.getLogger(launch_context.LOGGER_NAME)
    context_log.addFilter(drop)
    if requests is not None:
        requests.install()
    try:
        return _run_attempts(config, log_dir, requests)
    finally:
        if requests is not None:
            requests.uninstall()
        context_log.removeFilter(drop)


def _run_attempts(
    config: RunConfig, log_dir: LogDir | None, requests: cli_stacks.DumpRequests | None
) -> int:
    try:
        for attempt in range(config.max_restarts + 1):
            outcome = run_attempt(config, log_dir, attempt, requests)
            if isinstance(outcome, int):
                return outcome
            if attempt < config.max_restarts:
                print(
                    f"fastspawn run: restarting the group ({attempt + 1}/{config.max_restarts})",
                    file=sys.stderr,
                )
                continue
            return exit_code(outcome.exitcode)
    except elastic.SignalException as exc:
        # Between two attempts (the last one's ranks closed, the next not
        # started yet): nothing runs, so just stop.
        _later_signals_do_nothing()
        first = first_signal(exc)
        print(f"fastspawn run: got {first.name}, stopping", file=sys.stderr)
        return 128 + int(first)
    return 1  # pragma: no cover - the loop always returns


def run_attempt(
    config: RunConfig,
    log_dir: LogDir | None,
    attempt: int,
    requests: cli_stacks.DumpRequests | None = None,
) -> int | elastic.ProcessFailure:
    """Start the group once and wait for it: the launcher's exit status when
    this ends the run (every rank succeeded, a stop signal, a program that
    cannot start, a hang stopped by --hang-action kill), else the first
    failed rank's failure, the other ranks stopped.

    Raises:
        LogDirError: the attempt's log directory cannot be made.
    """
    attempt_dir = os.devnull if log_dir is None else log_dir.make_attempt_dir(attempt)
    envs = topology.rank_envs(
        config.nprocs,
        config.nnodes,
        config.node_rank,
        config.master_addr,
        config.master_port,
        attempt,
        config.max_restarts,
    )
    for env in envs.values():
        env.update(_agent_envs(config))
    ctx = None
    stop_signals = None
    try:
        ctx = _start_ranks(config, envs, attempt_dir, log_dir)
        stop_signals = _StopSignals(ctx)
        stop_signals.install()
        if attempt == 0 and log_dir is not None and log_dir.given is None:
            print(f"fastspawn run: logs in {log_dir.path}", file=sys.stderr)
        labels = cli_stacks.RankLabels(config.global_rank, ctx.pids(), attempt_dir)
        watch = cli_stacks.RunWatch(ctx, labels, requests, config.hang_timeout, config.hang_action)
        result = watch.wait()
        if result is None:  # a hang, with --hang-action kill
            print("fastspawn run: stopping every rank (--hang-action kill)", file=sys.stderr)
            ctx.close(timeout=10)
            return cli_stacks.HANG_EXIT
        if not result.is_failed():
            return 0
        # The first failure comes first; the ranks stopped after it follow.
        local, failure = next(iter(result.failures.items()))
        print(describe(failure, config.global_rank(local)), file=sys.stderr)
        if result.rank_stacks:
            labels.show(
                f"where the other ranks were when rank {config.global_rank(local)} failed",
                result.rank_stacks,
            )
        # Inside the try: a signal while the other ranks stop is handled
        # as one while they run.
        ctx.close(timeout=10)
        return failure
    except elastic.SignalException as exc:
        if ctx is None:  # start_processes stopped what it had started
            _later_signals_do_nothing()
        first = first_signal(exc)
        if ctx is None:
            print(f"fastspawn run: got {first.name}, stopping", file=sys.stderr)
        else:
            (stop_signals or _StopSignals(ctx)).stop(first)
        return 128 + int(first)
    except OSError as exc:
        return _cannot_start(config.program, exc)
    except _limits.LimitError as exc:  # each rank's pipes and log files counted
        print(f"fastspawn run: {exc}", file=sys.stderr)
        return 2


def _agent_envs(config: RunConfig) -> dict[str, str]:
    """What torchrun's agent gives every worker beside the rank variables:
    the role, the run id, and OMP_NUM_THREADS=1 for several ranks on a node
    unless it is set."""
    envs = {"ROLE_NAME": config.role, "TORCHELASTIC_RUN_ID": config.run_id}
    if config.nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        envs["OMP_NUM_THREADS"] = "1"
    return envs


class _AttemptLogs(elastic.LogsSpecs):
    """fastspawn run's layout for one attempt: ``{attempt_dir}/{rank}/``
    holding ``stdout.log``, ``stderr.log`` (for the streams redirected or
    tee'd) and ``error.json``; ``os.devnull``: no files.  Ranks left out by
    --local-ranks-filter show nothing on the console (their log files still
    get everything)."""

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> elastic.LogsDest:
        dest = elastic.LogsDest()
        attempt_dir = self.root_log_dir
        redirects = elastic.to_map(self._redirects, len(envs))
        tees = elastic.to_map(self._tee, len(envs))
        if attempt_dir == os.devnull:
            dest.filtered_stdout = dest.filtered_stderr = os.devnull
        else:  # torch's names, one file per attempt for all ranks
            dest.filtered_stdout = os.path.join(attempt_dir, "filtered_stdout.log")
            dest.filtered_stderr = os.path.join(attempt_dir, "filtered_stderr.log")
        for rank in envs:
            shown = self._local_ranks_filter is None or rank in self._local_ranks_filter
            if attempt_dir == os.devnull:
                dest.stdouts[rank] = dest.stderrs[rank] = "" if shown else os.devnull
                dest.error_files[rank] = os.devnull
                continue
            rank_dir = os.path.join(attempt_dir, str(rank))
            os.mkdir(rank_dir, 0o700)
            elastic_logs.rank_files(dest, rank, rank_dir, redirects[rank], tees[rank], envs, shown)
        return dest


def _start_ranks(
    config: RunConfig,
    envs: dict[int, dict[str, str]],
    attempt_dir: str,
    log_dir: LogDir | None,
) -> elastic.PContext:
    shown = config.local_ranks_filter
    logs = _AttemptLogs(
        attempt_dir, config.redirects, config.tee, None if shown is None else set(shown)
    )
    try:
        return elastic.start_processes(
            name=config.name,
            entrypoint=config.entrypoint,
            args={rank: config.rank_argv(rank) for rank in range(config.nprocs)},
            envs=envs,
            logs_specs=logs,
            log_line_prefixes={
                rank: f"[{config.name}{config.global_rank(rank)}]:" for rank in range(config.nprocs)
            },
            stacks=config.stacks,
            duplicate_stdout_filters=list(config.stdout_filters),
            duplicate_stderr_filters=list(config.stderr_filters),
            numa_options=config.numa,
        )
    except BaseException:
        # Nothing ran: keep no empty log directories.  start_processes
        # removed the rank directories it made.
        if log_dir is not None:
            # rmdir stops at the first directory not empty: one that
            # holds an earlier attempt's logs, or the user's files.
            remove_created(attempt_dir, log_dir.path, log_dir.created)
        raise


def _cannot_start(program: str, exc: OSError) -> int:
    """Say why ``program`` could not start; the launcher's exit status, as a
    shell's: 127 when it is not found, else 126."""
    # OSError's str() ends with the filename: name it once, up front.
    what = program if exc.filename is None else exc.filename
    why = exc.strerror if exc.filename is not None and exc.strerror else str(exc)
    print(f"fastspawn run: cannot start {what!r}: {why}", file=sys.stderr)
    return 127 if isinstance(exc, FileNotFoundError) else 126
