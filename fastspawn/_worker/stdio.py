"""A worker's standard streams: stdin from /dev/null, stdout line-buffered
where the caller shows lines as they come, each line written whole, fds 1
and 2 redirected."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TextIO


def stdout_shows_lines() -> bool:
    """Whether this process's ``sys.stdout`` shows each line as it is
    printed: a terminal's (line-buffered), or a notebook's (no file at all:
    ipykernel's stream forwards what it is given).  The caller asks, for
    its workers (line_buffer_stdout).  A closed stream (a StringIO put
    there and closed) shows nothing."""
    stream = sys.stdout
    try:
        return stream is not None and bool(getattr(stream, "line_buffering", True))
    except ValueError:  # "I/O operation on closed file"
        return False


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
    _line_buffered(stream)


def whole_lines() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` write each line with one
    write(), where they write through (``PYTHONUNBUFFERED``, ``python -u``,
    as many container images set): a stream that writes through writes a
    line and its newline apart, and ranks sharing a pipe or a file cut their
    lines into one another there.  Line-buffered instead, each line still
    goes out as soon as it is printed, whole.  Streams that do not write
    through are left as they are (a block-buffered one writes 8 KB at a
    time, which can cut a line only where a buffer fills)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and getattr(stream, "write_through", False):
            _line_buffered(stream)


def _line_buffered(stream: TextIO) -> None:
    """Flush at each newline, in one write; never write through."""
    try:
        stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        pass  # replaced by an object of the user's, or closed


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


def redirect_stdio(stdio: Sequence[int], flush: bool = True) -> None:
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
