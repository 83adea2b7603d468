"""spawn / start_processes: the torch.multiprocessing surface, each
argument checked before anything starts."""

from __future__ import annotations

import operator
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

from fastspawn._launch import context as _context
from fastspawn._launch import exiting
from fastspawn._launch.context import ProcessContext
from fastspawn._launch.errors import ProcessExitedException, ProcessRaisedException
from fastspawn._launch.methods import base, common, helpers, registry
from fastspawn._launch.methods.base import StartMethod
from fastspawn._launch.methods.registry import StartMethodName
from fastspawn._launch.process import Process
from fastspawn._os import limits as _limits
from fastspawn._os import oscall
from fastspawn._wire.channel import Receiver, channel_pair
from fastspawn._wire.pickling import describe_unpicklable

ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"
DEFAULT_START_METHOD: StartMethodName = registry.DEFAULT

# paddle.distributed.spawn options that it deprecated: accepted with a warning.
_DEPRECATED_OPTIONS = (
    "selected_devices",
    "started_port",
    "cluster_node_ips",
    "node_ip",
    "use_paddlecloud",
)

# paddle.distributed.spawn options that set up paddle's own devices and
# communication: refused with a message saying what to do instead.
_PADDLE_OPTIONS = ("gpus", "xpus", "ips", "backend", "print_config")


# Frames in here are fastspawn's, not the caller's (see _user_stacklevel).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_nprocs(nprocs: Any) -> int:
    # Any integer type (numpy's too, as torch takes them), not bool or float.
    try:
        if isinstance(nprocs, bool):
            raise TypeError
        count: int = operator.index(nprocs)
    except TypeError:
        raise TypeError(f"nprocs must be an int, got {type(nprocs).__name__} {nprocs!r}") from None
    if count == -1:
        return _usable_cpus()
    if count < 0:
        raise ValueError(
            f"nprocs must be a number of processes, 0 or more (or -1 for one per usable "
            f"CPU), got {count}"
        )
    # More than the limits allow (the user's processes or fds, the
    # machine's pids) could only fail part-way, after taking what is free.
    _limits.check_nprocs(count, f"nprocs={count}")
    return count


def _check_envs(envs: Any, nprocs: int) -> dict[int, dict[str, str]]:
    if envs is None:
        return {}
    if not isinstance(envs, Mapping):
        raise TypeError(f"envs must be a dict {{rank: {{VAR: value}}}}, got {type(envs).__name__}")
    checked: dict[int, dict[str, str]] = {}
    for rank, env in envs.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nprocs:
            raise ValueError(
                f"envs has key {rank!r}, which is not a rank: keys must be ints in 0..{nprocs - 1}"
            )
        if not isinstance(env, Mapping):
            raise TypeError(f"envs[{rank}] must be a dict of str to str, got {type(env).__name__}")
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"envs[{rank}] must map str to str; {key!r}: {value!r} is "
                    f"{type(key).__name__} to {type(value).__name__}"
                )
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(f"envs[{rank}] has an invalid variable name or value: {key!r}")
        checked[rank] = dict(env)
    return checked


def _check_preload(preload: Any, method: StartMethod) -> list[str]:
    if preload is None:
        return []
    if isinstance(preload, str) or not isinstance(preload, (list, tuple)):
        raise TypeError(f"preload must be a list of module names, got {type(preload).__name__}")
    for name in preload:
        if not isinstance(name, str) or not name:
            raise TypeError(f"preload must be a list of module names; {name!r} is not one")
    if not method.supports_preload:
        applies = " or ".join(repr(m.name) for m in registry.methods() if m.supports_preload)
        raise ValueError(f"preload applies to start_method {applies}, not {method.name!r}")
    return list(preload)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by our caller name the
    first line outside fastspawn (start_processes called directly, or
    through spawn)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _check_options(options: Mapping[str, Any]) -> None:
    for key in options:
        if key in _DEPRECATED_OPTIONS:
            warnings.warn(
                f"The option {key!r} is deprecated and ignored by fastspawn.",
                DeprecationWarning,
                stacklevel=_user_stacklevel(),
            )
        elif key in _PADDLE_OPTIONS:
            raise ValueError(
                f"option {key!r} is paddle.distributed.spawn's: fastspawn starts the "
                "processes and sets up no device or communication backend; choose "
                "devices and initialize the process group in fn (per-rank envs= can "
                "carry CUDA_VISIBLE_DEVICES and the like)"
            )
        else:
            raise ValueError(
                f"unknown option {key!r} for fastspawn.start_processes; known keyword "
                "options are envs, preload, and (deprecated, ignored) "
                + ", ".join(_DEPRECATED_OPTIONS)
            )


def launch_context(request: base.LaunchRequest, join: bool = False) -> ProcessContext:
    """Start the workers of a checked request (and with ``join``, join
    them); nothing is left on failure.  A Ctrl-C anywhere in here, the
    moment a launch ends included, kills every worker started."""
    started: base.Started = []
    context = receiver = tx = None
    under_way = object()  # in exiting.launches_under_way until handed over
    try:
        try:
            with oscall.held_signals():  # made and recorded, for the cleanup
                exiting.launches_under_way.add(under_way)
                rx_sock, tx = channel_pair()
                receiver = Receiver(rx_sock)
            base.launch(request, tx, receiver, started)
        finally:
            if tx is not None:
                tx.close()
        with oscall.held_signals():  # the workers pass to the context whole
            reaped_here = request.method.caller_reaps
            # A multiprocessing process's group outlives it, with what it
            # started (see helpers.linger_groups): not the context's to drop.
            lingering = request.mp_process and reaped_here
            processes = [
                Process(rank, pid, pidfd, receiver, reaped_here)
                for rank, (pid, pidfd) in enumerate(started)
            ]
            context = ProcessContext(
                processes,
                receiver,
                daemon=request.daemon,
                group=request.group,
                watched_groups=() if lingering else request.watched_groups,
                stacks=request.stacks,
            )
            if lingering:
                helpers.linger_groups(request.watched_groups)
            exiting.launches_under_way.discard(under_way)
        while join and not context.join():
            pass
        return context
    except BaseException as exc:
        # Whatever else comes meanwhile (Ctrl-C again and again) waits for
        # the workers to be killed and reaped: they are SIGKILLed first.
        with oscall.held_signals():
            exiting.launches_under_way.discard(under_way)  # ended here
            if tx is not None:
                tx.close()  # again, if a Ctrl-C came before the finally's
            # A fork or spawn launch's group anchor, if a Ctrl-C cut its
            # own release short (a zombie child otherwise).
            base.release_anchor(request)
            if context is None:
                # Interrupted as the launch ended, or out of fds for the
                # epoll set: the workers run, and nothing would watch them.
                base.kill_started(started, reap=request.method.caller_reaps)
                helpers.forget_groups(request.watched_groups)
                if receiver is not None:
                    receiver.close()
            elif not isinstance(exc, (ProcessRaisedException, ProcessExitedException)):
                # Ctrl-C or another error in the caller: leave nothing running.
                context._failed = True
                context._end(signal.SIGKILL)
        raise


def start_processes(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: StartMethodName | None = DEFAULT_START_METHOD,
    *,
    envs: Mapping[int, Mapping[str, str]] | None = None,
    preload: Sequence[str] | None = None,
    stacks: bool = True,
    **options: Any,
) -> ProcessContext:
    """Run ``fn(i, *args)`` in ``nprocs`` processes, ``i`` being the rank.

    Args:
        fn: the function; for spawn-like start methods it must be picklable
            (defined at module top level, or in a notebook, the interactive
            prompt, ``python -c`` or stdin, whence it travels by value).
        args: extra positional arguments, a tuple or list.
        nprocs: number of processes; -1 means one per CPU this process may use.
        join: block until all succeed or one fails (then raise).
        daemon: mark the workers daemonic: at interpreter exit they are
            terminated rather than waited for.
        start_method: ``"zygote"`` (default: spawn-safe workers forked from
            a clean fastspawn process), ``"spawn"``, ``"fork"`` or
            ``"forkserver"`` (served by the zygote); ``None``, as in torch,
            the method multiprocessing uses by default (``"fork"`` on Linux
            before Python 3.14).
        envs: ``{rank: {VAR: value}}`` set in that rank before ``fn`` runs.
        preload: modules the zygote imports before forking this launch
            (zygote and forkserver only; see also :func:`fastspawn.preload`).
        stacks: each worker arms a dump of its threads' Python stacks
            (faulthandler on fastspawn's stack signal, SIGRTMIN+20), so
            that a failure shows where the other ranks were (the exception's
            ``rank_stacks`` and a WARNING, the message itself staying
            torch's) and :meth:`ProcessContext.dump_stacks` works; False
            leaves the signal alone and the output as torch's.

    Returns:
        The :class:`ProcessContext` (joined when ``join`` is True; torch
        returns None there, and returning the context breaks no caller).

    Raises:
        TypeError, ValueError: bad arguments, before any process starts;
            ValueError too for more ranks than the caller's limits on
            processes or open files, or the machine's on pids, allow (the
            message names the limit), and, with ``start_method="spawn"``
            (which execs each worker), for a variable of a worker's
            environment (``envs`` over the caller's) longer than exec takes:
            128 KiB as ``NAME=value`` (the message names it).
        BlockingIOError: the ranks fit those limits but not beside what
            this user runs already (EAGAIN from fork); nothing is left
            running.
        pickle.PicklingError: ``fn`` or an argument cannot be pickled for a
            spawn-like start method; the message names which.
        ProcessRaisedException, ProcessExitedException: with ``join``, a
            worker failed.
    """
    _check_options(options)
    nprocs = _check_nprocs(nprocs)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r:.80}")
    if isinstance(args, (str, bytes, bytearray, Mapping, Set)) or not isinstance(args, Iterable):
        # torch would unpack a string into characters, a dict into its keys:
        # (x) or {...} where (x,) was meant.
        raise TypeError(
            f"args must be a tuple of fn's arguments after the rank, got "
            f"{type(args).__name__} {args!r:.80}; for one argument write args=(x,)"
        )
    args = tuple(args)
    method = registry.get(start_method)
    checked_envs = _check_envs(envs, nprocs)
    preload_list = _check_preload(preload, method)
    request = base.LaunchRequest(
        fn=fn,
        args=args,
        nprocs=nprocs,
        daemon=bool(daemon),
        method=method,
        envs=checked_envs,
        preload=preload_list,
        stacks=bool(stacks),
    )
    try:
        if method.pickles_arguments:
            _pickle_once(request)
        if os.environ.get(ENV_VAR_PARALLEL_START, "0") == "1":
            _context.log.debug(
                "%s=1: fastspawn launches concurrently anyway", ENV_VAR_PARALLEL_START
            )
        if nprocs == 0:
            # torch starts nothing and returns (spawn(fn, nprocs=device_count())
            # on a machine without GPUs, say): an empty context.
            rx_sock, tx = channel_pair()
            tx.close()
            return ProcessContext([], Receiver(rx_sock), daemon=bool(daemon))
        return launch_context(request, join)
    finally:
        common.discard_work(request)  # sent, or never: closed either way


def _pickle_once(request: base.LaunchRequest) -> None:
    """Pickle fn and args for the method to send (common.pickle_work): the
    check that they pickle, done once.

    Raises:
        pickle.PicklingError: one of them cannot be pickled; the message
            names which, and what to do (describe_unpicklable, which
            pickles them again one by one: only on this path).
    """
    try:
        common.pickle_work(request)
        return
    except Exception:  # pickling raises many types
        problem = describe_unpicklable(request.fn, request.args, request.method.name)
        if problem is None:
            raise  # they fail together, not one by one: as it is
    raise pickle.PicklingError(problem)


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: StartMethodName | None = DEFAULT_START_METHOD,
    **kwargs: Any,
) -> ProcessContext:
    """Like :func:`start_processes`, always with a spawn-safe start method.

    ``"zygote"`` (the default, also what ``None`` means) and ``"spawn"``
    are taken as they are; any other ``start_method`` warns (FutureWarning,
    as torch does) and the zygote is used.
    """
    if start_method is None:
        start_method = registry.DEFAULT
    if start_method not in [m.name for m in registry.methods() if m.spawn_accepts]:
        msg = (
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t"
            " fastspawn.start_processes(...)"
        )
        warnings.warn(msg, FutureWarning, stacklevel=2)
        start_method = DEFAULT_START_METHOD
    return start_processes(fn, args, nprocs, join, daemon, start_method=start_method, **kwargs)
