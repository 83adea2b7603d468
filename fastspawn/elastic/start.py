"""``start_processes``: TorchElastic's entry, every argument checked
before a log file is made or a rank starts."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastspawn._launch.methods import registry
from fastspawn._os import limits as _limits
from fastspawn._os import numa as _numa
from fastspawn._worker import spawned
from fastspawn._worker.elastic_rank import ERROR_FILE_ENV
from fastspawn.elastic import logs, pcontext
from fastspawn.elastic.api import Std
from fastspawn.elastic.logs import LogsSpecs
from fastspawn.elastic.pcontext import PContext

log = logging.getLogger(__name__)


def _validate_full_rank(mapping: Mapping[int, Any], nprocs: int, what: str) -> None:
    actual = set(mapping)
    expected = set(range(nprocs))
    if actual != expected:
        raise RuntimeError(
            f"{what}, local rank mapping mismatch, expected: {sorted(expected)}, "
            f"actual: {sorted(actual, key=str)}"
        )


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
        log_dir: an existing, empty directory of the caller's own that
            no one else may write in (or ``os.devnull`` for no files);
            each rank gets ``{rank}/stdout.log`` and ``stderr.log`` there
            for the streams redirected or tee'd, and ``error.json`` if a
            function rank fails, created 0600.
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
            (see ``fastspawn._os.numa``); function ranks bind themselves
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
        PermissionError: ``log_dir`` is another user's, or others may
            write in it: they could read or replace what the ranks write
            there (the message names its owner and mode).
        ValueError: a ``LogsDest`` tees a rank's stream from a file other
            than the one the stream is written to.
        FileExistsError: a log file the ``LogsDest`` names exists already.
        FileNotFoundError, PermissionError: the binary cannot be found or run.
        ValueError: an unknown ``start_method`` (the message lists the valid
            ones), more ranks than the limits on processes or open files
            allow, each rank's pipes and log files counted (the message
            names the limit and the value that fits), a variable of a binary
            rank's environment (``envs`` over the caller's) longer than exec
            takes (128 KiB as ``NAME=value``: named), or filters given where
            the ``LogsDest`` names no filtered file.
        TypeError: a filter list that is a string, or holds a non-string.
        RuntimeError: ``numa_options`` cannot apply here (see above).
    """
    # Before anything is made: an unknown one names the valid ones.
    method_name = registry.get(start_method).name
    directory, logs_specs = logs.checked_log_args(log_dir, logs_specs, redirects, tee)
    nprocs = len(args)
    subject = f"a launch of {nprocs} ranks (len(args))"
    _limits.check_nprocs(nprocs, subject)
    _validate_full_rank(args, nprocs, "args")
    _validate_full_rank(envs, nprocs, "envs")
    if isinstance(redirects, str) or isinstance(tee, str):
        raise TypeError("redirects and tee take Std values or maps; use Std.from_str for strings")
    filters = {
        "stdout": logs.checked_filters(duplicate_stdout_filters, "duplicate_stdout_filters"),
        "stderr": logs.checked_filters(duplicate_stderr_filters, "duplicate_stderr_filters"),
    }
    rank_envs = {rank: {k: str(v) for k, v in envs[rank].items()} for rank in range(nprocs)}
    binary_path = None
    rank0_env = {**os.environ, **rank_envs.get(0, {})}
    if isinstance(entrypoint, str):
        # Before any file is created: a missing binary leaves nothing behind.
        binary_path = pcontext.resolve_binary(entrypoint, rank0_env)
        spawned.check_exec_env(
            rank_envs,
            nprocs,
            f"each rank execs {entrypoint} with its environment; shorten it or pass the "
            "data another way (a file, an argument)",
        )
    numa = None
    if numa_options is not None:
        numa = _numa.binding(numa_options, nprocs, binary_path, rank0_env)
    rank_dirs: list[str] = []  # created by this call: removed if the start fails
    try:
        dest = logs.logs_dest(directory, logs_specs, redirects, tee, rank_envs, rank_dirs)
        stdouts = {rank: dest.stdouts.get(rank, "") for rank in range(nprocs)}
        stderrs = {rank: dest.stderrs.get(rank, "") for rank in range(nprocs)}
        tee_out = logs.tee_flags(dest.tee_stdouts, stdouts, "stdout")
        tee_err = logs.tee_flags(dest.tee_stderrs, stderrs, "stderr")
        # Again, now that each rank's pipes and log files are known: the
        # limit on open files it advises must let them all open.
        per_rank = pcontext.fds_per_rank(stdouts, stderrs, tee_out, tee_err)
        if per_rank > 1:
            _limits.check_nprocs(nprocs, subject, fds_per_rank=per_rank)
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
            filtered=logs.filtered_copies(dest, filters),
            numa=numa,
            stacks=stacks,
        )
        context.start()  # leaves no fd and no rank behind when it fails
    except BaseException:
        for rank_dir in rank_dirs:
            shutil.rmtree(rank_dir, ignore_errors=True)
        raise
    return context
