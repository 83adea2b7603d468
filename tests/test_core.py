"""The C core through fastspawn._os.oscall: errno-honest, EINTR visible."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from fastspawn._os import oscall


def test_waiter_returns_every_ready_entry_at_once():
    waiter = oscall.Waiter()
    pipes = [os.pipe() for _ in range(200)]
    try:
        for token, (r, _w) in enumerate(pipes):
            waiter.add(r, token)
        assert waiter.wait(0) == []
        for token in range(0, 200, 2):
            os.write(pipes[token][1], b"x")
        assert sorted(waiter.wait(1.0)) == list(range(0, 200, 2))
        for token in range(0, 200, 2):
            waiter.remove(pipes[token][0])
        assert len(waiter) == 100
        assert waiter.wait(0) == []
        with pytest.raises(FileExistsError, match=r"from epoll_ctl\(EPOLL_CTL_ADD\)"):
            waiter.add(pipes[1][0], 1)
        with pytest.raises(FileNotFoundError):
            waiter.remove(pipes[0][0])
    finally:
        waiter.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_waiter_wait_returns_eintr():
    waiter = oscall.Waiter()
    r, w = os.pipe()
    waiter.add(r, 7)
    old = signal.signal(signal.SIGALRM, lambda signum, frame: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(InterruptedError, match="from epoll_wait"):
            waiter.wait(10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        waiter.close()
        os.close(r)
        os.close(w)


def test_pidfd_wait_and_signal():
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    pidfd = oscall.pidfd_open(pid)
    try:
        assert oscall.pidfd_wait(pidfd, nohang=True) is None
        oscall.pidfd_send_signal(pidfd, signal.SIGTERM)
        assert oscall.pidfd_wait(pidfd, nohang=False) == -signal.SIGTERM
        with pytest.raises(ProcessLookupError, match="from pidfd_send_signal"):
            oscall.pidfd_send_signal(pidfd, signal.SIGTERM)  # reaped: never a reused pid
        with pytest.raises(ChildProcessError):
            oscall.pidfd_wait(pidfd, nohang=False)
    finally:
        os.close(pidfd)


def test_pidfd_wait_exit_code():
    pid = os.fork()
    if pid == 0:
        os._exit(138)
    pidfd = oscall.pidfd_open(pid)
    try:
        assert oscall.pidfd_wait(pidfd, nohang=False) == 138
    finally:
        os.close(pidfd)


def test_pidfd_wait_not_our_child_is_echild():
    pidfd = oscall.pidfd_open(os.getppid())
    try:
        with pytest.raises(ChildProcessError) as info:
            oscall.pidfd_wait(pidfd, nohang=True)
        assert info.value.errno == errno.ECHILD
    finally:
        os.close(pidfd)


def test_set_name_names_the_process_as_proc_comm_shows_it_truncated_to_15_bytes():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            oscall.set_name(b"fs-name-test-0123456789")
            with open("/proc/self/comm", "rb") as f:
                os.write(w, f.read())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            shown = f.read()
    finally:
        assert os.waitpid(pid, 0)[1] == 0
    assert shown == b"fs-name-test-01\n"


def test_pidfd_open_missing_pid():
    with pytest.raises(ProcessLookupError, match="from pidfd_open"):
        oscall.pidfd_open(2**22 + 12345)  # above any pid_max


def test_launch_missing_binary():
    with pytest.raises(FileNotFoundError) as info:
        oscall.launch("/nonexistent/fastspawn-binary", ["x"], {})
    assert info.value.filename == "/nonexistent/fastspawn-binary"
    assert "/nonexistent/fastspawn-binary" in str(info.value)


def test_launch_not_executable():
    with tempfile.NamedTemporaryFile(suffix=".sh") as script:
        os.chmod(script.name, stat.S_IRUSR | stat.S_IWUSR)
        with pytest.raises(PermissionError) as info:
            oscall.launch(script.name, [script.name], {})
        assert info.value.filename == script.name


def test_launch_bad_cwd():
    with pytest.raises(FileNotFoundError):
        oscall.launch("/bin/true", ["true"], {}, cwd="/nonexistent/dir")


def _output_of(path, argv, env, **kwargs):
    """What the program launched with these arguments writes on stdout;
    it must exit 0."""
    out_r, out_w = os.pipe()
    try:
        pid, pidfd = oscall.launch(path, argv, env, stdout=out_w, **kwargs)
        os.close(out_w)
        out_w = -1
        try:
            assert oscall.pidfd_wait(pidfd, nohang=False) == 0
        finally:
            os.close(pidfd)
        output = b""
        while chunk := os.read(out_r, 4096):
            output += chunk
        return output
    finally:
        for fd in (out_r, out_w):
            if fd >= 0:
                os.close(fd)


def test_launch_redirects_env_cwd_and_closes_fds():
    keep_r, keep_w = os.pipe()
    stray_r, stray_w = os.pipe()
    os.set_inheritable(stray_w, True)  # inheritable, yet must not leak into the child
    try:
        script = (
            'echo "$FS_VAR $(pwd)"; '
            f'ls /proc/self/fd | sort -n | tr "\\n" " "; echo; '
            f"echo kept > /proc/self/fd/{keep_w}"
        )
        output = _output_of(
            "/bin/sh",
            ["sh", "-c", script],
            {"FS_VAR": "hello", "PATH": os.defpath},
            cwd="/",
            keep_fds=[keep_w],
        )
        first, fds = output.decode().splitlines()[:2]
        assert first == "hello /"
        open_fds = {int(fd) for fd in fds.split()}
        assert keep_w in open_fds
        assert stray_w not in open_fds
        assert os.read(keep_r, 100) == b"kept\n"
    finally:
        for fd in (keep_r, keep_w, stray_r, stray_w):
            os.close(fd)


def _environment_of(env, **kwargs):
    """The environment `env -0` sees when launched with ``env`` (and ``env_extra``)."""
    output = _output_of("/usr/bin/env", ["env", "-0"], env, **kwargs)
    return [entry.decode() for entry in output.split(b"\0")[:-1]]


def test_launch_environ_shared_by_launches_with_their_own_variables():
    base = oscall.Environ({"A": "1", "B": "2", "C": "3"})
    # Each launch: the base updated with its own, in {**base, **extra}'s order.
    assert _environment_of(base, env_extra={"B": "two", "D": "4"}) == ["A=1", "B=two", "C=3", "D=4"]
    assert _environment_of(base, env_extra={"RANK": "1"}) == ["A=1", "B=2", "C=3", "RANK=1"]
    assert _environment_of(base) == ["A=1", "B=2", "C=3"]
    # A plain mapping, with or without extras, is what it always was.
    assert _environment_of({"X": "é"}, env_extra={"Y": ""}) == ["X=é", "Y="]
    assert _environment_of({}) == []


def test_launch_new_session():
    pid, pidfd = oscall.launch("/bin/sleep", ["sleep", "30"], {}, new_session=True)
    try:
        assert os.getsid(pid) == pid
        assert os.getpgid(pid) == pid
    finally:
        oscall.pidfd_send_signal(pidfd, signal.SIGKILL)
        assert oscall.pidfd_wait(pidfd, nohang=False) == -signal.SIGKILL
        os.close(pidfd)


def test_launched_binary_dies_with_its_parent():
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import signal, time
                from fastspawn._os import oscall
                pid, _ = oscall.launch("/bin/sleep", ["sleep", "600"], {},
                                        pdeathsig=signal.SIGKILL)
                print(pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None
        pid = int(driver.stdout.readline())
        assert psutil.Process(pid).name() == "sleep"
    finally:
        driver.kill()
        driver.wait(timeout=30)
        driver.stdout.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, "the launched binary outlived its parent"
        time.sleep(0.05)


def test_collapse_hugepages_reports_errno():
    # Nothing mapped at address 0: ENOMEM; not page-aligned: EINVAL.
    with pytest.raises(OSError) as info:
        oscall.collapse_hugepages(0, 2 << 20)
    assert info.value.errno == errno.ENOMEM
    assert "MADV_COLLAPSE" in str(info.value)
    with pytest.raises(OSError) as info:
        oscall.collapse_hugepages(1, 2 << 20)
    assert info.value.errno == errno.EINVAL


def test_collapsible_ranges_are_aligned_private_anonymous_memory():
    from fastspawn._os import hugepages

    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    vmas = [(tuple(int(x, 16) for x in m[0].split("-")), m[1], m[5:]) for m in maps]
    starts = hugepages.collapsible_ranges()
    assert starts, "a Python process always has a heap or arenas of 2 MiB"
    for start in starts:
        assert start % (2 << 20) == 0
        (low, high), perms, name = next(v for v in vmas if v[0][0] <= start < v[0][1])
        assert start + (2 << 20) <= high
        assert perms.startswith("rw") and perms[3] == "p"
        assert name in ([], ["[heap]"])


@pytest.mark.parametrize(
    "missing, errno_",
    [("pidfd_open", errno.ENOSYS), ("pidfd_wait", errno.EINVAL)],
    ids=["no pidfd_open (< 5.3)", "no waitid P_PIDFD (5.3)"],
)
def test_old_kernel_gets_a_clear_error_before_anything_starts(monkeypatch, missing, errno_):
    import workers

    import fastspawn

    def unsupported(*args, **kwargs):
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(oscall, missing, unsupported)
    monkeypatch.setattr(oscall, "_pidfds_checked", False)
    for method in ("zygote", "spawn", "fork"):
        with pytest.raises(OSError, match=r"needs Linux 5\.4 or newer") as info:
            fastspawn.start_processes(workers.succeed, nprocs=2, start_method=method)
        assert info.value.errno == errno_
        assert os.uname().release in str(info.value)


@pytest.mark.parametrize(
    "release, expected",
    [
        ("6.18.44-fc-v782", True),
        ("6.1.0-13-amd64", True),
        ("5.15.0-91-generic", False),
        ("4.18.0-513.el8.x86_64", False),
        ("weird", False),
    ],
)
def test_madv_collapse_needs_linux_6_1(monkeypatch, release, expected):
    from fastspawn._os import hugepages

    real = os.uname()
    fake = os.uname_result((real.sysname, real.nodename, release, real.version, real.machine))
    monkeypatch.setattr(os, "uname", lambda: fake)
    assert hugepages.kernel_has_collapse() is expected


def test_collapse_skips_untouched_memory_and_collapses_touched():
    import ctypes
    import mmap

    from fastspawn._os import hugepages

    if not hugepages.wanted():
        pytest.skip("no MADV_COLLAPSE or no transparent huge pages here")
    huge = 2 << 20
    area = mmap.mmap(-1, 4 * huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))
        first = -(-base // huge) * huge  # two whole aligned stretches follow
        offset = first - base
        area[offset : offset + huge] = b"x" * huge  # the first one written
        assert hugepages.collapse(first)
        assert not hugepages.collapse(first + huge)  # nothing there yet: EINVAL
    finally:
        area.close()


ARENA_CHECK = """
import errno, gc
from fastspawn._os import hugepages
from fastspawn._os._core import ffi, lib

for bad in (0, 1 << 20, 2 << 30):  # not whole 2 MiB, or over 1 GiB
    assert lib.fs_arena_place(bad) == -1 and ffi.errno == errno.EINVAL, bad
assert hugepages.arena_region() == (0, 0, 0)
assert lib.fs_arena_place(8 << 20) == 0
base, size, used = hugepages.arena_region()
assert base % (2 << 20) == 0 and size == 8 << 20 and used == 0, (base, size, used)
assert lib.fs_arena_place(8 << 20) == -1 and ffi.errno == errno.EBUSY

def inside(objects):
    return sum(base <= id(o) < base + size for o in objects)

first = [[] for _ in range(60_000)]  # about 3.5 MB of small objects
used_first = hugepages.arena_region()[2]
assert used_first > 0 and inside(first) > 40_000, (used_first, inside(first))
del first
gc.collect()  # their arenas are freed: their slots come back
second = [[] for _ in range(60_000)]
assert hugepages.arena_region()[2] == used_first, "freed slots were not reused"
assert inside(second) > 40_000
beyond = [[] for _ in range(400_000)]  # more than the region holds
assert len(beyond) - inside(beyond) > 200_000  # the rest went elsewhere
assert hugepages.arena_region()[2] == 8 << 20
"""


def test_arena_region_takes_new_arenas_reuses_freed_ones_and_overflows_elsewhere():
    env = {**os.environ, "PYTHONMALLOC": "pymalloc"}  # arenas, whatever the suite runs with
    done = subprocess.run(
        [sys.executable, "-c", ARENA_CHECK], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "env, limit",
    [
        ({"FASTSPAWN_HUGEPAGES": "0"}, None),
        ({}, 64 << 30),
        ({"PYTHONMALLOC": "malloc"}, None),
        ({"PYTHONMALLOC": "malloc_debug"}, None),
    ],
    ids=["opted out", "ulimit -v", "PYTHONMALLOC=malloc", "PYTHONMALLOC=malloc_debug"],
)
def test_arenas_stay_where_they_are_when_opted_out_capped_or_without_pymalloc(env, limit):
    code = textwrap.dedent(
        f"""
        import resource
        from fastspawn._os import hugepages
        if {limit!r}:
            resource.setrlimit(resource.RLIMIT_AS, ({limit!r}, {limit!r}))
            assert hugepages.address_space_limited()
        assert not hugepages.place_arenas()
        assert hugepages.arena_region() == (0, 0, 0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_address_space_is_unlimited_here():
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    from fastspawn._os import hugepages

    assert hugepages.address_space_limited() is (soft != resource.RLIM_INFINITY)


@pytest.mark.parametrize(
    "abiflags, pythonmalloc, expected",
    [
        ("", None, True),
        ("", "pymalloc_debug", True),
        ("", "debug", True),
        ("", "malloc", False),
        ("", "mimalloc_debug", False),
        ("t", None, False),  # free-threaded: mimalloc throughout
    ],
)
def test_pymalloc_in_use(monkeypatch, abiflags, pythonmalloc, expected):
    from fastspawn._os import hugepages

    monkeypatch.setattr(sys, "abiflags", abiflags, raising=False)
    if pythonmalloc is None:
        monkeypatch.delenv("PYTHONMALLOC", raising=False)
    else:
        monkeypatch.setenv("PYTHONMALLOC", pythonmalloc)
    assert hugepages.pymalloc_in_use() is expected


def test_same_file_tells_one_description_from_another(tmp_path):
    path = tmp_path / "f"
    a = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    b = os.dup(a)
    c = os.open(path, os.O_WRONLY)
    try:
        if oscall.same_file(a, b) is None:
            pytest.skip("kcmp is not available here")
        assert oscall.same_file(a, b) is True
        assert oscall.same_file(a, c) is False
    finally:
        for fd in (a, b, c):
            os.close(fd)


def _fork_loop_report(loop: oscall.ForkLoop, out: int) -> None:
    """In a rank of a test's ForkLoop: report its rank, group, pdeathsig,
    whether SIGUSR2 is blocked and how its set-up went; then exit."""
    import ctypes

    try:
        got = ctypes.c_int(-1)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
        blocked = signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        step, error = loop.failure()
        line = f"{loop.next} {os.getpgid(0)} {got.value} {blocked} {step} {type(error).__name__}\n"
        os.write(out, line.encode())
    finally:
        os._exit(0)


def _fork_loop_run(nprocs: int, parent: int, group: int) -> tuple[list[str], oscall.ForkLoop]:
    """Fork ``nprocs`` ranks with ForkLoop, SIGUSR2 blocked here; reap
    them; their reports, one line each."""
    r, w = os.pipe()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        loop = oscall.ForkLoop(nprocs, parent, group, signal.SIGKILL)
        if loop.fork() != -1:  # a rank: -2 if its set-up failed
            _fork_loop_report(loop, w)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        os.close(w)
    for pid in loop.pids:
        os.waitpid(pid, 0)
    with os.fdopen(r) as reports:
        return sorted(reports.read().splitlines()), loop


def test_fork_loop_sets_each_rank_up_and_reports_every_pid():
    group = oscall.group_anchor()
    try:
        lines, loop = _fork_loop_run(3, os.getpid(), group)
    finally:
        oscall.release_group_anchor(group)
    assert loop.failure() == (0, None)
    assert loop.next == 3 and len(set(loop.pids)) == 3
    # SIGUSR2 still blocked: a rank lets signals through itself, once a
    # handler that raises can no longer unwind into the forking code.
    assert lines == [f"{rank} {group} {int(signal.SIGKILL)} True 0 NoneType" for rank in range(3)]


def test_fork_loop_rank_whose_parent_is_not_the_one_expected_learns_it():
    # The race check of PR_SET_PDEATHSIG: a rank whose parent is not the
    # pid given (here, never was) gets ESRCH.
    from fastspawn._os._core import lib

    lines, loop = _fork_loop_run(1, 1, 0)
    assert loop.failure() == (0, None)  # the parent's own part went well
    step = int(lib.FS_FORK_PDEATHSIG)
    assert lines == [f"0 {os.getpgid(0)} {int(signal.SIGKILL)} True {step} ProcessLookupError"]
