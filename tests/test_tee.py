"""The tee thread, driven directly over os.pipe() pairs: it must never stop
draining (a failing log file or console is dropped, not fatal), join() must
outwait a slow console, and partial lines are shown in linear time and
without waiting for their end."""

from __future__ import annotations

import errno
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from fastspawn.elastic import tee as _tee
from fastspawn.elastic.tee import Tee

WAIT = 30.0  # seconds any wait here may take before the test fails


def eventually(condition: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Console:
    """A console that records what it gets; ``gate``, when given, holds
    each write until it is set (a paused terminal)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.lock = threading.Lock()
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        if self.gate is not None:
            assert self.gate.wait(WAIT), "the test never opened the gate"
        with self.lock:
            self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def text(self) -> bytes:
        with self.lock:
            return b"".join(self.chunks)


class BrokenConsole:
    """A console whose reader went away (``fastspawn run ... | head -1``)."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def flush(self) -> None:
        pass


class FullDiskLog:
    """A log file on a full disk."""

    name = "/full/disk/stdout.log"

    def __init__(self) -> None:
        self.writes = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self.writes += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Writer:
    """Writes ``data`` into a pipe from a thread, as a rank would; gives up
    (instead of blocking for ever) if the pipe is not drained in time.  The
    write end is closed at the end either way, unless ``keep_open``."""

    def __init__(self, fd: int, data: bytes = b"", keep_open: bool = False) -> None:
        self.fd = fd
        self.error: BaseException | None = None
        self.written = 0
        self._thread = threading.Thread(target=self._run, args=(data, keep_open), daemon=True)
        self._thread.start()

    def _run(self, data: bytes, keep_open: bool) -> None:
        try:
            self.write(data)
        except BaseException as exc:
            self.error = exc
        finally:
            if not keep_open:
                self.close()

    def write(self, data: bytes) -> None:
        os.set_blocking(self.fd, False)
        view = memoryview(data)
        deadline = time.monotonic() + WAIT
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"pipe not drained: {self.written} of {len(data)} written")
            _, writable, _ = select.select([], [self.fd], [], left)
            if writable:
                n = os.write(self.fd, view[:65536])
                view = view[n:]
                self.written += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def join(self) -> None:
        self._thread.join(WAIT + 5)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise self.error


@pytest.fixture
def console(monkeypatch: pytest.MonkeyPatch) -> Console:
    # Not sys.stdout: pytest's capture puts its own back after setup.
    out = Console()
    monkeypatch.setattr(_tee, "_console", lambda name: out)
    return out


@pytest.fixture
def tee() -> Iterator[Tee]:
    tee = Tee()
    yield tee
    # Whatever a test left running must end before the leak check.
    assert tee.join(idle_timeout=WAIT)


def pipe(tee: Tee, log: object = None, prefix: str = "[r0]:") -> int:
    """A pipe whose read end the tee watches; returns the write end."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    tee.add(read_end, log, "stdout", prefix)  # type: ignore[arg-type]
    return write_end


def lines(n: int) -> bytes:
    return b"".join(b"line %d of the output\n" % i for i in range(n))


# ------------------------------------------------------ failing writes


def test_log_write_error_warns_once_and_keeps_draining(tee, console, caplog):
    disk = FullDiskLog()
    data = lines(50_000)  # about 1 MB: many times a pipe's capacity
    write_end = pipe(tee, disk)
    with caplog.at_level(logging.WARNING, logger="fastspawn.elastic.tee"):
        tee.start()
        Writer(write_end, data).join()  # the rank was never blocked: all of it was read
        assert tee.join(idle_timeout=WAIT)
    assert disk.writes == 1 and disk.closed
    assert console.text() == b"".join(b"[r0]:" + line for line in data.splitlines(True))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert disk.name in warnings[0] and os.strerror(errno.ENOSPC) in warnings[0]


def test_broken_console_warns_once_and_keeps_the_log(tee, monkeypatch, tmp_path, caplog):
    broken = BrokenConsole()
    monkeypatch.setattr(sys, "stdout", broken)
    path = tmp_path / "stdout.log"
    data = lines(50_000)
    write_end = pipe(tee, open(path, "wb"))
    with caplog.at_level(logging.WARNING, logger="fastspawn.elastic.tee"):
        tee.start()
        Writer(write_end, data).join()
        assert tee.join(idle_timeout=WAIT)
    assert broken.writes == 1
    assert path.read_bytes() == data
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stdout" in warnings[0]


def test_console_that_is_a_closed_pipe(tee, monkeypatch, tmp_path):
    # The real thing: stdout is a pipe whose reader is gone (SIGPIPE is
    # ignored in Python, so a write raises BrokenPipeError).
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    os.close(read_end)
    with open(write_end, "wb", buffering=0) as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        path = tmp_path / "stdout.log"
        data = lines(50_000)
        rank = pipe(tee, open(path, "wb"))
        tee.start()
        Writer(rank, data).join()
        assert tee.join(idle_timeout=WAIT)
    assert path.read_bytes() == data


def test_read_error_drops_only_that_stream(tee, console, monkeypatch, caplog):
    real_read = os.read
    bad = pipe(tee, prefix="[bad]:")
    good = pipe(tee, prefix="[good]:")
    bad_read_end = tee._streams[0].fd

    def read(fd: int, n: int) -> bytes:
        if fd == bad_read_end:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(fd, n)

    monkeypatch.setattr(_tee.os, "read", read)
    with caplog.at_level(logging.WARNING, logger="fastspawn.elastic.tee"):
        tee.start()
        os.write(bad, b"lost\n")
        Writer(good, lines(10_000)).join()
        assert tee.join(idle_timeout=WAIT)
    # The dropped pipe has no reader left: its writer is not blocked for ever.
    with pytest.raises(BrokenPipeError):
        os.write(bad, b"more\n")
    os.close(bad)
    assert console.text() == b"".join(b"[good]:" + x for x in lines(10_000).splitlines(True))
    assert any("[bad]:" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------- slow consoles


def test_join_outwaits_a_slow_console(tee, monkeypatch):
    gate = threading.Event()
    slow = Console(gate)
    monkeypatch.setattr(sys, "stdout", slow)
    data = lines(20_000)
    writer = Writer(pipe(tee), data)
    tee.start()
    # The console stays blocked for several idle timeouts: join must not
    # take that for a stalled tee.
    opener = threading.Timer(1.5, gate.set)
    opener.start()
    try:
        assert tee.join(idle_timeout=0.2)
    finally:
        gate.set()
        opener.join()
    writer.join()
    assert slow.text() == b"".join(b"[r0]:" + line for line in data.splitlines(True))


def test_log_is_written_before_a_blocked_console(tee, monkeypatch, tmp_path):
    gate = threading.Event()
    monkeypatch.setattr(sys, "stdout", Console(gate))
    path = tmp_path / "stdout.log"
    write_end = pipe(tee, open(path, "wb"))
    tee.start()
    try:
        os.write(write_end, b"first line\n")
        assert eventually(lambda: path.read_bytes() == b"first line\n")
    finally:
        gate.set()
        os.close(write_end)


def test_join_gives_up_on_a_pipe_held_open_without_data(tee, console, caplog):
    # A stray process (a rank's daemonised child) keeps a write end open.
    write_end = pipe(tee)
    tee.start()
    os.write(write_end, b"done\n")
    try:
        with caplog.at_level(logging.WARNING, logger="fastspawn.elastic.tee"):
            assert not tee.join(idle_timeout=0.3)
        assert any("[r0]:" in r.getMessage() for r in caplog.records)
    finally:
        os.close(write_end)
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[r0]:done\n"


# ------------------------------------------------------- partial lines


def test_lines_prefixed_once_and_log_unchanged(tee, console, tmp_path):
    path = tmp_path / "stdout.log"
    data = lines(3000) + b"no newline at the end"
    write_end = pipe(tee, open(path, "wb"))
    tee.start()
    writer = Writer(write_end, keep_open=True)
    for start in range(0, len(data), 7919):  # chunks that cut lines anywhere
        writer.write(data[start : start + 7919])
    writer.close()
    assert tee.join(idle_timeout=WAIT)
    assert path.read_bytes() == data
    assert console.text() == b"".join(b"[r0]:" + line for line in data.splitlines(True)) + b"\n"


def test_long_line_is_shown_before_its_newline(tee, console, tmp_path):
    # A 4 MB line: shown as it comes, in PARTIAL_MAX pieces, not held (and
    # rescanned at each read) until its end.
    path = tmp_path / "stdout.log"
    long_line = b"x" * (4 << 20)
    writer = Writer(pipe(tee, open(path, "wb")), keep_open=True)
    tee.start()
    try:
        writer.write(long_line)
        assert eventually(lambda: len(console.text()) >= len(long_line) // 2)
        writer.write(b"\nnext\n")
    finally:
        writer.close()
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[r0]:" + long_line + b"\n[r0]:next\n"
    assert path.read_bytes() == long_line + b"\nnext\n"


def test_progress_bar_is_shown_before_eof(tee, console):
    writer = Writer(pipe(tee), keep_open=True)
    tee.start()
    try:
        writer.write(b"\r 10%")
        # Shown after PARTIAL_DELAY with no newline coming; each redraw
        # starts at column 0, so it gets the prefix again.
        assert eventually(lambda: console.text() == b"[r0]:\r[r0]: 10%")
        writer.write(b"\r 20%")
        assert eventually(lambda: console.text() == b"[r0]:\r[r0]: 10%\r[r0]: 20%")
        writer.write(b"\r100%\n")
    finally:
        writer.close()
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[r0]:\r[r0]: 10%\r[r0]: 20%\r[r0]:100%\n"


def test_return_at_the_end_of_a_shown_part(tee, console, tmp_path):
    # tqdm style (text, then a return before the next redraw) and CRLF line
    # ends: a return that ends what was shown gets the prefix only once more
    # of the line follows, and none before a newline; the log keeps it all.
    path = tmp_path / "stdout.log"
    writer = Writer(pipe(tee, open(path, "wb")), keep_open=True)
    tee.start()
    try:
        writer.write(b" 10%\r")
        assert eventually(lambda: console.text() == b"[r0]: 10%\r")
        writer.write(b" 20%\r")
        assert eventually(lambda: console.text() == b"[r0]: 10%\r[r0]: 20%\r")
        writer.write(b"\ndone\r\nok\r")
        assert eventually(lambda: console.text().endswith(b"[r0]:ok\r"))
        writer.write(b"\n")
    finally:
        writer.close()
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[r0]: 10%\r[r0]: 20%\r\n[r0]:done\r\n[r0]:ok\r\n"
    assert path.read_bytes() == b" 10%\r 20%\r\ndone\r\nok\r\n"


def test_unfinished_line_is_ended_before_another_rank_writes(tee, console):
    a = Writer(pipe(tee, prefix="[a]:"), keep_open=True)
    b = Writer(pipe(tee, prefix="[b]:"), keep_open=True)
    tee.start()
    try:
        a.write(b"working")
        assert eventually(lambda: console.text() == b"[a]:working")
        b.write(b"hello\n")
        assert eventually(lambda: console.text().endswith(b"[b]:hello\n"))
        a.write(b" done\n")
    finally:
        a.close()
        b.close()
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[a]:working\n[b]:hello\n[a]: done\n"


def test_last_line_shown_unfinished_is_ended_at_eof(tee, console):
    writer = Writer(pipe(tee), keep_open=True)
    tee.start()
    try:
        writer.write(b"50%")
        assert eventually(lambda: console.text() == b"[r0]:50%")
    finally:
        writer.close()
    assert tee.join(idle_timeout=WAIT)
    assert console.text() == b"[r0]:50%\n"
