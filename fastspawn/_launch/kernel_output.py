"""The workers' last output before the caller's next line, in a notebook.

A Jupyter kernel (ipykernel 6 or later) points its fds 1 and 2 at pipes
and forwards what arrives there to the running cell from a thread of its
own; what the kernel itself prints reaches the cell at once.  A worker's
last lines, written just before it exits, can therefore still sit in the
pipe, or in that thread's hands, when ``join()`` returns and the caller
prints its result: they would show after it.  ``catch_up()`` waits, once
the workers have ended, until the kernel's thread has taken everything and
is back waiting on an empty pipe.  Outside a kernel it does nothing.
"""

from __future__ import annotations

import fcntl
import platform
import struct
import sys
import termios
import threading
import time
from typing import Any

# read(2)'s number, for /proc/<tid>/syscall; where the machine is not
# listed, an empty pipe and a moment for the thread are the test.
_READ = {"x86_64": 0, "aarch64": 63, "riscv64": 63, "ppc64le": 3, "s390x": 3}.get(
    platform.machine()
)
_LIMIT = 1.0  # seconds: a kernel that falls further behind is not waited for


def _watched(stream: Any) -> tuple[int, threading.Thread] | None:
    """The read end of the pipe a kernel's stream watches, and its thread."""
    fid = getattr(stream, "_fid", None)
    thread = getattr(stream, "watch_fd_thread", None)
    if not getattr(stream, "_should_watch", False) or not isinstance(fid, int):
        return None
    if not isinstance(thread, threading.Thread) or not thread.is_alive():
        return None
    return fid, thread


def _unread(fd: int) -> int:
    try:
        (count,) = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))
    except OSError:
        return 0
    return int(count)


def _waits_on(thread: threading.Thread, fd: int) -> bool | None:
    """Whether ``thread`` is blocked in read(fd); None where that cannot be
    told (an unlisted machine, /proc not readable)."""
    if _READ is None or thread.native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as status:
            fields = status.read().split()
    except OSError:
        return None
    # "running", "-1 sp pc" (not in a syscall), or "nr arg1 ... sp pc".
    if len(fields) < 2 or not fields[0].isdigit():
        return False
    return int(fields[0]) == _READ and int(fields[1], 16) == fd


def catch_up(limit: float = _LIMIT) -> None:
    """Wait (at most ``limit`` seconds) until a kernel has forwarded what
    the ended workers wrote to its stdout and stderr."""
    pending = [found for found in map(_watched, (sys.stdout, sys.stderr)) if found]
    deadline = time.monotonic() + limit
    for fd, thread in pending:
        while time.monotonic() < deadline and thread.is_alive():
            if _unread(fd) == 0:
                waiting = _waits_on(thread, fd)
                if waiting:
                    break
                if waiting is None:
                    time.sleep(0.01)  # let the thread hand on what it read
                    break
            time.sleep(0.001)
    if pending:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
