"""Leak checks for every test: no child process, zombie, fd or temp file may remain."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator

import psutil
import pytest

from fastspawn._warden import client as _warden_client
from fastspawn._zygote import client

START_METHODS = ["zygote", "fork", "spawn", "forkserver"]
PATIENCE = 5.0  # seconds a test's processes get to go away by themselves


def _children() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def _fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own fd, gone already
    return fds


def _helpers() -> tuple[set[int], set[int]]:
    pids, fds = client.helper_processes()
    zygote = client.zygote_pid() if pids else None
    if zygote is not None:
        pids |= client.held_ahead(zygote)  # the spare group's anchor too
    warden_pids, warden_fds = _warden_client.warden_process()
    pids |= warden_pids
    fds |= warden_fds
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None):
        pids.add(tracker._pid)
    if isinstance(getattr(tracker, "_fd", None), int):
        fds.add(tracker._fd)
    return pids, fds


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Point TMPDIR (ours and every child's) at a directory of the run's own.

    What the code under test leaves in the temp directory then shows up there,
    apart from other users' files; pytest's own tmp_path root is fixed first so
    it stays where pytest keeps it.
    """
    tmp_path_factory.getbasetemp()
    folder = tempfile.mkdtemp(prefix="fastspawn-tests-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    try:
        yield folder
    finally:
        if saved[0] is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
        shutil.rmtree(folder, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    """fastspawn.elastic installs SignalException handlers in the launching
    process, as torch does, for good: put ours back after each test, or
    "fork" workers of later tests would inherit them."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def no_leaks(private_tmpdir: str) -> Iterator[None]:
    """Fail a test that leaves a child, a zombie, an fd or a temp file behind.

    Leftover children are killed (by pid, only ours) and reaped first, and
    leftover temp files removed, so one leaky test does not spill into the next.
    """
    before_children = set(_children())
    before_fds = set(_fds())
    yield
    deadline = time.monotonic() + PATIENCE
    while True:
        helper_pids, helper_fds = _helpers()
        left = {
            pid: p
            for pid, p in _children().items()
            if pid not in before_children and pid not in helper_pids
        }
        # Descendants of the fork server are its workers: ours to check too,
        # but the server itself is shared infrastructure.
        fds = {fd: target for fd, target in _fds().items() if fd not in before_fds | helper_fds}
        temp = sorted(os.listdir(private_tmpdir))
        if (not left and not fds and not temp) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = []
    for pid, proc in left.items():
        try:
            described.append(f"{pid} {proc.status()} {' '.join(proc.cmdline())[:80]}")
            os.kill(pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError):
            pass
    for pid in left:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for name in temp:
        _remove(os.path.join(private_tmpdir, name))
    problems = []
    if temp:
        problems.append(f"temp files left behind in {private_tmpdir}: {temp}")
    if described:
        problems.append(f"processes left behind: {described}")
    if fds:
        problems.append(f"fds left open: {fds}")
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    return str(request.param)
