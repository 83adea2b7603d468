"""Copy workers' output pipes to their log files and, line by line with a
prefix, to the console: one thread, one epoll set, for every rank.

The thread must never stop draining: a rank blocks on its next write once
its pipe is full, so a failing log file or console is dropped (with one
warning) rather than allowed to end the thread."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from fastspawn._os.oscall import Waiter, start_quiet_thread

log = logging.getLogger(__name__)

READ_SIZE = 65536
# A line without its newline yet is held this long for the rest of it, then
# shown as it is: a progress bar redrawn with "\r" never sends a newline.
PARTIAL_DELAY = 0.15
# A held line this long is shown without waiting for its newline, so that a
# huge line is neither held whole in memory nor delayed to its end.
PARTIAL_MAX = 65536
# How often join() looks at the thread's progress.
_JOIN_STEP = 0.1


class _Console:
    """A console file, shared by every stream that writes to it."""

    def __init__(self, file: BinaryIO, name: str) -> None:
        self.file = file
        self.name = name
        self.broken = False
        # The stream whose last console line was shown without its newline
        # (a held partial line): its next bytes continue that line.
        self.open_line: _Stream | None = None


class LineFilter:
    """One file that gets, from every stream given it, each line containing
    any of ``needles``, with that stream's prefix: torch's
    ``duplicate_stdout_filters`` / ``duplicate_stderr_filters``.  Lines end
    where a text file's lines do (``\n``, ``\r\n`` or ``\r``), since
    torch reads them back from the log file as text.

    The Tee it is given to owns ``file`` and closes it.  A write that fails
    is warned about once; the file is dropped, the ranks' output goes on.
    """

    def __init__(self, file: BinaryIO, needles: list[str]) -> None:
        self.file: BinaryIO | None = file
        self.needles = [needle.encode() for needle in needles]

    def write(self, prefix: bytes, lines: list[bytes]) -> None:
        if self.file is None:
            return
        out = [prefix + line + b"\n" for line in lines if any(n in line for n in self.needles)]
        if not out:
            return
        try:
            self.file.write(b"".join(out))
            self.file.flush()
        except (OSError, ValueError) as exc:
            log.warning(
                "cannot write the filtered copy %s (%s): no more lines are written to it",
                _name(self.file),
                exc,
            )
            self.close()

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()
            except (OSError, ValueError):
                pass


def _text_lines(data: bytes, final: bool) -> tuple[list[bytes], bytes]:
    """``data`` cut into lines as a text file reads them (each without its
    ending), and the rest: an unfinished line, or a ``\r`` a ``\n`` may
    still follow (none when ``final``; nor once it is PARTIAL_MAX long)."""
    parts = data.splitlines(keepends=True)
    rest = b""
    if parts and not final and (parts[-1].endswith(b"\r") or not parts[-1].endswith(b"\n")):
        rest = parts.pop()
        if len(rest) >= PARTIAL_MAX:
            parts.append(rest)
            rest = b""
    lines = []
    for part in parts:
        if part.endswith(b"\r\n"):
            part = part[:-2]
        elif part.endswith((b"\n", b"\r")):
            part = part[:-1]
        lines.append(part)
    return lines, rest


@dataclass(eq=False)  # compared and hashed by identity: kept in a set
class _Stream:
    fd: int
    log: BinaryIO | None
    console: _Console
    prefix: bytes
    # Where its lines that match go too, and what of them is not a line yet.
    filtered: LineFilter | None = None
    filter_rest: bytes = b""
    # Bytes after the last newline, not shown on the console yet.
    partial: bytearray = field(default_factory=bytearray)
    # When the oldest byte of ``partial`` arrived (time.monotonic()).
    held_since: float = 0.0
    # The line left open on the console ends in a carriage return: what
    # continues it starts at column 0, so it needs the prefix again.
    after_return: bool = False


def _after_returns(prefix: bytes, segment: bytes) -> bytes:
    """``segment`` (bytes of one line, without its newline) with ``prefix``
    after each carriage return that more of the line follows: a progress bar
    redrawn with "\r" goes back to column 0, and would write over the prefix.
    A return at the end is left bare: a newline may follow (CRLF)."""
    if b"\r" not in segment:
        return segment
    if segment.endswith(b"\r"):
        return segment[:-1].replace(b"\r", b"\r" + prefix) + b"\r"
    return segment.replace(b"\r", b"\r" + prefix)


def _console(name: str) -> BinaryIO:
    stream = getattr(sys, name)
    return stream.buffer if hasattr(stream, "buffer") else stream  # type: ignore[no-any-return]


def _name(file: BinaryIO) -> str:
    return str(getattr(file, "name", repr(file)))


class Tee:
    """Reads every registered pipe until EOF.  Each complete line reaches the
    console with its prefix, in order per stream; bytes reach the log file,
    unchanged, as they come, before the console gets them.  Nothing is lost
    at a worker's end: the pipe is read to EOF, and a last line without a
    newline is flushed then.

    A line without its newline is shown (prefixed once) after
    :data:`PARTIAL_DELAY` seconds without one, or once :data:`PARTIAL_MAX`
    bytes long; its rest continues it unprefixed.

    A log file whose write fails (ENOSPC, EIO) is warned about once and
    closed; the console still gets the output.  A console whose write fails
    (EPIPE under ``| head``) is dropped the same way; the log files still get
    it.
    """

    def __init__(self) -> None:
        self._waiter = Waiter()
        self._streams: dict[int, _Stream] = {}
        self._consoles: dict[str, _Console] = {}
        self._held: set[_Stream] = set()  # streams with a non-empty partial
        self._filters: list[LineFilter] = []  # owned: closed with the streams
        self._thread: threading.Thread | None = None
        # For join(): bumped by the thread after each read and console
        # write; _console_busy is True while it sits in a console write.
        self._progress = 0
        self._console_busy = False

    def add_filter(self, file: BinaryIO, needles: list[str]) -> LineFilter:
        """A :class:`LineFilter` writing to ``file`` (taken over: closed with
        the Tee), for :meth:`add` to copy matching lines to."""
        line_filter = LineFilter(file, needles)
        self._filters.append(line_filter)
        return line_filter

    def add(
        self,
        fd: int,
        log: BinaryIO | None,
        console: str,
        prefix: str,
        filtered: LineFilter | None = None,
    ) -> None:
        """Watch read end ``fd``; ``console`` is ``"stdout"`` or ``"stderr"``;
        lines that ``filtered`` matches are copied there too.

        ``fd`` and ``log`` are taken over, even when this raises: closed at
        EOF, or by :meth:`close`."""
        token = len(self._streams)
        target = self._consoles.get(console)
        if target is None:
            try:
                target = self._consoles[console] = _Console(_console(console), console)
            except BaseException:
                os.close(fd)
                if log is not None:
                    log.close()
                raise
        # Recorded first, so that close() releases them if epoll_ctl fails.
        self._streams[token] = _Stream(fd, log, target, prefix.encode(), filtered)
        self._waiter.add(fd, token)

    def start(self) -> None:
        if self._streams:
            thread = threading.Thread(target=self._run, name="fastspawn-tee", daemon=True)
            start_quiet_thread(thread)
            self._thread = thread
        else:
            self._release()

    def close(self) -> None:
        """Release every pipe, log file and the epoll set without reading
        further: for a Tee that was never started (a launch that failed).

        Raises:
            RuntimeError: the reading thread runs; it closes them itself.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("Tee.close(): the tee thread is running; join() it instead")
        self._release()

    def _release(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        self._held.clear()
        for stream in streams:
            os.close(stream.fd)
            self._close_log(stream)
        filters, self._filters = self._filters, []
        for line_filter in filters:
            line_filter.close()
        self._waiter.close()

    # ------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            while self._streams:
                try:
                    ready = self._waiter.wait(self._hold_timeout())
                except InterruptedError:
                    continue
                for token in ready:
                    self._read(token)
                self._show_held(time.monotonic())
        except Exception:
            # Not expected; but a dead thread with the pipes still open
            # would leave every rank blocked on a full pipe for ever.
            # Closed (below), the pipes give the ranks EPIPE instead.
            log.exception("the output copying thread failed; ranks' output is no longer read")
        finally:
            self._release()

    def _hold_timeout(self) -> float | None:
        """Seconds until the oldest held partial line is due; None if none."""
        if not self._held:
            return None
        due = min(stream.held_since for stream in self._held) + PARTIAL_DELAY
        return max(0.0, due - time.monotonic())

    def _read(self, token: int) -> None:
        stream = self._streams[token]
        try:
            data = os.read(stream.fd, READ_SIZE)
        except OSError as exc:
            # Nothing more can be read from it: as at EOF, drop it (its
            # writer gets EPIPE rather than block on a pipe nobody reads).
            log.warning(
                "reading the output of %s failed (%s); no more of it is copied",
                stream.prefix.decode(errors="replace"),
                exc,
            )
            data = b""
        self._progress += 1
        if not data:
            self._end(token, stream)
            return
        # The log first: a console write may block (a paused terminal).
        self._write_log(stream, data)
        self._filter(stream, data, final=False)
        self._take(stream, data)

    def _write_log(self, stream: _Stream, data: bytes) -> None:
        if stream.log is None:
            return
        try:
            stream.log.write(data)
            stream.log.flush()
        except (OSError, ValueError) as exc:
            log.warning(
                "cannot write the log file %s (%s): no more output is written to it; "
                "the console, if teed, still gets it",
                _name(stream.log),
                exc,
            )
            self._close_log(stream)

    def _filter(self, stream: _Stream, data: bytes, final: bool) -> None:
        """Copy the lines of ``data`` that its filter matches (``final``: the
        stream ended, its last line is one too)."""
        if stream.filtered is None:
            return
        lines, stream.filter_rest = _text_lines(stream.filter_rest + data, final)
        stream.filtered.write(stream.prefix, lines)

    def _close_log(self, stream: _Stream) -> None:
        file, stream.log = stream.log, None
        if file is None:
            return
        try:
            # A buffered file flushes first, and may fail again (the disk is
            # still full); its fd is closed all the same.
            file.close()
        except (OSError, ValueError):
            pass

    def _take(self, stream: _Stream, data: bytes) -> None:
        """Show the complete lines of ``data``; hold the rest.  Work in
        proportion to ``data``: only the new bytes are scanned, and the held
        part, at most PARTIAL_MAX bytes, is copied once when shown."""
        cut = data.rfind(b"\n") + 1
        if cut:
            lines = bytes(stream.partial) + data[:cut] if stream.partial else data[:cut]
            stream.partial = bytearray(data[cut:])
            stream.held_since = time.monotonic()
            self._show(stream, lines)
        else:
            if not stream.partial:
                stream.held_since = time.monotonic()
            stream.partial += data
        if len(stream.partial) >= PARTIAL_MAX:
            self._show_partial(stream)
        elif stream.partial:
            self._held.add(stream)
        else:
            self._held.discard(stream)

    def _show_held(self, now: float) -> None:
        for stream in [s for s in self._held if now - s.held_since >= PARTIAL_DELAY]:
            self._show_partial(stream)

    def _show_partial(self, stream: _Stream) -> None:
        text = bytes(stream.partial)
        stream.partial.clear()
        self._held.discard(stream)
        self._show(stream, text)

    def _end(self, token: int, stream: _Stream) -> None:
        """EOF: show the last, unterminated line, and release the stream."""
        self._filter(stream, b"", final=True)
        if stream.partial:
            text = bytes(stream.partial) + b"\n"
            stream.partial.clear()
            self._show(stream, text)
        elif stream.console.open_line is stream:
            self._show(stream, b"\n")  # end the line that was shown unfinished
        self._held.discard(stream)
        del self._streams[token]
        self._waiter.remove(stream.fd)
        os.close(stream.fd)
        self._close_log(stream)

    def _show(self, stream: _Stream, text: bytes) -> None:
        """Write ``text`` to the console, each line that starts in it
        prefixed, and each redraw after a carriage return; ``text`` may end
        without a newline (the line is then left open, and ``stream``'s next
        text continues it)."""
        console = stream.console
        if console.broken:
            return
        parts = []
        if console.open_line is not None and console.open_line is not stream:
            # Another rank's line was left unfinished: end it, so that this
            # one starts on a line of its own with its prefix.
            parts.append(b"\n")
            console.open_line = None
        continues = console.open_line is stream
        # Continuing a line left open after a carriage return: the prefix
        # goes first, unless what follows is the newline (CRLF).
        again = continues and stream.after_return
        lines = text.split(b"\n")
        tail = lines.pop()  # b"" when text ends with a newline
        for i, line in enumerate(lines):
            if i or not continues or (again and line):
                parts.append(stream.prefix)
            parts += (_after_returns(stream.prefix, line), b"\n")
        if tail:
            if lines or not continues or again:
                parts.append(stream.prefix)
            parts.append(_after_returns(stream.prefix, tail))
            console.open_line = stream
            stream.after_return = tail.endswith(b"\r")
        else:
            console.open_line = None
            stream.after_return = False
        self._write_console(console, b"".join(parts))

    def _write_console(self, console: _Console, out: bytes) -> None:
        self._console_busy = True
        try:
            console.file.write(out)
            console.file.flush()
        except (OSError, ValueError) as exc:
            console.broken = True
            log.warning(
                "cannot write the ranks' output to %s (%s): no more of it goes there; "
                "log files still get it",
                console.name,
                exc,
            )
        finally:
            self._console_busy = False
            self._progress += 1

    # -------------------------------------------------------------- join

    def join(self, idle_timeout: float | None = 5.0) -> bool:
        """Wait until every pipe reached EOF and its output was written out.

        No bound on a tee that makes progress: a slow console (a paused
        terminal, a slow reader of a pipe) delays the end but loses nothing.

        Args:
            idle_timeout: give up, with a warning, once the thread has sat
                this many seconds waiting for data with pipes still open and
                none coming: a process other than the ranks (a daemonised
                child) holds a write end.  None: wait for ever.

        Returns:
            False if it gave up; the thread then goes on copying.
        """
        thread = self._thread
        if thread is None:
            return True
        seen = self._progress
        idle_since = time.monotonic()
        while True:
            thread.join(_JOIN_STEP)
            if not thread.is_alive():
                return True
            now = time.monotonic()
            if self._console_busy or self._progress != seen:
                seen = self._progress
                idle_since = now
            elif idle_timeout is not None and now - idle_since >= idle_timeout:
                open_ = sorted(
                    s.prefix.decode(errors="replace") for s in dict(self._streams).values()
                )
                log.warning(
                    "output of %s still open %.1f s after its ranks ended, with no data: "
                    "a process outside the ranks holds it; not waiting for it",
                    ", ".join(open_),
                    idle_timeout,
                )
                return False
