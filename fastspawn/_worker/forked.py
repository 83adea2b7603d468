"""A forked worker (start method fork, or the zygote's): its set-up right
after fork(), then its run."""

from __future__ import annotations

import os
import signal
import socket
import sys

# Only forking processes (the zygote, a caller of the fork method) import
# this module, and they have the C core loaded: no rank pays for it.
from fastspawn._os import oscall
from fastspawn._wire import channel as _channel
from fastspawn._worker.runner import (
    FORK_EXIT_HANDLERS,
    channel_identity,
    finish,
    forget_exit_handlers,
    print_exc,
    run,
    run_after_forkers,
    set_parent_process,
)
from fastspawn._worker.stacks import arm_stacks, disarm_stacks
from fastspawn._worker.stdio import quiet_stdin, redirect_stdio, whole_lines

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, NoReturn


def _after_fork(rank: int, daemon: bool) -> None:
    """Reset the multiprocessing state a forked worker inherited.

    Every step here costs a worker the pages it writes (refcounts, frames):
    the modules come from sys.modules (``from multiprocessing import``
    runs importlib's Python), the name without its property: some 10 page
    copies less a worker, counted with getrusage's minor faults.  The
    after-fork callables run once in a process (run_after_forkers): a ready
    worker's ran in its rehearsal, ahead of the wake."""
    process = _loaded("multiprocessing.process")
    util = _loaded("multiprocessing.util")
    util._finalizer_registry.clear()
    run_after_forkers()
    process._children = set()
    current = process._current_process
    current._config["daemon"] = daemon
    current._name = f"fastspawn-worker-{rank}"


def _loaded(name: str) -> Any:
    """Module ``name``, imported if it is not yet."""
    module = sys.modules.get(name)
    if module is None:
        __import__(name)
        module = sys.modules[name]
    return module


def reseed() -> None:
    """Give a forked worker its own random streams, as a fresh interpreter
    has: numpy's.  Python's ``random`` reseeds itself at fork (its
    ``os.register_at_fork`` handler), which the zygote's fork loop runs.
    The zygote calls this only where ``numpy.random`` is loaded.

    Only generators that exist already: numpy's legacy global RNG lives in
    ``numpy.random``, which ``import numpy`` (and so ``import torch``) leaves
    unimported; touching ``numpy.random`` would import it in every worker
    (about 18 ms each on the benchmark machine), and a worker that imports
    it later seeds it from the OS anyway.
    """
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed()
        except Exception:
            pass


def torch_threads_to_match(envs: Mapping[int, Mapping[str, str]]) -> bool:
    """Whether workers of a launch may need _match_torch_threads: torch is
    loaded here and OMP_NUM_THREADS is set for them (in this process's
    environment, which they inherit, or in a rank's own)."""
    return "torch" in sys.modules and omp_threads_set("OMP_NUM_THREADS" in os.environ, envs)


def omp_threads_set(inherited: bool, envs: Mapping[int, Mapping[str, str]]) -> bool:
    """Whether OMP_NUM_THREADS is set for a launch's workers: in the
    environment they have (``inherited``, as its holder has looked) or in a
    rank's own (``envs``)."""
    return inherited or any("OMP_NUM_THREADS" in e for e in envs.values())


def _match_torch_threads() -> None:
    """torch sizes its CPU thread pool from OMP_NUM_THREADS when it is
    imported; in a forked worker that was in the zygote (or the caller), with
    that process's environment, so a rank given OMP_NUM_THREADS=1 would still
    run one thread per CPU (as torchrun's ranks, which set it, must not).
    Apply the worker's own value, as a spawned interpreter would have."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if not wanted.strip().isdigit() or int(wanted) < 1:
        return
    try:
        if torch.get_num_threads() != int(wanted):
            torch.set_num_threads(int(wanted))
    except Exception:
        pass  # a torch without these: nothing to match


class ForkSpec:
    """What every rank of one forked launch (start method fork, or the
    zygote's) shares, built once before the fork loop.

    Attributes:
        parent: the pid that forks, recorded before the fork, for the
            PR_SET_PDEATHSIG race check.
        fn, args: what to run (fn None with ``payload_error``).
        tx: the launch's report channel.
        daemon: the workers are daemonic.
        envs: ``{rank: {VAR: value}}`` applied before ``fn`` runs.
        payload_error: the traceback of a failure to prepare fn and args
            (in the zygote): every rank reports it instead of running.
        close_fds: fds of the forking process no worker keeps.
        stdin: -1 for /dev/null (function workers), None to keep fd 0, or
            an fd to make fd 0 (binary ranks read the launcher's stdin).
        process_state: the caller's settings that differ from this
            process's (see procstate).
        from_zygote: forked from the zygote, not from the caller: the
            worker's own atexit handlers run at its exit.  A zygote worker's
            stdin (/dev/null) and ``multiprocessing.parent_process()`` (the
            caller) are the zygote's already.
        channel: ``channel_identity(tx.fileno())`` (a ready worker's is given: see
            wake.Brief).
        match_torch_threads: ``torch_threads_to_match(envs)``, decided once
            before forking (reading the environment in every worker, a
            KeyError and all, cost 150 us a worker with torch loaded); a
            ready worker's is given (see wake.Brief).
        stacks: what each worker does of the stack dump itself: None
            nothing (born armed, or stacks off), True arm_stacks, False
            disarm_stacks (see ForkStacks.in_worker).
        parent_death_armed: PR_SET_PDEATHSIG is armed (and the parent
            checked) already, by the C fork loop (the zygote's).
        die_with_parent: arm PR_SET_PDEATHSIG against the parent (not for
            a launch whose workers outlive their caller, see
            LaunchRequest.outlive_caller).
    """

    __slots__ = (
        "parent",
        "fn",
        "args",
        "tx",
        "daemon",
        "envs",
        "payload_error",
        "close_fds",
        "stdin",
        "process_state",
        "from_zygote",
        "channel",
        "match_torch_threads",
        "stacks",
        "parent_death_armed",
        "die_with_parent",
    )

    def __init__(
        self,
        parent: int,
        fn: Callable[..., Any] | None,
        args: Sequence[Any],
        tx: socket.socket,
        *,
        daemon: bool,
        envs: Mapping[int, Mapping[str, str]],
        payload_error: str | None = None,
        close_fds: Sequence[int] = (),
        stdin: int | None = -1,
        process_state: dict[str, Any] | None = None,
        from_zygote: bool = False,
        stacks: bool | None = None,
        match_torch_threads: bool | None = None,
        channel: tuple[int, int] | None = None,
    ) -> None:
        self.parent = parent
        self.fn = fn
        self.args = args
        self.tx = tx
        self.daemon = daemon
        self.envs = envs
        self.payload_error = payload_error
        self.close_fds = close_fds
        self.stdin = stdin
        self.process_state = process_state
        self.from_zygote = from_zygote
        self.channel = channel_identity(tx.fileno()) if channel is None else channel
        if match_torch_threads is None:
            match_torch_threads = torch_threads_to_match(envs)
        self.match_torch_threads = match_torch_threads
        self.stacks = stacks
        self.parent_death_armed = False
        self.die_with_parent = True


def forked_child(
    spec: ForkSpec,
    rank: int,
    stdio: Sequence[int] | None = None,
    close_fds: Sequence[int] = (),
) -> NoReturn:
    """Entry of a worker right after fork(); never returns.

    ``stdio``: the fds to make this rank's fds 1 and 2 (-1: keep).
    ``close_fds``: this rank's own fds to close beside ``spec.close_fds``
    (other ranks' stdio, say).
    """
    code, signum = 1, 0
    try:
        code, signum = _set_up_and_run(spec, rank, stdio, close_fds)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the caller closed its channel: it is gone or gave up on us
    except BaseException:
        print_exc()
    finally:
        finish(code, signum, "own" if spec.from_zygote else FORK_EXIT_HANDLERS)


def rehearse(spec: ForkSpec, rank: int) -> None:
    """What forked_child does up to the report of ``spec.fn``'s result,
    for a ready worker ahead of its wake (fastspawn._zygote.wake), so that
    the pages this writes are its own before a launch waits for it: a spec
    from the zygote with no state of a caller's, fn doing nothing, a channel
    of the rehearsal's own.  multiprocessing's after-fork callables run
    here, once (see runner.run_after_forkers): at the wake, only those
    registered since (by the launch's unpickling)."""
    assert spec.payload_error is None, spec.payload_error
    _set_up_and_run(spec, rank, None, ())


def _set_up_and_run(
    spec: ForkSpec,
    rank: int,
    stdio: Sequence[int] | None,
    close_fds: Sequence[int],
) -> tuple[int, int]:
    """forked_child but its end: (exit code, signal to die by or 0)."""
    _set_up_forked(spec, rank, stdio, close_fds)
    if spec.payload_error is not None:
        error = spec.payload_error.encode("utf-8", "replace")
        _channel.send(spec.tx, rank, _channel.ERROR, error)
        return 1, 0
    assert spec.fn is not None
    return run(rank, spec.fn, spec.args, spec.tx, spec.channel, oscall.fd_is)


def _set_up_forked(
    spec: ForkSpec,
    rank: int,
    stdio: Sequence[int] | None,
    close_fds: Sequence[int],
) -> None:
    """A forked worker's process set-up, before its fn runs."""
    if spec.die_with_parent and not spec.parent_death_armed:
        _arm_parent_death(spec.parent)
    for fd in (*spec.close_fds, *close_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    if stdio is not None:
        redirect_stdio(stdio, flush=not spec.from_zygote)
    if not spec.from_zygote:
        _caller_fork_stdio(spec)
        forget_exit_handlers()
    elif spec.stdin is not None and spec.stdin >= 0:
        _stdin_from(spec.stdin)
    if spec.process_state:
        from fastspawn._os import procstate

        procstate.apply(spec.process_state)
    rank_env = spec.envs.get(rank)
    if rank_env:
        os.environ.update(rank_env)
    if spec.match_torch_threads:
        _match_torch_threads()
    _after_fork(rank, spec.daemon)
    if not spec.from_zygote:  # the zygote's is the caller already
        set_parent_process(spec.parent)
    if spec.stacks is not None:  # no call otherwise: its pages would be copied
        _forked_stacks(spec, rank)


def _caller_fork_stdio(spec: ForkSpec) -> None:
    """The streams of a worker forked from the caller: each line written
    whole, stdin from /dev/null or the fd given.  (A zygote worker's are the
    zygote's, set once for all its ranks.)"""
    whole_lines()
    if spec.stdin == -1:
        quiet_stdin()
    elif spec.stdin is not None and spec.stdin >= 0:
        _stdin_from(spec.stdin)


def _stdin_from(fd: int) -> None:
    """Make ``fd`` this process's fd 0 (binary ranks read the launcher's stdin)."""
    os.dup2(fd, 0)
    os.close(fd)


def _arm_parent_death(parent: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL) against ``parent``, or exit if it is gone."""
    try:
        oscall.set_pdeathsig(signal.SIGKILL, parent)
    except ProcessLookupError:
        os._exit(1)  # the parent died before prctl: nobody wants us


def _forked_stacks(spec: ForkSpec, rank: int) -> None:
    """What a forked worker does of its stack dump itself, when its parent
    did not arm it (see ForkStacks)."""
    if spec.stacks:
        arm_stacks(rank)
    else:
        disarm_stacks()
