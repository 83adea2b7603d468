"""Copy workers' output pipes to their log files and, line by line with a
prefix, to the console: one thread, one epoll set, for every rank."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import BinaryIO

from fastspawn._oscall import Waiter


@dataclass
class _Stream:
    fd: int
    log: BinaryIO | None
    console: BinaryIO
    prefix: bytes
    partial: bytearray = field(default_factory=bytearray)


def _console(name: str) -> BinaryIO:
    stream = getattr(sys, name)
    return stream.buffer if hasattr(stream, "buffer") else stream  # type: ignore[no-any-return]


class Tee:
    """Reads every registered pipe until EOF.  Each complete line reaches the
    console with its prefix, in order per stream; bytes reach the log file as
    they come.  Nothing is lost at a worker's end: the pipe is read to EOF,
    and a last line without a newline is flushed then."""

    def __init__(self) -> None:
        self._waiter = Waiter()
        self._streams: dict[int, _Stream] = {}
        self._thread: threading.Thread | None = None

    def add(self, fd: int, log: BinaryIO | None, console: str, prefix: str) -> None:
        """Watch read end ``fd``; ``console`` is ``"stdout"`` or ``"stderr"``.

        ``fd`` and ``log`` are taken over, even when this raises: closed at
        EOF, or by :meth:`close`."""
        token = len(self._streams)
        # Recorded first, so that close() releases them if epoll_ctl fails.
        self._streams[token] = _Stream(fd, log, _console(console), prefix.encode())
        self._waiter.add(fd, token)

    def start(self) -> None:
        if self._streams:
            thread = threading.Thread(target=self._run, name="fastspawn-tee", daemon=True)
            thread.start()
            self._thread = thread
        else:
            self._waiter.close()

    def close(self) -> None:
        """Release every pipe, log file and the epoll set without reading
        further: for a Tee that was never started (a launch that failed).

        Raises:
            RuntimeError: the reading thread runs; it closes them itself.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("Tee.close(): the tee thread is running; join() it instead")
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            os.close(stream.fd)
            if stream.log is not None:
                stream.log.close()
        self._waiter.close()

    def _run(self) -> None:
        try:
            while self._streams:
                try:
                    ready = self._waiter.wait(None)
                except InterruptedError:
                    continue
                for token in ready:
                    self._read(token)
        finally:
            self._waiter.close()

    def _read(self, token: int) -> None:
        stream = self._streams[token]
        data = os.read(stream.fd, 65536)
        if stream.log is not None and data:
            stream.log.write(data)
            stream.log.flush()
        stream.partial += data
        if not data:  # EOF: the last, unterminated line too
            if stream.partial:
                stream.partial += b"\n"
        lines, sep, rest = bytes(stream.partial).rpartition(b"\n")
        if sep:
            out = b"".join(stream.prefix + line + b"\n" for line in lines.split(b"\n"))
            stream.console.write(out)
            stream.console.flush()
            stream.partial = bytearray(rest)
        if not data:
            self._waiter.remove(stream.fd)
            os.close(stream.fd)
            if stream.log is not None:
                stream.log.close()
            del self._streams[token]

    def join(self, timeout: float | None) -> bool:
        """Wait until every pipe reached EOF; False if ``timeout`` ran out."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
