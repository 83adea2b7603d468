"""A worker's run: ``fn(rank, *args)`` called, its outcome reported, and the
worker's end (what multiprocessing runs at exit, then ``os._exit``)."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading

from fastspawn._wire import channel as _channel
from fastspawn._wire import pickling

# A spawned worker imports this module on every start: what only some paths
# need (typing, traceback, the cffi core) is imported where used.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, Literal, NoReturn

    # How a report checks its channel: (fd, st_dev, st_ino) -> whether the
    # fd is still open on that file.
    ChannelCheck = Callable[[int, int, int], bool]


def format_exc() -> str:
    import traceback

    return traceback.format_exc()


def print_exc() -> None:
    import traceback

    traceback.print_exc()


# What CPython reads an int exit code into (PyLong_AsLong, a C long): one
# that does not fit makes it -1, exit status 255.
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


def exit_code(exc: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` gives a process, as the interpreter
    gives it: an int modulo 256 (``sys.exit(-1)`` exits 255), 255 for one
    outside a C long (``sys.exit(2**70)``: never 0, a success), None 0,
    anything else printed and 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        if not _LONG_MIN <= code <= _LONG_MAX:
            return 255
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_during_prepare(rank: int, code: int) -> None:
    """The fn of a zygote worker whose main module exited while the zygote
    imported it: exit the same way, as a spawned worker would have."""
    raise SystemExit(code)


# The keys of multiprocessing's after-fork callables (those of
# ``multiprocessing.util.register_after_fork``) that ran in this process:
# each runs once in a process, as in a child of multiprocessing's fork.
# And the registrations' count when they last ran here: none registered
# since, run_after_forkers reads nothing of the registry, whose entries
# (torch's among them) sit on pages a ready worker's wake would otherwise
# read (47-50 us of a woken rank's set-up with torch preloaded, 27 us so).
# Both are forgotten at every fork: a child runs them all again.
_after_forkers_run: set[tuple[Any, ...]] = set()
_after_forkers_counted = 0


def _forget_after_forkers() -> None:
    global _after_forkers_counted
    _after_forkers_run.clear()
    _after_forkers_counted = 0


os.register_at_fork(after_in_child=_forget_after_forkers)


def run_after_forkers() -> None:
    """Run multiprocessing's after-fork callables that have not run in this
    process yet, in the order they were registered; one that raises is
    logged (``multiprocessing.util.info``) and the others run, as
    ``util._run_after_forkers`` does.  Where more than one step of a
    worker's start would run them (a rank's set-up, then a multiprocessing
    process's ``_bootstrap``), each still runs once."""
    global _after_forkers_counted
    util = sys.modules.get("multiprocessing.util")
    if util is None or not util._afterfork_registry:
        return  # none registered: the usual case, on every rank's set-up
    counted = count_next(getattr(util, "_afterfork_counter", None))
    if counted is not None and counted == _after_forkers_counted:
        return  # every one registered so far has run here
    pending = [
        (key, obj)
        for key, obj in list(util._afterfork_registry.items())
        if key not in _after_forkers_run
    ]
    pending.sort()  # by key, whose first item (the registration's index) is unique
    for key, obj in pending:
        _after_forkers_run.add(key)
        try:
            key[2](obj)
        except Exception as exc:
            util.info("after forker raised exception %s", exc)
    if counted is not None:
        # Those a callable registered meanwhile come next time (above it).
        _after_forkers_counted = counted


def _report(
    tx: socket.socket,
    channel: tuple[int, int],
    rank: int,
    kind: int,
    body: bytes,
    fd_is: ChannelCheck,
) -> None:
    """Send a report on ``tx`` if its fd is still the channel it was when
    the worker started (``channel``: its st_dev, st_ino; ``fd_is`` checks).
    A worker that closed its inherited fds (``os.closerange``) has no
    channel left, and one that opened something since may have the number
    back: the report is then dropped with a line on stderr, never written
    into that file or connection.  The exit code still tells the caller how
    the rank ended.
    """
    if not fd_is(tx.fileno(), *channel):
        try:
            print(
                f"fastspawn: rank {rank} cannot report to its launcher: the worker closed "
                f"its report channel (fd {tx.fileno()}); only its exit code reaches the caller",
                file=sys.stderr,
            )
        except Exception:
            pass  # sys.stderr may be gone with the fds the worker closed
        return
    _channel.send(tx, rank, kind, body)


def stat_is(fd: int, dev: int, ino: int) -> bool:
    """A ChannelCheck through os.fstat: a spawned worker's, which would
    otherwise load the C extension for it (cffi and oscall: about 1 ms of
    CPU, 6 where no bytecode is cached; benchmarks/README.md).  A forked
    worker uses oscall.fd_is, which builds no Python object (no page
    copied for it)."""
    try:
        stat = os.fstat(fd)
    except OSError:
        return False
    return stat.st_dev == dev and stat.st_ino == ino


def channel_identity(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of a report channel's ``fd``: what _report checks
    the fd still is.  Taken once per launch by the forking process (the
    zygote, for its ready workers too: wake.Brief)."""
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


def run(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    tx: socket.socket,
    channel: tuple[int, int] | None = None,
    fd_is: ChannelCheck = stat_is,
) -> tuple[int, int]:
    """Call ``fn(rank, *args)`` and report its outcome on ``tx`` (``channel``:
    its identity, taken here if not given; ``fd_is``: how a report checks
    it, see _report).

    Returns (exit code, signal to die by or 0).  A KeyboardInterrupt (SIGINT)
    does not pass as success, as it does under torch: the worker dies by
    SIGINT after its finalizers ran, so the caller sees the signal.

    Only the rank itself reports.  A child it forked (``os.fork()`` in
    ``fn``) that comes back out of ``fn`` is not the rank: it reports
    nothing (its exception would be blamed on the rank, its value taken for
    the rank's) and ends as a plain forked Python process does, its
    traceback on stderr and exit status 1 after an exception, 0 after a
    return.  The rank's own exit status decides how the rank ended.
    """
    if channel is None:
        channel = channel_identity(tx.fileno())
    rank_pid = os.getpid()
    signum = 0
    code = 0
    try:
        value = fn(rank, *args)
    except KeyboardInterrupt:
        signum = signal.SIGINT
        code = 1
    except SystemExit as exc:
        code = exit_code(exc)
        value = None
    except BaseException:
        code = 1
        if os.getpid() != rank_pid:
            print_exc()
        else:
            _report(
                tx, channel, rank, _channel.ERROR, format_exc().encode("utf-8", "replace"), fd_is
            )
    if os.getpid() != rank_pid:
        return code, signum
    if code == 0 and not signum:
        try:
            body = pickling.dumps_result(value)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            _report(tx, channel, rank, _channel.UNPICKLABLE, why.encode("utf-8", "replace"), fd_is)
        else:
            _report(tx, channel, rank, _channel.RESULT, body, fd_is)
    return code, signum


def flush_std_streams() -> None:
    """Flush sys.stdout and sys.stderr, whatever state they are in (before a
    fork, before os._exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


# Set in the zygote before it forks (see fastspawn._zygote.forking): the
# index of the next weakref.finalize to be made (those below it are the
# zygote's, which its workers must not run at their exit), and how many
# logging handlers it has.
zygote_finalizer_index: int | None = None
zygote_handlers = -1

# fastspawn's own atexit handler, set by the launching side
# (fastspawn._launch.context) once a process imports it: it ends the
# launches that process made and left unjoined.  A zygote worker, or one
# forked from the caller, runs no atexit handler it inherited, so finish()
# calls this one (None: the worker never launched anything).
launches_at_exit: Callable[[], None] | None = None


# In the zygote's workers: the atexit handlers each registered, run at its
# exit by finish (see capture_worker_exit_handlers).
_worker_exit_handlers: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
_zygote_pid = 0


def capture_worker_exit_handlers() -> None:
    """In the zygote, before user code runs: make ``atexit.register`` (and
    ``unregister``) called in one of its workers keep the handler for that
    worker's exit, run by finish, as a spawned worker runs what it
    registered.  The zygote's own handlers stay with the zygote: a worker
    must not run them (a temporary directory the zygote made would be
    removed by the first worker to exit).  Routing them at registration
    costs a worker nothing until it registers one; clearing atexit after
    every fork would copy its pages in every worker."""
    global _zygote_pid
    _zygote_pid = os.getpid()
    register, unregister = atexit.register, atexit.unregister

    def worker_register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if os.getpid() == _zygote_pid:
            return register(func, *args, **kwargs)
        _worker_exit_handlers.append((func, args, kwargs))
        return func

    def worker_unregister(func: Callable[..., Any]) -> None:
        if os.getpid() == _zygote_pid:
            unregister(func)
        else:
            _worker_exit_handlers[:] = [h for h in _worker_exit_handlers if h[0] != func]

    worker_register.__doc__ = register.__doc__
    worker_unregister.__doc__ = unregister.__doc__
    atexit.register = worker_register  # type: ignore[assignment]
    atexit.unregister = worker_unregister


def _run_worker_exit_handlers() -> None:
    """What the worker registered with atexit, last first, as atexit runs
    them; one that raises is printed and the rest still run."""
    while _worker_exit_handlers:
        func, args, kwargs = _worker_exit_handlers.pop()
        try:
            func(*args, **kwargs)
        except BaseException:
            print_exc()


def next_finalizer_index(finalize: Any) -> int | None:
    """The index weakref.finalize gives the next finalizer made (they are
    numbered in order), read without taking it; None if not readable."""
    return count_next(getattr(finalize, "_index_iter", None))


def count_next(counter: Any) -> int | None:
    """What ``next()`` of an ``itertools.count`` would give, read without
    taking it (from its repr, ``count(N)``); None for anything else."""
    text = repr(counter)
    if text.startswith("count(") and text.endswith(")"):
        try:
            return int(text[6:-1])
        except ValueError:
            pass
    return None


def _own_finalizers() -> list[Any]:
    """At a zygote worker's exit: the weakref.finalize callbacks that the
    worker created, latest first, as ``finalize._exitfunc`` runs them, and
    none of the zygote's (a temporary directory the zygote made would be
    removed by the first worker to exit); finish runs those marked to run
    at exit.  A worker that made none, the usual case, touches nothing: the
    zygote may hold many (torch: 134), and walking them in every worker
    would copy the pages they sit on."""
    weakref = sys.modules.get("weakref")
    finalize = getattr(weakref, "finalize", None)
    registry = getattr(finalize, "_registry", None)
    if not registry:
        return []
    first_own = zygote_finalizer_index
    if first_own is None or next_finalizer_index(finalize) == first_own:
        return []  # the worker made none (or, unreadable, none is known to be its)
    own = [(info.index, f) for f, info in list(registry.items()) if info.index >= first_own]
    return [made_here for _index, made_here in sorted(own, key=lambda pair: pair[0], reverse=True)]


def _exit_multiprocessing(util: Any) -> None:
    """multiprocessing's exit function, which a worker runs first, as
    ``Process._bootstrap`` does, unless it has nothing to do here: no
    ``Finalize`` registered (the zygote's too: it tells them apart by pid),
    no child process started, no logger of multiprocessing's to write its
    lines to.  Then only its flag is set (``util.is_exiting()``).  Its
    first run in a rank cost 71-75 us and 11-14 page copies of every
    rank's exit (Intel Xeon; benchmarks/README.md, "A launch to its join,
    and a rank's exit")."""
    from multiprocessing import process

    children = process._children  # type: ignore[attr-defined]
    if util._finalizer_registry or children or util._logger is not None:
        util._exit_function()
    else:
        util._exiting = True


def _shutdown_shows(more_to_run: bool) -> bool:
    """Whether threading's shutdown (which joins the non-daemonic threads,
    after the callbacks registered with ``threading._register_atexit``)
    could do anything that shows in a worker about to ``os._exit``: a
    thread besides this one, a callback that is not concurrent.futures'
    (which stops and joins its executors' threads: there are none), or,
    ``more_to_run``, the worker's own code to run after, which could see
    what the shutdown sets.  With torch imported (so concurrent.futures),
    the shutdown took 172 us and 22 page copies of each rank's exit, 66
    and 9 without (Intel Xeon, the same section).  Each of those two
    modules registers one callback as it is imported, and nothing takes
    one back: as many callbacks as them are theirs."""
    if more_to_run or threading.active_count() > 1:
        return True
    callbacks = getattr(threading, "_threading_atexits", None)
    if callbacks is None:
        return True  # a threading unlike 3.10-3.13's: as it is
    modules = sys.modules
    known = ("concurrent.futures.thread" in modules) + ("concurrent.futures.process" in modules)
    return len(callbacks) != known


# A worker forked from the caller runs, at its exit, the atexit handlers it
# registered itself from Python 3.13 on, as multiprocessing's fork children
# do there (CPython gh-83856); before, none (see forget_exit_handlers).
FORK_EXIT_HANDLERS: Literal["since_fork", "none"] = (
    "since_fork" if sys.version_info >= (3, 13) else "none"
)


def forget_exit_handlers() -> None:
    """In a worker just forked from the caller, from Python 3.13 on: its
    atexit handlers are the caller's, not its own; clear them and register
    multiprocessing's exit function, as multiprocessing's fork child does.
    finish() then runs what the worker registers, then that function.
    (Before 3.13, nothing: finish() runs none of them.)"""
    if FORK_EXIT_HANDLERS != "since_fork":
        return
    from multiprocessing import util

    atexit._clear()
    atexit.register(util._exit_function)  # type: ignore[attr-defined]


def _end_worker(util: Any, own: bool) -> None:
    """finish() of a zygote worker (``own``) or of one forked from the
    caller before Python 3.13: multiprocessing's exit function, threading's
    shutdown, then (``own``) the finalizers and atexit handlers the worker
    made, the launches it left unjoined, the logging handlers it added."""
    _exit_multiprocessing(util)
    finalizers = _own_finalizers() if own else []
    later = bool(finalizers) or launches_at_exit is not None
    if _shutdown_shows(later or (own and (bool(_worker_exit_handlers) or _logging_added()))):
        threading._shutdown()  # type: ignore[attr-defined]
        if own:  # the threads it waited for may have made more
            finalizers = _own_finalizers()
    for made_here in finalizers:
        if made_here.atexit:
            made_here()
    if own:
        _run_worker_exit_handlers()
    # Launches this worker made and left unjoined: waited for (or, if
    # daemonic, stopped) as at any interpreter exit, once its threads
    # (which may be joining them) are done.
    if launches_at_exit is not None:
        launches_at_exit()
    if own and _logging_added():
        sys.modules["logging"].shutdown()


def _logging_added() -> bool:
    """Whether logging's shutdown is due at a zygote worker's exit: its
    atexit hook was the zygote's, so only for handlers the worker added (the
    zygote's are stream and file handlers unless it set up others, which
    flush at every record, and closing them would only copy their pages)."""
    logging = sys.modules.get("logging")
    return logging is not None and len(logging._handlerList) != zygote_handlers


def finish(
    code: int, signum: int, exit_handlers: Literal["all", "own", "since_fork", "none"]
) -> NoReturn:
    """Run what multiprocessing runs at a worker's end, then exit with
    ``code`` (0..255), or die by ``signum`` when it is not 0.  Nothing
    raised on the way (a SIGINT, a failing handler) stops the exit: a worker
    must never return into the code that forked it.

    ``exit_handlers``: ``"all"`` for a spawned worker (every atexit
    handler), ``"own"`` for a zygote worker (those it registered, see
    capture_worker_exit_handlers, then logging's flush); for a worker
    forked from the caller, as multiprocessing's fork workers,
    FORK_EXIT_HANDLERS: ``"since_fork"`` (those registered since
    forget_exit_handlers, multiprocessing's exit function last) or
    ``"none"``."""
    try:
        try:
            from multiprocessing import util

            if exit_handlers == "since_fork":
                threading._shutdown()  # type: ignore[attr-defined]
                atexit._run_exitfuncs()  # its own, then multiprocessing's
                if launches_at_exit is not None:
                    launches_at_exit()  # (see _end_worker)
            elif exit_handlers == "all":
                util._exit_function()  # type: ignore[attr-defined]
                threading._shutdown()  # type: ignore[attr-defined]
                atexit._run_exitfuncs()
            else:
                _end_worker(util, exit_handlers == "own")
        except BaseException:
            print_exc()
        flush_std_streams()
        if signum:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            os.kill(os.getpid(), signum)
    finally:
        os._exit(code & 0xFF)


def set_parent_process(caller: int) -> None:
    """Make ``multiprocessing.parent_process()`` the caller, as in a spawned
    or forked multiprocessing child (code tells a worker from the main
    process by it).  Its sentinel is a pidfd of the caller: ready once the
    caller has exited."""
    from multiprocessing import process

    try:
        # os's, not oscall's: a spawned worker has not loaded the C
        # extension, and this is its only use of it before fn.
        sentinel = os.pidfd_open(caller)
    except OSError:
        return  # the caller is gone: PR_SET_PDEATHSIG ends us anyway
    process._parent_process = process._ParentProcess(  # type: ignore[attr-defined]
        "MainProcess", caller, sentinel
    )
