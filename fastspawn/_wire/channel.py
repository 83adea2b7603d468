"""The per-launch report channel: workers (and the server) to the caller.

One SOCK_SEQPACKET socketpair per launch.  The caller keeps the receiving end;
every worker of the launch (and the fork server, when one launched them)
holds the sending end.  The pair is private to this process tree: nothing
goes through the file system, so no other local user can plant a report, and
nothing is left behind.

Each message is a header (rank, kind, flags) and a body of at most
``CHUNK`` bytes; seqpacket keeps message boundaries and sends each whole, so
concurrent writers never interleave.  Longer bodies travel as several
messages, the last one flagged.
"""

from __future__ import annotations

import array
import errno
import os
import socket
import struct

TYPE_CHECKING = False  # not typing's: workers import this module
if TYPE_CHECKING:
    import mmap

HEADER = struct.Struct("<iBB")
CHUNK = 32 * 1024
LAST = 1

RESULT = 1  # body: pickled return value
ERROR = 2  # body: the worker's formatted traceback, UTF-8
UNPICKLABLE = 3  # body: why the return value could not be pickled, UTF-8
EXIT = 4  # body: int32 (rank, exit status) pairs (server)
PIDS = 5  # body: int32 pids for ranks rank, rank+1, ...; pidfds as SCM_RIGHTS
LAUNCH_FAILED = 6  # body: a LaunchFailure (rank -1)
GROUP = 7  # body: int32 id of the launch's process group (server, rank -1)
TAKEN = 8  # empty: the zygote took the launch, before any rank of it could start (rank -1)

MAX_FDS = 250  # SCM_MAX_FD is 253 per message


class LaunchFailure:
    """Why a launch's ranks could not start (LAUNCH_FAILED's body, from
    the zygote; or the caller's own finding).

    As _posixsubprocess reports a child's failure, by number: ``errno`` is
    that of the system call that failed and ``call`` names it and where
    (``"fork of rank 57 of 60 in the zygote"``), so that the caller raises
    the OSError subclass the call would have raised there (BlockingIOError
    for EAGAIN, with what to do).  ``errno`` 0: no system call failed (a
    bug), and ``detail`` (the server's traceback) says what did.
    """

    __slots__ = ("errno", "call", "detail")

    _HEAD = struct.Struct("<iI")  # errno, length of call in bytes

    def __init__(self, errno: int, call: str, detail: str = "") -> None:
        self.errno = errno
        self.call = call
        self.detail = detail

    def __repr__(self) -> str:
        return f"LaunchFailure(errno={self.errno}, call={self.call!r})"

    def encode(self) -> bytes:
        """One message's worth: a long detail keeps its end (where a
        traceback says what failed)."""
        call = self.call.encode()[: CHUNK // 2]
        room = CHUNK - self._HEAD.size - len(call)
        detail = self.detail.encode()[-room:]
        return self._HEAD.pack(self.errno, len(call)) + call + detail

    @classmethod
    def decode(cls, body: bytes) -> LaunchFailure:
        err, length = cls._HEAD.unpack_from(body)
        start = cls._HEAD.size
        call = body[start : start + length].decode("utf-8", "replace")
        return cls(err, call, body[start + length :].decode("utf-8", "replace"))


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(receiving end for the caller, sending end for the workers)."""
    rx, tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return rx, tx


def send(sock: socket.socket, rank: int, kind: int, body: bytes, flags: int = 0) -> None:
    """Send ``body`` whole, in chunks; blocking."""
    view = memoryview(body)
    start = 0
    while True:
        piece = view[start : start + CHUNK]
        start += len(piece)
        last = start >= len(view)
        sock.sendmsg([HEADER.pack(rank, kind, LAST if last else 0), piece], [], flags)
        if last:
            return


def pack_statuses(values: list[int]) -> bytes:
    return array.array("i", values).tobytes()


def unpack_statuses(body: bytes) -> list[int]:
    values = array.array("i")
    values.frombytes(body)
    return values.tolist()


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """One message and the fds that came with it, close-on-exec (a binary a
    worker becomes must not inherit them), and the message flags.

    Not socket.recv_fds: it takes a flags argument but does not pass it on
    (CPython 3.10-3.13)."""
    data, ancdata, msg_flags, _addr = sock.recvmsg(
        bufsize, socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC
    )
    return data, _fds_of(ancdata), msg_flags


def recv_fds_into(
    sock: socket.socket, buffer: mmap.mmap, maxfds: int
) -> tuple[bytes, list[int], int]:
    """recv_fds, the message read into ``buffer`` (writable, kept for the
    next): recvmsg() allocates a bytes object of the whole size asked for
    at every call, and for the zygote's control messages (read with room
    for 1 MiB, sent a few hundred bytes) that was an mmap and its unmap on
    every launch's way to its first rank."""
    size, ancdata, msg_flags, _addr = sock.recvmsg_into(
        [buffer], socket.CMSG_SPACE(maxfds * 4), socket.MSG_CMSG_CLOEXEC
    )
    return buffer[:size], _fds_of(ancdata), msg_flags


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, ctype, cdata in ancdata:
        if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
    return list(fds)


class Reports:
    """What the caller has read so far from one launch's channel.

    (A plain class: workers import this module, and dataclasses costs them
    milliseconds at every start.)
    """

    def __init__(self) -> None:
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, str] = {}
        self.unpicklable: dict[int, str] = {}
        self.exits: dict[int, int] = {}
        self.pids: dict[int, tuple[int, int]] = {}  # rank -> (pid, pidfd)
        self.group = 0  # the workers' process group (zygote launches), 0: none
        self.launch_failed: LaunchFailure | None = None
        # The zygote's first message (TAKEN): a launch whose channel ends
        # before it started no rank, and may go to another zygote.
        self.taken = False
        self.eof = False
        self._partial: dict[tuple[int, int], list[bytes]] = {}


class Receiver:
    """The caller's end of a launch channel."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.reports = Reports()

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> bool:
        """Read every message queued now; never blocks.  True if any was read.

        Signals are held throughout (the reads never block): a Ctrl-C raised
        between a receive and its message applied would lose a rank's
        result, its traceback or its exit status."""
        from fastspawn._os import oscall  # the caller's side only: workers never read

        got = False
        with oscall.held_signals():
            while not self.reports.eof:
                try:
                    got |= self._receive()
                except BlockingIOError:
                    break
        return got

    def read_blocking(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` for a message, then read every one queued
        by then (as drain).  True if one was read; False on timeout, or at
        EOF with nothing read.

        The wait is a poll(), which a Ctrl-C interrupts with nothing read;
        the reads do not block.  All that is queued once it returns is read
        in one held step: the ranks of a launch of 64 report about 60
        messages while its pidfds are on their way, and a held step per
        message (12 signal handlers swapped and put back, three sigmask
        calls) made 58 wakes of a launch of 64 where 18 do now."""
        import select
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not self.reports.eof:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poller.poll(None if left is None else left * 1000):
                return False
            if self.drain():
                return True
            # Woken for nothing (another reader took it), or at EOF: the
            # loop's test tells which.
        return False

    def _receive(self) -> bool:
        data, fds, msg_flags = recv_fds(self.sock, HEADER.size + CHUNK, MAX_FDS)
        if not data:
            for fd in fds:
                os.close(fd)
            self.reports.eof = True
            return False
        rank, kind, flags = HEADER.unpack_from(data)
        self._apply(rank, kind, flags, data[HEADER.size :], fds, msg_flags)
        return True

    def _apply(
        self, rank: int, kind: int, flags: int, body: bytes, fds: list[int], msg_flags: int
    ) -> None:
        """Apply one message by its kind.  Takes ownership of ``fds``: a PIDS
        message's become the ranks' pidfds, any other's are closed."""
        if kind == PIDS:
            self._apply_pids(rank, unpack_statuses(body), fds, msg_flags)
            return
        for fd in fds:  # no other kind carries fds
            os.close(fd)
        if kind == TAKEN:
            self.reports.taken = True
        elif kind == GROUP:
            self.reports.group = unpack_statuses(body)[0]
        elif kind == EXIT:
            pairs = unpack_statuses(body)
            for i in range(0, len(pairs) - 1, 2):
                self.reports.exits[pairs[i]] = pairs[i + 1]
        else:
            self._apply_part(rank, kind, flags, body)

    def _apply_pids(self, rank: int, pids: list[int], fds: list[int], msg_flags: int) -> None:
        """Ranks ``rank``, ``rank + 1``, ... started as ``pids``, with ``fds``
        their pidfds in the same order (-1 for those that did not arrive)."""
        r = self.reports
        for i, pid in enumerate(pids):
            r.pids[rank + i] = (pid, fds[i] if i < len(fds) else -1)
        if len(fds) < len(pids) and r.launch_failed is None:
            # The kernel dropped the fds it could not install here: out of
            # fds (it says which only by MSG_CTRUNC).
            missing = f"{len(pids) - len(fds)} of {len(pids)} missing"
            r.launch_failed = LaunchFailure(
                errno.EMFILE if msg_flags & socket.MSG_CTRUNC else 0,
                f"receiving the workers' pidfds: {missing}",
                f"the workers' pidfds did not arrive ({missing}); raise the limit on "
                "open files (ulimit -n) or start fewer ranks",
            )

    def _apply_part(self, rank: int, kind: int, flags: int, body: bytes) -> None:
        """One piece of a body that may span several messages (RESULT, ERROR,
        UNPICKLABLE, LAUNCH_FAILED): kept until the piece flagged LAST
        completes it, then stored by kind."""
        r = self.reports
        key = (rank, kind)
        parts = r._partial.setdefault(key, [])
        parts.append(body)
        if not flags & LAST:
            return
        whole = b"".join(r._partial.pop(key))
        if kind == RESULT:
            r.results[rank] = whole
        elif kind == ERROR:
            r.errors[rank] = whole.decode("utf-8", "replace")
        elif kind == UNPICKLABLE:
            r.unpicklable[rank] = whole.decode("utf-8", "replace")
        elif kind == LAUNCH_FAILED:
            r.launch_failed = LaunchFailure.decode(whole)

    def renew(self) -> socket.socket:
        """A new channel in place of one that ended with nothing said on it
        (a launch sent again): its sending end is returned, for the caller
        to close once sent."""
        from fastspawn._os import oscall  # the caller's side only: workers never read

        with oscall.held_signals():  # made, and in place of the old one
            rx, tx = channel_pair()
            rx.setblocking(False)
            self.sock.close()
            self.sock = rx
            self.reports = Reports()
        return tx

    def close(self) -> None:
        self.sock.close()
