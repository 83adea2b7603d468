"""The limits a launch must stay within: the caller's RLIMIT_NPROC obeyed by
every start method (the zygote's forks included), and an ``nprocs`` above
what the user's or the machine's limits allow refused before anything
starts (start_processes, fastspawn.elastic, ``fastspawn run``)."""

from __future__ import annotations

import errno
import os
import pwd
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _cffi_backend
import psutil
import pytest
import workers
from conftest import START_METHODS
from helpers import run_script

import fastspawn
from fastspawn import elastic
from fastspawn._os import limits as _limits
from fastspawn._os import oscall, procstate
from fastspawn._zygote import client

NOGROUP = 65534

# Run as an unprivileged user: the kernel does not hold root to RLIMIT_NPROC.
DRIVER = """
    import errno, os, resource, sys, time
    import fastspawn
    from fastspawn._warden import client as _warden_client
    from fastspawn._zygote import client


    def nproc_limit(rank):
        return resource.getrlimit(resource.RLIMIT_NPROC)[0]


    def sleep_forever(rank):
        time.sleep(600)


    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return {int(child) for child in f.read().split()}
        except FileNotFoundError:
            return set()


    def left_after(pids, seconds=30):
        # Processes left under ``pids`` (zombies too, until reaped), once
        # they are gone or ``seconds`` have passed.
        deadline = time.monotonic() + seconds
        while True:
            left = set().union(*(children(pid) for pid in pids)) - helpers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)


    def helpers():
        pids = client.helper_processes()[0] | _warden_client.warden_process()[0]
        zygote = client.zygote_pid() if pids else None
        return pids | (client.held_ahead(zygote) if zygote else set())


    def zygote_nproc_limit(pid):
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max processes"):
                    return line.split()[2]


    if __name__ == "__main__":
        method, limit = sys.argv[1], int(sys.argv[2])
        own = resource.getrlimit(resource.RLIMIT_NPROC)
        # The zygote (or the warden) starts under the limit as it was.
        fastspawn.start_processes(nproc_limit, nprocs=1, start_method=method)
        zygote = client.zygote_pid() if client.helper_processes()[0] else None
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, own[1]))

        ctx = fastspawn.start_processes(nproc_limit, nprocs=2, start_method=method)
        print("within:", sorted(ctx.return_values.values()))

        try:
            fastspawn.start_processes(sleep_forever, nprocs=5 * limit, start_method=method)
        except ValueError as exc:
            print("above:", exc)
        else:
            print("above: started")

        # Fits the limit alone, not beside this user's other processes (this
        # one, the zygote and its guard, or the warden).
        try:
            ctx = fastspawn.start_processes(
                sleep_forever, nprocs=limit - 1, start_method=method, join=False
            )
        except Exception as exc:
            print("beside:", type(exc).__name__, errno.errorcode.get(exc.errno), exc)
        else:
            print("beside: started")
            for process in ctx.processes:
                process.kill()
            try:
                ctx.join(timeout=30)
            except fastspawn.ProcessExitedException:
                pass
        print("left:", len(left_after([os.getpid()] + ([zygote] if zygote else []))))
        if zygote:
            print("zygote's own limit:", zygote_nproc_limit(zygote) == str(own[0]))

        resource.setrlimit(resource.RLIMIT_NPROC, own)
        ctx = fastspawn.start_processes(nproc_limit, nprocs=2, start_method=method)
        print("after:", sorted(ctx.return_values.values()) == [own[0]] * 2)
        fastspawn.stop_zygote()
"""


def _unused_uid() -> int:
    """A uid no account has and no process runs as: RLIMIT_NPROC counts per
    user, so nothing else on the machine (another test run as nobody, say)
    counts against the limit the test sets."""
    for uid in range(61000, 61500):
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        if _limits.tasks_of(uid) == 0:
            return uid
    pytest.skip("no unused uid in 61000-61499 to run the scenario as")


def _stage_importable(base: str) -> str:
    """A copy of this fastspawn and of cffi's backend in a new directory
    under ``base`` that any user may read: the checkout and the venv may sit
    in directories only root can enter (a clone under ``mktemp -d``)."""
    folder = tempfile.mkdtemp(prefix="fastspawn-nproc-import-", dir=base)
    package = os.path.dirname(os.path.abspath(fastspawn.__file__))
    shutil.copytree(
        package, os.path.join(folder, "fastspawn"), ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(_cffi_backend.__file__, folder)
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return folder


@pytest.fixture(scope="module")
def unprivileged(private_tmpdir: str) -> Iterator[tuple[int, str, str]]:
    """(uid, a Python it can run that imports this fastspawn, the
    PYTHONPATH for that), or a skip saying why the scenario cannot be set
    up here."""
    if os.getuid() != 0:
        pytest.skip("needs root, to drop to another user (RLIMIT_NPROC does not bind root)")
    uid = _unused_uid()
    path = _stage_importable(os.path.dirname(private_tmpdir))
    try:
        yield from _python_for(uid, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _python_for(uid: int, path: str) -> Iterator[tuple[int, str, str]]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = dict.fromkeys(
        [
            sys.executable,
            os.path.realpath(sys.executable),
            f"/usr/bin/python{version}",
            f"/usr/local/bin/python{version}",
        ]
    )
    why = []
    for python in candidates:
        try:
            probe = subprocess.run(
                [python, "-c", "import fastspawn._os._core"],
                user=uid,
                group=NOGROUP,
                extra_groups=[],
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": path},
                cwd="/",
                capture_output=True,
                text=True,
                timeout=60,
            )
        except OSError as exc:
            why.append(f"{python}: {exc}")
            continue
        if probe.returncode == 0:
            yield uid, python, path
            return
        why.append(f"{python}: {probe.stderr.strip().splitlines()[-1:]}")
    pytest.skip(f"no Python that uid {uid} can run imports this fastspawn: {why}")


@pytest.fixture
def private_dir(private_tmpdir: str, unprivileged: tuple[int, str, str]) -> Iterator[Path]:
    """A directory of the unprivileged user's own, beside the test run's
    temp directory (which it cannot enter), removed after the test."""
    base = os.path.dirname(private_tmpdir)
    folder = tempfile.mkdtemp(prefix="fastspawn-nproc-", dir=base)
    try:
        os.chown(folder, unprivileged[0], NOGROUP)
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _drive(method: str, limit: int, uid: int, python: str, path: str, folder: Path) -> str:
    done = run_script(
        folder / "driver.py",
        DRIVER,
        [python, str(folder / "driver.py"), method, str(limit)],
        user=uid,
        group=NOGROUP,
        extra_groups=[],
        cwd=folder,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": path,
            "TMPDIR": str(folder),
            "HOME": str(folder),
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _line(output: str, key: str) -> str:
    for line in output.splitlines():
        if line.startswith(key + ":"):
            return line[len(key) + 1 :].strip()
    raise AssertionError(f"no {key!r} line in:\n{output}")


def _check_the_limit_is_obeyed(output: str, limit: int) -> None:
    # Within the limit the ranks start, and run under the caller's limit.
    assert _line(output, "within") == str([limit, limit]), output
    # Above it: refused before anything starts, naming the limit.
    assert f"RLIMIT_NPROC (ulimit -u) is {limit}" in _line(output, "above"), output
    # Fits alone, not beside what runs: EAGAIN from the fork, as a
    # BlockingIOError naming the limit, and nothing left behind.
    beside = _line(output, "beside")
    assert beside.startswith("BlockingIOError EAGAIN "), output
    assert f"RLIMIT_NPROC (ulimit -u) is {limit}" in beside and "ulimit -u" in beside, output
    assert _line(output, "left") == "0", output
    # With the limit raised again, launches go on as before.
    assert _line(output, "after") == "True", output


@pytest.mark.parametrize("method", ["zygote", "forkserver"])
def test_zygote_launch_obeys_the_callers_rlimit_nproc(method, unprivileged, private_dir):
    limit = 40
    output = _drive(method, limit, *unprivileged, private_dir)
    _check_the_limit_is_obeyed(output, limit)
    assert "fork of rank" in _line(output, "beside") and "in the zygote" in output
    # The zygote took the caller's limit for the launch's forks only.
    assert _line(output, "zygote's own limit") == "True", output


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_fork_and_spawn_launch_obey_the_callers_rlimit_nproc(method, unprivileged, private_dir):
    limit = 40
    output = _drive(method, limit, *unprivileged, private_dir)
    _check_the_limit_is_obeyed(output, limit)


def test_the_zygote_moves_its_soft_nproc_limit_only_and_puts_it_back():
    own = resource.getrlimit(resource.RLIMIT_NPROC)
    if own[1] == resource.RLIM_INFINITY or own[1] < 100 or own[0] != own[1]:
        pytest.skip(f"RLIMIT_NPROC is {own} here")
    nproc = resource.RLIMIT_NPROC
    try:
        assert procstate.adopt_fork_limits({}) == []
        assert procstate.adopt_fork_limits({"rlimits": {nproc: own}}) == []
        saved = procstate.adopt_fork_limits({"rlimits": {nproc: (40, 40)}})
        # The caller's soft limit; the hard one left, to restore from.
        assert resource.getrlimit(nproc) == (40, own[1])
        procstate.restore_limits(saved)
        assert resource.getrlimit(nproc) == own
        # Never above our hard limit, which setrlimit would refuse.
        resource.setrlimit(nproc, (50, own[1]))
        unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        saved = procstate.adopt_fork_limits({"rlimits": {nproc: unlimited}})
        assert resource.getrlimit(nproc) == own
        procstate.restore_limits(saved)
        assert resource.getrlimit(nproc) == (50, own[1])
    finally:
        resource.setrlimit(nproc, own)


# ------------------------------------------------ refused before anything starts


def _processes_now() -> set[int]:
    """Our descendants, but the zygote's ready workers and its spare
    group's anchor (made in the background whenever the zygote is idle)."""
    zygote = client.zygote_pid()
    ahead = client.held_ahead(zygote) if zygote is not None else set()
    return {child.pid for child in psutil.Process().children(recursive=True)} - ahead


def _assert_nothing_started(before: set[int]) -> None:
    """No process of ours that was not there ``before``.  One that went is
    no matter (a worker the zygote was making ready then is named ready
    now), and one the zygote forked meanwhile to make ready is given time
    to take its name: a rank of the refused launch would never take it."""
    deadline = time.monotonic() + 10
    while (new := _processes_now() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new, f"processes started: {new}"


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("nprocs", ["pid_max", 100000, 2**70])
def test_nprocs_above_pid_max_is_refused_before_anything_starts(method, nprocs, monkeypatch):
    # The limit under test alone: where root is not held to RLIMIT_NPROC.
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    pid_max = _limits.Limits.current().pid_max
    assert pid_max is not None
    if nprocs == "pid_max":
        nprocs = pid_max
    elif nprocs < pid_max:
        pytest.skip(f"kernel.pid_max is {pid_max} here")
    before = _processes_now()
    zygote = client.zygote_pid()
    with pytest.raises(ValueError, match=rf"nprocs={nprocs} .* kernel.pid_max, .* is {pid_max}:"):
        fastspawn.start_processes(print, nprocs=nprocs, start_method=method)
    _assert_nothing_started(before)
    assert client.zygote_pid() == zygote


def test_a_sysctl_no_launch_that_size_can_pass_is_not_read(tmp_path, monkeypatch):
    # A kernel lets pid_max be no less than 301 and threads-max no less than
    # 20: fewer tasks (this process included) cannot pass them, and the
    # check on every launch's path reads neither file for them.
    for name, value in (("_PID_MAX", 400), ("_THREADS_MAX", 50)):
        fake = tmp_path / name
        fake.write_text(f"{value}\n")
        monkeypatch.setattr(_limits, name, str(fake))
    assert _limits.Limits.current(tasks=19).threads_max is None
    assert _limits.Limits.current(tasks=20).threads_max == 50
    assert _limits.Limits.current(tasks=300).pid_max is None
    assert _limits.Limits.current(tasks=301).pid_max == 400
    assert _limits.Limits.current().pid_max == 400  # no launch: read


def test_nprocs_above_threads_max_is_refused(tmp_path, monkeypatch):
    threads_max = tmp_path / "threads-max"
    threads_max.write_text("50\n")
    monkeypatch.setattr(_limits, "_THREADS_MAX", str(threads_max))
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    with pytest.raises(ValueError, match=r"kernel.threads-max, .* is 50: start fewer ranks"):
        fastspawn.start_processes(print, nprocs=60)


def test_nprocs_above_rlimit_nofile_is_refused(monkeypatch):
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
    try:
        with pytest.raises(ValueError, match=r"RLIMIT_NOFILE \(ulimit -n\) is 200"):
            fastspawn.start_processes(print, nprocs=300)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_nprocs_above_rlimit_nproc_is_refused_where_it_binds():
    limits = _limits.Limits(nproc=60, nofile=None, pid_max=32768, threads_max=10**6)
    why = _limits.problem(_limits.Demand(300, "nprocs=300"), limits)
    assert why is not None
    assert "RLIMIT_NPROC (ulimit -u) is 60" in why and "start fewer ranks" in why
    # The caller is one of the user's processes: 60 more cannot fit either.
    assert _limits.problem(_limits.Demand(60, "nprocs=60"), limits) is not None
    assert _limits.problem(_limits.Demand(59, "nprocs=59"), limits) is None
    # Where the kernel does not hold the caller to it, it is no bound.
    unbound = _limits.Limits(nproc=None, nofile=None, pid_max=32768, threads_max=10**6)
    assert _limits.problem(_limits.Demand(300, "nprocs=300"), unbound) is None


def test_past_the_machines_limits_raising_ulimit_is_not_offered():
    limits = _limits.Limits(nproc=60, nofile=None, pid_max=32768, threads_max=10**6)
    why = _limits.problem(_limits.Demand(2**70, "nprocs=huge"), limits)
    assert why is not None and "RLIMIT_NPROC" in why and "ulimit -u" not in why.split(":")[-1]


def test_root_is_not_held_to_rlimit_nproc():
    if os.getuid() != 0:
        assert _limits.nproc_enforced() or _limits.Limits.current().nproc is None
        pytest.skip("the exemption is root's")
    with open("/proc/self/uid_map") as f:
        if f.read().split() != ["0", "0", "4294967295"]:
            pytest.skip("root of a user namespace is held to RLIMIT_NPROC")
    assert not _limits.nproc_enforced()
    assert _limits.Limits.current().nproc is None


@pytest.mark.parametrize("nprocs", [0, -1])
def test_nprocs_zero_and_minus_one_still_start(nprocs):
    ctx = fastspawn.start_processes(workers.succeed, nprocs=nprocs, start_method="fork")
    assert len(ctx.processes) == (len(os.sched_getaffinity(0)) if nprocs == -1 else 0)


def test_elastic_nprocs_above_the_limits_is_refused_before_anything_starts(tmp_path, monkeypatch):
    pid_max = tmp_path / "pid_max"
    pid_max.write_text("400\n")  # a kernel allows no less than 301
    monkeypatch.setattr(_limits, "_PID_MAX", str(pid_max))
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    before = _processes_now()
    ranks = range(450)
    with pytest.raises(ValueError, match=r"a launch of 450 ranks .* kernel.pid_max, .* is 400"):
        elastic.start_processes(
            "x",
            "/bin/true",
            {rank: () for rank in ranks},
            {rank: {} for rank in ranks},
            str(log_dir),
            tee=elastic.Std.ALL,
        )
    assert list(log_dir.iterdir()) == []
    _assert_nothing_started(before)


def test_fastspawn_run_absurd_nprocs_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", "--nprocs-per-node",
         "100000000000000000000", "/bin/true"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "usage:" in done.stderr and "lower --nproc-per-node" in done.stderr
    assert "kernel.pid_max" in done.stderr or "RLIMIT_" in done.stderr
    assert done.stdout == ""


def test_eagain_names_the_limit_and_what_to_do(monkeypatch):
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: True)
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    error = oscall.oserror(errno.EAGAIN, "fork of rank 3")
    assert isinstance(error, BlockingIOError)
    assert "(from fork of rank 3); the limit on processes may be reached" in str(error)
    if soft != resource.RLIM_INFINITY:
        assert f"RLIMIT_NPROC (ulimit -u) is {soft}" in str(error) and "ulimit -u" in str(error)


# ------------------------------------------- one exec string (MAX_ARG_STRLEN)

# "FS_BIG=" and the value: one byte over what exec takes (131071 and a NUL).
_TOO_LONG = "x" * (131072 - len("FS_BIG="))


@pytest.mark.parametrize("where", ["envs", "caller"])
def test_an_environment_string_exec_refuses_is_refused_before_anything_starts(where, monkeypatch):
    origin = r"envs\[1\]" if where == "envs" else "the caller's environment"
    envs = {1: {"FS_BIG": _TOO_LONG}} if where == "envs" else None
    if where == "caller":
        monkeypatch.setenv("FS_BIG", _TOO_LONG)
    before = _processes_now()
    message = rf"FS_BIG \(from {origin}\) is 131072 bytes .* 131071 .* \(MAX_ARG_STRLEN\)"
    with pytest.raises(ValueError, match=message):
        fastspawn.start_processes(workers.succeed, nprocs=2, envs=envs, start_method="spawn")
    _assert_nothing_started(before)
    # One byte less fits; the methods that do not exec take any length.
    fits = {0: {"FS_BIG": _TOO_LONG[1:]}, 1: {"FS_BIG": _TOO_LONG[1:]}}
    ctx = fastspawn.start_processes(workers.report_env, (["FS_BIG"],), 2, envs=fits,
                                    start_method="spawn")  # fmt: skip
    assert len(ctx.return_values[1]["FS_BIG"]) == len(_TOO_LONG) - 1
    for method in ("zygote", "fork"):
        ctx = fastspawn.start_processes(
            workers.report_env, (["FS_BIG"],), 2, envs=envs, start_method=method
        )
        assert ctx.return_values[1]["FS_BIG"] == _TOO_LONG


def test_a_caller_variable_every_rank_replaces_is_not_passed_so_not_refused(monkeypatch):
    monkeypatch.setenv("FS_BIG", _TOO_LONG)
    envs = {0: {"FS_BIG": "small"}}
    ctx = fastspawn.start_processes(workers.report_env, (["FS_BIG"],), 1, envs=envs,
                                    start_method="spawn")  # fmt: skip
    assert ctx.return_values[0] == {"FS_BIG": "small"}


def test_an_elastic_binary_rank_with_an_environment_string_exec_refuses(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    before = _processes_now()
    with pytest.raises(ValueError, match=r"FS_BIG \(from envs\[0\]\) is 131072 bytes"):
        elastic.start_processes(
            "x", "/bin/true", {0: ()}, {0: {"FS_BIG": _TOO_LONG}}, str(log_dir),
            tee=elastic.Std.ALL,
        )  # fmt: skip
    assert list(log_dir.iterdir()) == []
    _assert_nothing_started(before)
