"""The worker side: run ``fn(rank, *args)``, report, exit.

Two entries, one per way a worker comes to life:
- ``forked_child``: right after os.fork() in the caller (start method "fork")
  or in the zygote ("zygote", and "forkserver", which it serves).
- ``spawn_main``: a fresh interpreter exec'd by the C launcher ("spawn").
Each ends in ``os._exit`` with the worker's exit code.
"""

from __future__ import annotations

import atexit
import faulthandler
import io
import os
import pickle
import signal
import socket
import sys
import threading

from fastspawn import _channel, _pickling

# A spawned worker imports this module on every start: what only some paths
# need (typing, traceback, random, the cffi core) is imported where used.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, Literal, NoReturn


def format_exc() -> str:
    import traceback

    return traceback.format_exc()


def print_exc() -> None:
    import traceback

    traceback.print_exc()


# Raised SystemExit codes that are not ints print and exit 1, as Python does.


def entry_code(call: str, first: str = "") -> str:
    """``python -c`` code that imports this very fastspawn, then runs ``call``
    (after the statement ``first``, if given).

    ``-c`` puts the current directory first on sys.path: run from a source
    checkout (a ``fastspawn/`` folder without its built extension), the child
    would import that instead of the installed package.  The caller's package
    directory goes first instead; the caller's full sys.path follows later,
    when the child prepares like a spawn child.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    module, _, function = call.rpartition(".")
    return (
        f"import sys; sys.path[:1] = [{root!r}] + [p for p in sys.path[:1] if p]; "
        f"{first}{'; ' if first else ''}from {module} import {function}; {function}()"
    )


def _exit_code(exc: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` gives a process: an int modulo 256
    (``sys.exit(-1)`` exits 255), None 0, anything else printed and 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_during_prepare(rank: int, code: int) -> None:
    """The fn of a zygote worker whose main module exited while the zygote
    imported it: exit the same way, as a spawned worker would have."""
    raise SystemExit(code)


def _report(tx: socket.socket, channel: tuple[int, int], rank: int, kind: int, body: bytes) -> None:
    """Send a report on ``tx`` if its fd is still the channel it was when
    the worker started (``channel``: its st_dev, st_ino).  A worker that
    closed its inherited fds (``os.closerange``) has no channel left, and
    one that opened something since may have the number back: the report
    is then dropped with a line on stderr, never written into that file or
    connection.  The exit code still tells the caller how the rank ended.
    """
    from fastspawn import _oscall  # loaded in the forking process already

    if not _oscall.fd_is(tx.fileno(), *channel):
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


def channel_identity(tx: socket.socket) -> tuple[int, int]:
    """(st_dev, st_ino) of a report channel: what _report checks its fd
    still is.  Taken once per launch by the forking process."""
    stat = os.fstat(tx.fileno())
    return stat.st_dev, stat.st_ino


def run(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    tx: socket.socket,
    channel: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Call ``fn(rank, *args)`` and report its outcome on ``tx``.

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
        channel = channel_identity(tx)
    rank_pid = os.getpid()
    signum = 0
    code = 0
    try:
        value = fn(rank, *args)
    except KeyboardInterrupt:
        signum = signal.SIGINT
        code = 1
    except SystemExit as exc:
        code = _exit_code(exc)
        value = None
    except BaseException:
        code = 1
        if os.getpid() != rank_pid:
            print_exc()
        else:
            _report(tx, channel, rank, _channel.ERROR, format_exc().encode("utf-8", "replace"))
    if os.getpid() != rank_pid:
        return code, signum
    if code == 0 and not signum:
        try:
            body = _pickling.dumps_result(value)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            _report(tx, channel, rank, _channel.UNPICKLABLE, why.encode("utf-8", "replace"))
        else:
            _report(tx, channel, rank, _channel.RESULT, body)
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


# Set in the zygote before it forks (see _server): the index of the next
# weakref.finalize to be made (those below it are the zygote's, which its
# workers must not run at their exit), and how many logging handlers it has.
zygote_finalizer_index: int | None = None
zygote_handlers = -1


# In the zygote's workers: the atexit handlers each registered, run at its
# exit by _finish (see capture_worker_exit_handlers).
_worker_exit_handlers: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
_zygote_pid = 0


def capture_worker_exit_handlers() -> None:
    """In the zygote, before user code runs: make ``atexit.register`` (and
    ``unregister``) called in one of its workers keep the handler for that
    worker's exit, run by _finish, as a spawned worker runs what it
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
    text = repr(getattr(finalize, "_index_iter", None))
    if text.startswith("count(") and text.endswith(")"):
        try:
            return int(text[6:-1])
        except ValueError:
            pass
    return None


def _run_own_finalizers() -> None:
    """At a zygote worker's exit: run the weakref.finalize callbacks marked
    to run at exit that the worker created, latest first, as
    ``finalize._exitfunc`` does, and none of the zygote's (a temporary
    directory the zygote made would be removed by the first worker to
    exit).  A worker that made none, the usual case, touches nothing: the
    zygote may hold many (torch: 134), and walking them in every worker
    would copy the pages they sit on."""
    weakref = sys.modules.get("weakref")
    finalize = getattr(weakref, "finalize", None)
    registry = getattr(finalize, "_registry", None)
    if not registry:
        return
    first_own = zygote_finalizer_index
    if first_own is None or next_finalizer_index(finalize) == first_own:
        return  # the worker made none (or, unreadable, none is known to be its)
    own = [(info.index, f) for f, info in list(registry.items()) if info.index >= first_own]
    for _index, made_here in sorted(own, key=lambda pair: pair[0], reverse=True):
        if made_here.atexit:
            made_here()


def _finish(code: int, signum: int, exit_handlers: Literal["all", "own", "none"]) -> NoReturn:
    """Run what multiprocessing runs at a worker's end, then exit with
    ``code`` (0..255), or die by ``signum`` when it is not 0.  Nothing
    raised on the way (a SIGINT, a failing handler) stops the exit: a worker
    must never return into the code that forked it.

    ``exit_handlers``: ``"all"`` for a spawned worker (every atexit
    handler), ``"own"`` for a zygote worker (those it registered, see
    capture_worker_exit_handlers, then logging's flush), ``"none"`` for a
    worker forked from the caller, as multiprocessing's fork workers."""
    try:
        try:
            from multiprocessing import util

            util._exit_function()  # type: ignore[attr-defined]
            threading._shutdown()  # type: ignore[attr-defined]
            if exit_handlers == "all":
                atexit._run_exitfuncs()
            else:
                if exit_handlers == "own":
                    _run_own_finalizers()
                    _run_worker_exit_handlers()
                # Launches this worker made and left unjoined: waited for
                # (or, if daemonic, stopped) as at any interpreter exit, once
                # its threads (which may be joining them) are done.  That is
                # fastspawn's own atexit handler, registered before the fork.
                context = sys.modules.get("fastspawn._context")
                if context is not None:
                    context._at_exit()
                logging = sys.modules.get("logging")
                # Its atexit hook was the zygote's.  Only for handlers the
                # worker added: the zygote's are stream and file handlers
                # unless it set up others, which flush at every record, and
                # closing them would only copy their pages.
                if (
                    exit_handlers == "own"
                    and logging is not None
                    and len(logging._handlerList) != zygote_handlers
                ):
                    logging.shutdown()
        except BaseException:
            print_exc()
        flush_std_streams()
        if signum:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            os.kill(os.getpid(), signum)
    finally:
        os._exit(code & 0xFF)


def stdout_shows_lines() -> bool:
    """Whether this process's ``sys.stdout`` shows each line as it is
    printed: a terminal's (line-buffered), or a notebook's (no file at all:
    ipykernel's stream forwards what it is given).  The caller asks, for
    its workers (line_buffer_stdout)."""
    stream = sys.stdout
    return stream is not None and bool(getattr(stream, "line_buffering", True))


def line_buffer_stdout() -> None:
    """Make ``sys.stdout`` line-buffered, for workers whose caller's stdout
    shows lines as they come (stdout_shows_lines).  A notebook's workers
    write to a pipe that the kernel forwards to the cell, and Python
    block-buffers a pipe: a rank's prints would reach the cell only when it
    exits, or when 8 KB had gathered.  Unbuffered (``PYTHONUNBUFFERED``, as
    some notebook images set) writes a line and its newline apart, and the
    ranks' lines would be cut into one another: each line goes whole."""
    stream = sys.stdout
    if stream is None or (
        getattr(stream, "line_buffering", True) and not getattr(stream, "write_through", False)
    ):
        return
    try:
        stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        pass  # replaced by an object of the user's, or closed


def _after_fork(rank: int, daemon: bool) -> None:
    """Reset the multiprocessing state a forked worker inherited.

    Every step here costs a worker the pages it writes (refcounts, frames):
    the modules come from sys.modules (``from multiprocessing import``
    runs importlib's Python), the after-fork callables only where there are
    some, the name without its property: some 10 page copies less a
    worker, counted with getrusage's minor faults."""
    process = _loaded("multiprocessing.process")
    util = _loaded("multiprocessing.util")
    util._finalizer_registry.clear()
    if util._afterfork_registry:
        util._run_after_forkers()
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


def quiet_stdin() -> None:
    """Make ``sys.stdin`` read /dev/null, as multiprocessing gives its
    children: a worker that reads the terminal (``input()``, a stray
    ``breakpoint()``) gets EOFError instead of stopping on SIGTTIN in its
    background process group and hanging the job.

    fd 0 is pointed at /dev/null too, but only when it is what ``sys.stdin``
    reads: a caller started with stdin closed has none (``sys.stdin`` is
    None, and its fd 0 may be a Pipe passed to this worker since).  The old
    ``sys.stdin`` is not closed: in a worker forked from a caller with
    threads, one may have been reading it at the fork, its lock held for
    good (``sys.__stdin__`` keeps it from being collected)."""
    stdin = sys.stdin
    if stdin is None:
        return
    try:
        reads_fd0 = stdin.fileno() == 0
    except (AttributeError, OSError, ValueError):  # replaced (pytest's), or closed
        reads_fd0 = False
    if not reads_fd0:
        sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the worker
        return
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    if fd == 0:  # fd 0 had been closed: this is it now
        os.set_inheritable(0, True)
    else:
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the worker


def _set_parent_process(caller: int) -> None:
    """Make ``multiprocessing.parent_process()`` the caller, as in a spawned
    or forked multiprocessing child (code tells a worker from the main
    process by it).  Its sentinel is a pidfd of the caller: ready once the
    caller has exited."""
    from multiprocessing import process

    from fastspawn import _oscall

    try:
        sentinel = _oscall.pidfd_open(caller)
    except OSError:
        return  # the caller is gone: PR_SET_PDEATHSIG ends us anyway
    process._parent_process = process._ParentProcess(  # type: ignore[attr-defined]
        "MainProcess", caller, sentinel
    )


def _redirect_stdio(stdio: Sequence[int], flush: bool = True) -> None:
    """Point fds 1 and 2 at the given fds (-1: leave as is), flushing first
    (``flush``: not in a zygote worker, whose zygote flushed before forking:
    the flush would only copy the stream's pages)."""
    for target, fd in zip((1, 2), stdio, strict=True):
        if fd >= 0 and fd != target:
            stream = sys.stdout if target == 1 else sys.stderr
            if flush and stream is not None:
                stream.flush()
            os.dup2(fd, target)
            os.close(fd)


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
    if "torch" not in sys.modules:
        return False
    return "OMP_NUM_THREADS" in os.environ or any("OMP_NUM_THREADS" in e for e in envs.values())


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


# The signal on which a worker writes the Python stacks of all its threads
# (faulthandler, from the signal handler: no cooperation from the code that
# runs, the GIL not needed) to a memfd of its own, named
# "fastspawn-stacks:RANK", which the launcher reads through /proc/PID/fd
# (see _stacks).  A real-time signal, which user code rarely takes; its
# default action would end the process, so the launcher sends it only to a
# process that shows it caught (SigCgt) and holds such a memfd.
STACKS_SIGNAL = signal.SIGRTMIN + 20
STACKS_MEMFD = "fastspawn-stacks"
STACKS_PREFIX = STACKS_MEMFD.encode()  # fs_stacks_file's


def stacks_memfd(rank: int) -> int:
    """A new memfd for ``rank``'s stacks: a memfd never blocks the writer
    (a pipe left unread would hang the handler, and the rank with it) and
    needs no file on disk.  (faulthandler writes each line in several
    write() calls: the report channel, one message a write, cannot take
    them.)"""
    return os.memfd_create(f"{STACKS_MEMFD}:{rank}", os.MFD_CLOEXEC)


def _catches_stacks_signal() -> bool:
    """Whether this process catches STACKS_SIGNAL already (it is an armed
    rank, or code of its own took the signal), as the kernel says."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (STACKS_SIGNAL - 1) & 1)
    except OSError:
        pass
    return False


def _inherited_stacks_fd() -> int | None:
    """The stack memfd this process inherited, forked from an armed one
    (the registration it inherited too writes there), if any."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{STACKS_MEMFD}:"):
                return int(name)
        except OSError:
            pass  # the listing's own fd
    return None


def arm_stacks(rank: int) -> None:
    """Make this process write its stacks to a memfd of its own on
    STACKS_SIGNAL, itself: a spawned worker, or one forked from an armed
    rank (the new file then takes the place of the inherited one, its
    parent's, where the inherited registration writes).  Out of fds, the
    worker runs without.  (Forked workers are mostly born armed instead:
    see ForkStacks.)"""
    try:
        inherited = _inherited_stacks_fd()
        fd = stacks_memfd(rank)
    except OSError:
        return
    if inherited is not None:
        os.dup2(fd, inherited, inheritable=False)
        os.close(fd)
    else:
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True)


def disarm_stacks() -> None:
    """Drop the stack dump this process inherited from an armed parent (a
    launch with stacks off, forked from a rank), if it did."""
    inherited = _inherited_stacks_fd()
    if inherited is not None:
        faulthandler.unregister(STACKS_SIGNAL)
        os.close(inherited)


class ForkStacks:
    """The stack dumps of one forked launch's ranks (the zygote's, or
    start method fork's), armed by the forking process at no cost to the
    ranks: for the length of the fork loop faulthandler is registered
    there on one fd, and before each fork a new memfd for that rank takes
    that fd's place, so each rank is born armed with a file of its own.
    Registering and making the file in each worker instead copied some 20
    pages (80 KiB) per worker, measured.

    The loop itself calls the C function (``stacks_file(prefix, rank,
    fd)``, locals all): every page the forking process writes between two
    forks stays with the worker forked before as a page of its own, so a
    Python call there (frames, refcounts, a code object's counters) would
    cost each worker a few pages again.

    A forking process that catches the signal already (itself an armed
    rank, or code of its own took it) is left as it is: its workers then
    arm themselves (``in_worker`` True), or, with stacks off, drop what
    they inherited (``in_worker`` False).
    """

    def __init__(self, wanted: bool) -> None:
        caught = _catches_stacks_signal()
        self.here = wanted and not caught
        self.in_worker: bool | None = None if self.here or not caught else wanted
        self.fd = -1
        # fs_stacks_file, while the loop arms its ranks; else None.
        self.stacks_file: Callable[[bytes, int, int], int] | None = None

    def begin(self) -> None:
        """Before the fork loop: register, writing to /dev/null until a
        rank's file takes its place."""
        if not self.here:
            return
        from fastspawn import _oscall  # loaded in the forking process already
        from fastspawn._core import lib

        with _oscall.held_signals():  # a Ctrl-C here must not leave the fd open
            try:
                self.fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                return  # out of fds: the launch goes without
            faulthandler.register(STACKS_SIGNAL, file=self.fd, all_threads=True)
            self.stacks_file = lib.fs_stacks_file

    def failed(self) -> None:
        """A rank's file could not be made (out of fds): the rest of the
        launch goes without, never with another rank's file."""
        self.end()

    def end(self) -> None:
        """After the fork loop: the forking process keeps neither the
        registration nor a file."""
        self.stacks_file = None
        if self.fd < 0:
            return
        from fastspawn import _oscall

        with _oscall.held_signals():  # nor here: the last rank's file is in it
            fd, self.fd = self.fd, -1
            try:
                faulthandler.unregister(STACKS_SIGNAL)
            finally:
                os.close(fd)


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
            process's (see _procstate).
        from_zygote: forked from the zygote, not from the caller: the
            worker's own atexit handlers run at its exit.  A zygote worker's
            stdin (/dev/null) and ``multiprocessing.parent_process()`` (the
            caller) are the zygote's already.
        channel: ``channel_identity(tx)``.
        match_torch_threads: ``torch_threads_to_match(envs)``, decided once
            before forking (reading the environment in every worker, a
            KeyError and all, cost 150 us a worker with torch loaded).
        stacks: what each worker does of the stack dump itself: None
            nothing (born armed, or stacks off), True arm_stacks, False
            disarm_stacks (see ForkStacks.in_worker).
        parent_death_armed: PR_SET_PDEATHSIG is armed (and the parent
            checked) already, by the C fork loop (the zygote's).
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
        self.channel = channel_identity(tx)
        self.match_torch_threads = torch_threads_to_match(envs)
        self.stacks = stacks
        self.parent_death_armed = False


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
        _set_up_forked(spec, rank, stdio, close_fds)
        if spec.payload_error is not None:
            error = spec.payload_error.encode("utf-8", "replace")
            _channel.send(spec.tx, rank, _channel.ERROR, error)
        else:
            assert spec.fn is not None
            code, signum = run(rank, spec.fn, spec.args, spec.tx, spec.channel)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the caller closed its channel: it is gone or gave up on us
    except BaseException:
        print_exc()
    finally:
        _finish(code, signum, "own" if spec.from_zygote else "none")


def _set_up_forked(
    spec: ForkSpec, rank: int, stdio: Sequence[int] | None, close_fds: Sequence[int]
) -> None:
    """A forked worker's process set-up, before its fn runs."""
    if not spec.parent_death_armed:
        _arm_parent_death(spec.parent)
    for fd in (*spec.close_fds, *close_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    if stdio is not None:
        _redirect_stdio(stdio, flush=not spec.from_zygote)
    if spec.stdin == -1 and not spec.from_zygote:
        quiet_stdin()
    elif spec.stdin is not None and spec.stdin >= 0:
        os.dup2(spec.stdin, 0)
        os.close(spec.stdin)
    if spec.process_state:
        from fastspawn import _procstate

        _procstate.apply(spec.process_state)
    rank_env = spec.envs.get(rank)
    if rank_env:
        os.environ.update(rank_env)
    if spec.match_torch_threads:
        _match_torch_threads()
    _after_fork(rank, spec.daemon)
    if not spec.from_zygote:  # the zygote's is the caller already
        _set_parent_process(spec.parent)
    if spec.stacks is not None:  # no call otherwise: its pages would be copied
        _forked_stacks(spec, rank)


def _arm_parent_death(parent: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL) against ``parent``, or exit if it is gone."""
    from fastspawn import _oscall  # loaded in the forking process already

    try:
        _oscall.set_pdeathsig(signal.SIGKILL, parent)
    except ProcessLookupError:
        os._exit(1)  # the parent died before prctl: nobody wants us


def _forked_stacks(spec: ForkSpec, rank: int) -> None:
    """What a forked worker does of its stack dump itself, when its parent
    did not arm it (see ForkStacks)."""
    if spec.stacks:
        arm_stacks(rank)
    else:
        disarm_stacks()


def preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's spawn preparation data for a child named ``name``,
    less a main script that is not a file: a program read from stdin
    (``python -``) or deleted since.  The child then prepares as under
    ``python -c`` (no ``__mp_main__`` to import), where a multiprocessing
    spawn child would die on FileNotFoundError, and with it our zygote."""
    from multiprocessing import spawn

    data: dict[str, Any] = spawn.get_preparation_data(name)
    path = data.get("init_main_from_path")
    if path is not None and not os.path.isfile(path):
        del data["init_main_from_path"]
    return data


def prepare(preparation: dict[str, Any]) -> None:
    """multiprocessing.spawn.prepare, flagged as bootstrapping: a ``__main__``
    that starts processes at import time (no ``if __name__ == "__main__"``
    guard) then gets multiprocessing's clear RuntimeError instead of
    starting processes without end."""
    from multiprocessing import process, spawn

    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.prepare(preparation)
    finally:
        current._inheriting = False  # type: ignore[attr-defined]


def read_payload(fd: int) -> io.BytesIO:
    """The whole payload memfd, read at explicit offsets, then closed."""
    try:
        size = os.fstat(fd).st_size
        chunks = []
        offset = 0
        while offset < size:
            chunk = os.pread(fd, size - offset, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
    finally:
        os.close(fd)
    return io.BytesIO(b"".join(chunks))


def spawn_main() -> NoReturn:
    """Entry of a spawned worker (a fresh interpreter); never returns.

    argv: rank, payload fd, channel fd, daemon flag, stacks flag (see
    arm_stacks), resource tracker fd (-1: none), line-buffered stdout flag,
    then the inherited fds.
    PR_SET_PDEATHSIG was armed before exec by the C launcher, with the
    parent re-checked.
    """
    rank = int(sys.argv[1])
    payload_fd = int(sys.argv[2])
    tx = socket.socket(fileno=int(sys.argv[3]))
    tx.set_inheritable(False)  # inherited for exec only: not by our children
    daemon = sys.argv[4] == "1"
    if sys.argv[5] == "1":
        arm_stacks(rank)  # first: a main module whose import hangs shows where
    tracker_fd = int(sys.argv[6])
    if sys.argv[7] == "1":
        line_buffer_stdout()
    _pickling.inherited_fds[:] = [int(fd) for fd in sys.argv[8:]]
    code, signum = 1, 0
    try:
        quiet_stdin()
        # Every rank shares one payload file description, hence one offset:
        # read it with pread, never with read.
        with read_payload(payload_fd) as payload:
            from multiprocessing import process

            if tracker_fd >= 0:
                from multiprocessing import resource_tracker

                resource_tracker._resource_tracker._fd = tracker_fd  # type: ignore[attr-defined]
            try:
                preparation = pickle.load(payload)
                prepare(preparation)
                process.current_process()._config["daemon"] = daemon  # type: ignore[attr-defined]
                _set_parent_process(os.getppid())
                process.current_process().name = f"fastspawn-worker-{rank}"
                fn, args = pickle.load(payload)
            except BaseException:
                _channel.send(tx, rank, _channel.ERROR, format_exc().encode())
            else:
                for fd in _pickling.inherited_fds:
                    os.close(fd)  # the unpickled objects hold their own dups
                code, signum = run(rank, fn, args, tx)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the caller closed its channel: it is gone or gave up on us
    except BaseException:
        print_exc()
    finally:
        _finish(code, signum, "all")
