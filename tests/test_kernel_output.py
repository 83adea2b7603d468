"""catch_up: once the workers have ended, what they wrote to a Jupyter
kernel's stdout pipe is forwarded before the caller goes on.  A stand-in
for ipykernel's stream (the attributes ipykernel 6 and 7 give it) whose
thread reads the pipe a byte at a time and pauses before forwarding each,
as a busy kernel's thread would."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from fastspawn._launch import kernel_output


class SlowKernelStream:
    def __init__(self, pause: float) -> None:
        self._fid, self.write_end = os.pipe()
        self._should_watch = True
        self.pause = pause
        self.forwarded = bytearray()
        self.watch_fd_thread = threading.Thread(target=self._watch, daemon=True)
        self.watch_fd_thread.start()

    def _watch(self) -> None:
        while data := os.read(self._fid, 1):
            time.sleep(self.pause)  # between the read and the forward
            self.forwarded += data

    def flush(self) -> None:
        pass

    def close(self) -> None:
        os.close(self.write_end)
        self.watch_fd_thread.join()
        os.close(self._fid)


@pytest.fixture
def kernel_stdout(monkeypatch):
    # pytest sets sys.stdout to its own capture again as each test phase
    # starts: the tests put the stand-in in place themselves.
    stream = SlowKernelStream(pause=0.02)
    yield stream
    stream.close()


def test_what_the_workers_wrote_is_forwarded_before_catch_up_returns(kernel_stdout, monkeypatch):
    monkeypatch.setattr(sys, "stdout", kernel_stdout)
    os.write(kernel_stdout.write_end, b"rank 1 done\n")
    kernel_output.catch_up(limit=30)
    assert bytes(kernel_stdout.forwarded) == b"rank 1 done\n"


def test_the_wait_is_bounded_when_the_kernel_falls_behind(kernel_stdout, monkeypatch):
    monkeypatch.setattr(sys, "stdout", kernel_stdout)
    os.write(kernel_stdout.write_end, b"x" * 50)  # 1 s of forwarding
    started = time.monotonic()
    kernel_output.catch_up(limit=0.1)
    assert time.monotonic() - started < 3
    assert len(kernel_stdout.forwarded) < 50


def test_outside_a_kernel_nothing_is_waited_for():
    assert kernel_output._watched(sys.stdout) is None
    assert kernel_output._watched(sys.stderr) is None
