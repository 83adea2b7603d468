"""The memory cgroups' limits over a process (fastspawn._os.memlimit), read
from made-up /proc files and cgroup trees, and the zygote's ready workers
kept within them."""

from __future__ import annotations

import os
import time

import pytest

from fastspawn._os import memlimit
from fastspawn._zygote import ready as ready_pool


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path, cgroup: str, mounts: list[str]) -> tuple[str, str]:
    """Made-up /proc/self/cgroup and /proc/self/mountinfo: their paths."""
    _write(tmp_path / "proc" / "cgroup", cgroup)
    _write(tmp_path / "proc" / "mountinfo", "\n".join(mounts) + "\n")
    return str(tmp_path / "proc" / "cgroup"), str(tmp_path / "proc" / "mountinfo")


def test_v2_keeps_each_level_with_a_limit_the_lower_of_max_and_high(tmp_path):
    top = tmp_path / "cg"
    _write(top / "cgroup.procs", "")  # the root: no memory.max
    _write(top / "job" / "memory.max", "1000\n")
    _write(top / "job" / "memory.high", "800\n")
    _write(top / "job" / "memory.current", "500\n")
    _write(top / "job" / "step" / "memory.max", "max\n")
    _write(top / "job" / "step" / "memory.high", "max\n")
    _write(top / "job" / "step" / "memory.current", "100\n")
    files = _proc(
        tmp_path,
        "0::/job/step\n",
        [
            f"30 23 0:27 / {tmp_path}/other rw - tmpfs tmpfs rw",
            f"31 23 0:28 / {top} rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate",
        ],
    )
    levels = memlimit.find_limits(*files)
    assert [(level.limit, level.usage) for level in levels] == [
        (800, str(top / "job" / "memory.current"))
    ]
    assert memlimit.headroom(levels) == (300, 800)


def test_v2_takes_the_level_that_leaves_least(tmp_path):
    top = tmp_path / "cg"
    _write(top / "a" / "memory.max", "1000")
    _write(top / "a" / "memory.current", "900")
    _write(top / "a" / "b" / "memory.max", "500")
    _write(top / "a" / "b" / "memory.current", "200")
    files = _proc(tmp_path, "0::/a/b\n", [f"31 23 0:28 / {top} rw - cgroup2 cgroup2 rw"])
    assert memlimit.headroom(memlimit.find_limits(*files)) == (100, 1000)


def test_v1_memory_controller_and_its_unlimited_value(tmp_path):
    top = tmp_path / "memory"
    _write(top / "memory.limit_in_bytes", "9223372036854771712")
    _write(top / "slurm" / "memory.limit_in_bytes", "9223372036854771712")
    _write(top / "slurm" / "job_7" / "memory.limit_in_bytes", "2000")
    _write(top / "slurm" / "job_7" / "memory.usage_in_bytes", "1500")
    files = _proc(
        tmp_path,
        "5:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/job_7\n0::/\n",
        [
            f"33 31 0:29 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct",
            f"35 31 0:32 / {top} rw,relatime - cgroup cgroup rw,memory",
            f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw",
        ],
    )
    levels = memlimit.find_limits(*files)
    assert memlimit.headroom(levels) == (500, 2000)


def test_a_mount_of_a_subtree_and_an_escaped_mount_point(tmp_path):
    """A container's mount of its own cgroup (mountinfo's root field is
    that cgroup); a space in the mount point, escaped as mountinfo does."""
    top = tmp_path / "c g"
    _write(top / "memory.max", "4096")
    _write(top / "memory.current", "1024")
    _write(top / "sub" / "memory.max", "max")
    escaped = str(top).replace(" ", "\\040")
    files = _proc(
        tmp_path, "0::/docker/abc/sub\n", [f"31 23 0:28 /docker/abc {escaped} ro - cgroup2 cg rw"]
    )
    levels = memlimit.find_limits(*files)
    assert memlimit.headroom(levels) == (3072, 4096)


@pytest.mark.parametrize(
    "cgroup, mount_root",
    [
        ("0::/\n", "/"),  # at the root: no limit above
        ("0::/elsewhere\n", "/docker/abc"),  # outside what is mounted here
        ("", "/"),  # no cgroup at all
    ],
)
def test_no_limit_found(tmp_path, cgroup, mount_root):
    top = tmp_path / "cg"
    _write(top / "cgroup.procs", "")
    files = _proc(tmp_path, cgroup, [f"31 23 0:28 {mount_root} {top} rw - cgroup2 cgroup2 rw"])
    levels = memlimit.find_limits(*files)
    assert levels == []
    assert memlimit.headroom(levels) is None


def test_unreadable_files_mean_no_limit(tmp_path):
    assert memlimit.find_limits(str(tmp_path / "none"), str(tmp_path / "none")) == []
    gone = memlimit.Level(100, str(tmp_path / "memory.current"))
    assert memlimit.headroom([gone]) is None


def test_none_are_made_ready_while_a_cgroups_limit_is_near(tmp_path, monkeypatch):
    """room_under_limits: none while a cgroup's limit leaves less than
    MIN_AVAILABLE or a tenth of it, whatever MemAvailable says."""
    usage = tmp_path / "memory.current"
    limit = 64 << 30
    monkeypatch.setattr(ready_pool, "MIN_AVAILABLE", 0)  # the machine's rule out of the way
    monkeypatch.setattr(ready_pool, "_cgroup_limits", [memlimit.Level(limit, str(usage))])
    usage.write_text(str(limit - (limit // 10 - 1)))
    assert ready_pool.room_under_limits(0) == 0
    usage.write_text(str(limit - limit // 5))
    assert ready_pool.room_under_limits(0) > 0


def _memory_cgroup_of_our_own(limit: int) -> str:
    """A new memory cgroup below this process's, limited to ``limit``
    bytes: its directory (the test is skipped where none can be made)."""
    with open("/proc/self/cgroup") as f:
        memberships = f.read().splitlines()
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    v1, v2 = memlimit._membership(memberships)
    found = None
    if v1 is not None:
        found = memlimit._directory(mounts, v1, "cgroup", "memory"), "memory.limit_in_bytes"
    elif v2 is not None:
        found = memlimit._directory(mounts, v2, "cgroup2", None), "memory.max"
    if found is None or found[0] is None:
        pytest.skip("no memory cgroup mounted here")
    (ours, _top), limit_file = found
    path = os.path.join(ours, f"fastspawn-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        os.rmdir(path)
        pytest.skip(f"cannot limit a memory cgroup here: {exc}")
    return path


DRIVER = """
import os, sys, time
import fastspawn, workers
from fastspawn._zygote import client

with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))  # the zygote starts in it too
fastspawn.start_processes(workers.succeed, nprocs=2)
print(fastspawn.prefork(4), flush=True)
ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=2)
print(sorted({ppid for _pid, ppid in ctx.return_values.values()}) == [client.zygote_pid()])
time.sleep(1)  # a refill would have made them ready by now
print(len(client.ready_workers(client.zygote_pid())), flush=True)
"""


@pytest.mark.version_neutral
def test_a_zygote_in_a_memory_cgroup_near_its_limit_makes_none_ready():
    """In a cgroup whose limit (384 MiB) leaves less than 512 MiB, on a
    machine with memory to spare: no ready workers, by prefork() or in
    the background, and launches fork their ranks as before."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    path = _memory_cgroup_of_our_own(384 << 20)
    try:
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, path],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([tests, *sys.path])),
        )
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(path)  # once its last process is gone
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True", "0"]
