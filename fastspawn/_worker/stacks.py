"""A worker's stack dump, armed: on STACKS_SIGNAL faulthandler writes the
Python stacks of all its threads to a memfd of the worker's own, which the
launcher reads (see fastspawn._launch.stacks)."""

from __future__ import annotations

import faulthandler
import os
import signal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


# The signal on which a worker writes the Python stacks of all its threads
# (faulthandler, from the signal handler: no cooperation from the code that
# runs, the GIL not needed) to a memfd of its own, named
# "fastspawn-stacks:RANK", which the launcher reads through /proc/PID/fd
# (see fastspawn._launch.stacks).  A real-time signal, which user code rarely takes; its
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
        from fastspawn._os import oscall  # loaded in the forking process already

        with oscall.held_signals():  # a Ctrl-C here must not leave the fd open
            try:
                self.fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            except OSError:
                return  # out of fds: the launch goes without
            faulthandler.register(STACKS_SIGNAL, file=self.fd, all_threads=True)
            self.stacks_file = oscall.stacks_file

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
        from fastspawn._os import oscall

        with oscall.held_signals():  # nor here: the last rank's file is in it
            fd, self.fd = self.fd, -1
            try:
                faulthandler.unregister(STACKS_SIGNAL)
            finally:
                os.close(fd)


def python_rank_argv(rank: int, program: str, args: Sequence[str]) -> list[str]:
    """Arguments for this Python (after ``sys.executable``) that run the
    .py ``program`` with ``args`` as ``python -u program args`` would, the
    stack dump armed first (named for ``rank``).

    The program runs as ``__main__`` with the ``__file__``, ``__loader__``,
    ``sys.argv`` and ``sys.path[0]`` that Python gives a script, compiled
    from its file; a file that cannot be read, or a syntax error, reads and
    exits as Python's own; the traceback of an exception that ends the
    program starts at the program, as Python's (the bootstrap's frames are
    left out by the hook that prints it).  ``sys.orig_argv`` shows the
    bootstrap.  stdout and stderr are line-buffered rather than written
    through, so that ranks sharing the console never cut a line.
    """
    return ["-u", "-c", _PYTHON_RANK_BOOT, str(rank), program, *args]


# Runs in __main__, which must end up as Python leaves it for a script: the
# one name bound here is deleted before the program runs.  An exception
# that ends the program goes on to the interpreter, which prints it and
# exits as for any script; the hook it prints with (sys.excepthook as the
# program left it) is handed the traceback less the bootstrap's frames,
# which all come from "<string>" and come first.
_PYTHON_RANK_BOOT = f"""\
def _fastspawn_boot():
    import faulthandler, os, sys

    def run(path):
        full = os.path.abspath(path)
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as exc:
            sys.stderr.write(
                f"{{sys.orig_argv[0]}}: can't open file {{full!r}}: [Errno {{exc.errno}}] "
                f"{{exc.strerror}}\\n"
            )
            raise SystemExit(2) from None
        if not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.path.dirname(os.path.realpath(path))
        from importlib.machinery import SourceFileLoader

        loader = SourceFileLoader("__main__", full)
        main.__dict__.update(__file__=full, __loader__=loader)
        if sys.version_info < (3, 15):  # 3.15 gives a script's __main__ no __cached__
            main.__dict__["__cached__"] = None
        exec(compile(source, full, "exec", dont_inherit=True), main.__dict__)

    def excepthook(kind, value, tb, original=None):
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next
        if isinstance(value, BaseException):
            value.__traceback__ = tb  # what the hook prints from
        original(kind, value, tb)

    rank, path = sys.argv[1:3]
    del sys.argv[:2]
    try:
        fd = os.memfd_create("{STACKS_MEMFD}:" + rank, os.MFD_CLOEXEC)
    except OSError:
        pass
    else:
        faulthandler.register({STACKS_SIGNAL}, file=fd, all_threads=True)
    # python -u writes a line and its newline apart, and ranks sharing the
    # console cut their lines into one another: line-buffered, each line
    # goes out whole, as soon as it is printed.
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False):
            stream.reconfigure(line_buffering=True, write_through=False)
    main = sys.modules["__main__"]
    del main._fastspawn_boot
    try:
        run(path)
    except BaseException:
        excepthook.__defaults__ = (sys.excepthook,)  # as the program left it
        sys.excepthook = excepthook
        raise


_fastspawn_boot()
"""
