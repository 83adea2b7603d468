"""A Python script or module run as ``__main__`` in this process, as
``python -u script.py args`` (or ``python -u -m module args``) would run it
in a fresh interpreter: what each rank of ``fastspawn run train.py`` does in
a zygote worker, which has the preloaded modules imported already.

What differs from a fresh interpreter is listed in docs/elastic.md ("What
each rank runs"); in short: ``sys.modules`` holds what the zygote
imported, ``sys.flags`` and ``sys.orig_argv`` are the zygote's, and stdin
reads /dev/null.
"""

from __future__ import annotations

import builtins
import io
import os
import sys
import types
from collections.abc import Sequence
from typing import Any


class PythonMain:
    """A picklable entrypoint: ``PythonMain("train.py")("--epochs", "3")``
    runs train.py as ``__main__`` with ``sys.argv == ["train.py", "--epochs",
    "3"]``; ``PythonMain("pkg.train", module=True)`` runs a module as
    ``python -m`` does.

    ``__name__`` and ``__qualname__`` are the script's file name (the
    module's name): torch's elastic agent names an entrypoint by them in its
    logs, events and failures.
    """

    def __init__(self, target: str, module: bool = False) -> None:
        self.target = target
        self.module = module
        self.__name__ = self.__qualname__ = target if module else os.path.basename(target)

    def __repr__(self) -> str:
        kind = "module" if self.module else "script"
        return f"<fastspawn PythonMain {kind} {self.target!r}>"

    def __call__(self, *argv: str) -> None:
        run_main(self.target, self.module, argv)


def run_main(target: str, module: bool, argv: Sequence[str]) -> None:
    """Run ``target`` as ``__main__`` with ``argv`` after its name.

    An exception the script does not catch is printed on stderr as the
    interpreter prints it (its own frames only), then raised on, so that the
    rank fails with it; ``SystemExit`` passes through (the worker exits with
    its code).
    """
    _unbuffered_std_streams()
    _main_process()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # For good, not for the call (runpy.run_path would put the old one back
    # after it): threads and atexit handlers the script leaves, and pickles
    # of its classes, must find the script as __main__ until the rank exits.
    sys.modules["__main__"] = main
    try:
        if module:
            _run_module(target, argv)
        else:
            _run_path(target, argv, main)
    except SystemExit:
        raise
    except BaseException as exc:
        _print_uncaught(exc, main.__dict__)
        raise


def _main_process() -> None:
    """multiprocessing's view of this process as a fresh interpreter's: the
    main process, with no parent (code tells the main process from a
    worker by these), rather than a zygote worker of the launcher."""
    from multiprocessing import process

    process.current_process().name = "MainProcess"
    process._parent_process = None  # type: ignore[attr-defined]


def _run_module(name: str, argv: Sequence[str]) -> None:
    """``python -m name``: the current directory first on sys.path, then
    runpy's own entry for ``-m`` (it sets ``sys.argv[0]`` to the module's
    file and reports a module that cannot be found as the interpreter does)."""
    import runpy

    sys.argv = ["-m", *argv]
    _set_path0(os.getcwd())
    runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]


def _run_path(path: str, argv: Sequence[str], main: types.ModuleType) -> None:
    """``python path``: a file runs in ``main``, with its directory first on
    sys.path; a directory or zip file runs its ``__main__.py`` (runpy's
    ``-m __main__`` with ``path`` first on sys.path, as the interpreter does)."""
    import runpy
    from pkgutil import get_importer

    sys.argv = [path, *argv]
    if get_importer(path) is not None:  # a directory or a zip file, not a plain script
        _set_path0(path)
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    try:
        with io.open_code(os.path.abspath(path)) as f:
            source = f.read()
    except OSError as exc:
        # The interpreter's words, and its exit status (2).
        print(
            f"{sys.executable}: can't open file {os.path.abspath(path)!r}: "
            f"[Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    _set_path0(os.path.dirname(os.path.realpath(path)))
    main.__dict__.update(__file__=path, __package__=None, __spec__=None)
    if sys.version_info < (3, 15):  # 3.15 gives a script's __main__ no __cached__
        main.__dict__["__cached__"] = None
    # compile() reads a PEP 263 coding line from the bytes, as the interpreter does.
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _set_path0(directory: str) -> None:
    """What a fresh interpreter puts first on sys.path.  The zygote took on
    the caller's sys.path, whose first entry is the caller's own (the
    launcher's script directory): replace it, unless the caller ran with
    ``-P`` (safe_path: nothing was put there)."""
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        sys.path.insert(0, directory)
    else:
        sys.path[0] = directory


def _unbuffered_std_streams() -> None:
    """``python -u``, as torchrun starts every rank: stdout and stderr
    unbuffered, so that a rank's lines reach the console (and the logs) as
    soon as each is printed, in the order written, and none is lost when
    the rank is killed.  Line-buffered rather than written through: a
    stream that writes through writes a line and its newline apart, and
    ranks sharing the console would cut their lines into one another (only
    a line not yet ended waits for its newline)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:
            continue
        try:
            stream.flush()
            raw = io.FileIO(fd, "w", closefd=False)
        except (OSError, ValueError):
            continue  # closed: leave it as it is
        unbuffered = io.TextIOWrapper(
            raw, encoding=stream.encoding, errors=stream.errors, line_buffering=True
        )
        setattr(sys, name, unbuffered)
        setattr(sys, f"__{name}__", unbuffered)


def _print_uncaught(exc: BaseException, main_globals: dict[str, Any]) -> None:
    """Print ``exc`` as the interpreter prints an uncaught exception: through
    ``sys.excepthook``, from the script's first frame on (not fastspawn's or
    runpy's frames above it; none for a script that does not compile).  The
    exception keeps that shorter traceback: the hook prints the one it
    carries."""
    first = exc.__traceback__
    while first is not None and first.tb_frame.f_globals is not main_globals:
        first = first.tb_next
    # None: it failed before any of its lines ran (a SyntaxError, shown
    # with no frame, as the interpreter shows it).
    exc.with_traceback(first)
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except Exception:
        pass  # a broken hook must not hide the rank's own failure
