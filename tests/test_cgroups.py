"""Cgroups and the zygote's ready workers: the memory cgroups' limits over a
process (fastspawn._os.cgroups), read from made-up /proc files and cgroup
trees; ready workers kept within them; and a launch that runs out of
processes (a pids cgroup's limit) making room by ending them.  The last
two run in cgroups the tests make, where they may (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fastspawn._os import cgroups
from fastspawn._zygote import room


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _tree(top, files: dict[str, str]) -> None:
    """Files below ``top``: relative path -> text."""
    for name, text in files.items():
        _write(top / name, text)


def _proc(tmp_path, cgroup: str, mounts: list[str]) -> tuple[str, str]:
    """Made-up /proc/self/cgroup and /proc/self/mountinfo: their paths."""
    _write(tmp_path / "proc" / "cgroup", cgroup)
    _write(tmp_path / "proc" / "mountinfo", "\n".join(mounts) + "\n")
    return str(tmp_path / "proc" / "cgroup"), str(tmp_path / "proc" / "mountinfo")


def test_v2_keeps_each_level_with_a_limit_the_lower_of_max_and_high(tmp_path):
    top = tmp_path / "cg"
    _tree(
        top,
        {
            "cgroup.procs": "",  # the root: no memory.max
            "job/memory.max": "1000\n",
            "job/memory.high": "800\n",
            "job/memory.current": "500\n",
            "job/step/memory.max": "max\n",
            "job/step/memory.high": "max\n",
            "job/step/memory.current": "100\n",
        },
    )
    files = _proc(
        tmp_path,
        "0::/job/step\n",
        [
            f"30 23 0:27 / {tmp_path}/other rw - tmpfs tmpfs rw",
            f"31 23 0:28 / {top} rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate",
        ],
    )
    levels = cgroups.memory_limits(*files)
    assert [(level.limit, level.usage) for level in levels] == [
        (800, str(top / "job" / "memory.current"))
    ]
    assert cgroups.headroom(levels) == (300, 800)


def test_v2_takes_the_level_that_leaves_least(tmp_path):
    top = tmp_path / "cg"
    _tree(
        top,
        {
            "a/memory.max": "1000",
            "a/memory.current": "900",
            "a/b/memory.max": "500",
            "a/b/memory.current": "200",
        },
    )
    files = _proc(tmp_path, "0::/a/b\n", [f"31 23 0:28 / {top} rw - cgroup2 cgroup2 rw"])
    assert cgroups.headroom(cgroups.memory_limits(*files)) == (100, 1000)


def test_v1_memory_controller_and_its_unlimited_value(tmp_path):
    top = tmp_path / "memory"
    _tree(
        top,
        {
            "memory.limit_in_bytes": "9223372036854771712",
            "slurm/memory.limit_in_bytes": "9223372036854771712",
            "slurm/job_7/memory.limit_in_bytes": "2000",
            "slurm/job_7/memory.usage_in_bytes": "1500",
        },
    )
    files = _proc(
        tmp_path,
        "5:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/job_7\n0::/\n",
        [
            f"33 31 0:29 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct",
            f"35 31 0:32 / {top} rw,relatime - cgroup cgroup rw,memory",
            f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw",
        ],
    )
    levels = cgroups.memory_limits(*files)
    assert cgroups.headroom(levels) == (500, 2000)


def test_a_mount_of_a_subtree_and_an_escaped_mount_point(tmp_path):
    """A container's mount of its own cgroup (mountinfo's root field is
    that cgroup); a space in the mount point, escaped as mountinfo does."""
    top = tmp_path / "c g"
    _tree(
        top,
        {
            "memory.max": "4096",
            "memory.current": "1024",
            "sub/memory.max": "max",
        },
    )
    escaped = str(top).replace(" ", "\\040")
    files = _proc(
        tmp_path, "0::/docker/abc/sub\n", [f"31 23 0:28 /docker/abc {escaped} ro - cgroup2 cg rw"]
    )
    levels = cgroups.memory_limits(*files)
    assert cgroups.headroom(levels) == (3072, 4096)


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
    levels = cgroups.memory_limits(*files)
    assert levels == []
    assert cgroups.headroom(levels) is None


def test_unreadable_files_mean_no_limit(tmp_path):
    assert cgroups.memory_limits(str(tmp_path / "none"), str(tmp_path / "none")) == []
    gone = cgroups.Level(100, str(tmp_path / "memory.current"))
    assert cgroups.headroom([gone]) is None


def test_pids_limits_in_v1_and_v2(tmp_path):
    top = tmp_path / "pids"
    _tree(
        top,
        {
            "pids.current": "3",  # the root: no pids.max
            "pod/pids.max": "1024",
            "pod/pids.current": "17",
            "pod/app/pids.max": "max",
        },
    )
    mount = f"40 31 0:36 / {top} rw - cgroup cgroup rw,pids"
    files = _proc(tmp_path, "8:pids:/pod/app\n4:memory:/\n0::/\n", [mount])
    assert cgroups.headroom(cgroups.pids_limits(*files)) == (1007, 1024)
    assert cgroups.memory_limits(*files) == []  # no memory hierarchy mounted
    mount = f"31 23 0:28 / {top} rw - cgroup2 cgroup2 rw"
    files = _proc(tmp_path, "0::/pod/app\n", [mount])
    assert cgroups.headroom(cgroups.pids_limits(*files)) == (1007, 1024)


def _room_without_cgroups(monkeypatch, ready: int) -> int:
    """room_under_limits(ready) with no cgroup limit (the other rules'
    answer on this machine)."""
    monkeypatch.setattr(room, "_cgroup_limits", ([], []))
    return room.room_under_limits(ready)


def test_ready_workers_stay_within_a_quarter_of_a_pids_cgroups_limit(tmp_path, monkeypatch):
    """A quarter of pids.max in ready workers, and never the last half of
    it: the cgroup's other processes' forks need that."""
    current = tmp_path / "pids.current"
    pids = [cgroups.Level(400, str(current))]
    # (ready workers, tasks in the cgroup, how many more at most)
    cases = ((0, 50, 100), (60, 110, 40), (120, 170, 0), (0, 150, 50), (0, 250, 0))
    for ready, tasks, most in cases:
        others = _room_without_cgroups(monkeypatch, ready)
        current.write_text(f"{tasks}\n")
        monkeypatch.setattr(room, "_cgroup_limits", ([], pids))
        assert room.room_under_limits(ready) == min(others, most), (ready, tasks)


def test_none_are_made_ready_while_a_cgroups_limit_is_near(tmp_path, monkeypatch):
    """room_under_limits: none while a cgroup's limit leaves less than
    MIN_AVAILABLE or a tenth of it, whatever MemAvailable says."""
    usage = tmp_path / "memory.current"
    limit = 64 << 30
    others = _room_without_cgroups(monkeypatch, 0)
    monkeypatch.setattr(room, "_cgroup_limits", ([cgroups.Level(limit, str(usage))], []))
    usage.write_text(str(limit - (limit // 10 - 1)))
    assert room.room_under_limits(0) == 0
    usage.write_text(str(limit - limit // 5))
    assert room.room_under_limits(0) == others


def _cgroup_of_our_own(
    controller: str, limits: dict[str, str], limits_v2: dict[str, str] | None = None
) -> str:
    """A new cgroup below this process's in ``controller``'s hierarchy
    (v1's, else v2's), its ``limits`` (file name -> value; ``limits_v2``
    where v2 names them otherwise) written: its directory (the test is
    skipped where none can be made)."""
    with open("/proc/self/cgroup") as f:
        memberships = f.read().splitlines()
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    in_v1, in_v2 = cgroups._membership(memberships, controller)
    found = None
    if in_v1 is not None:
        found = cgroups._directory(mounts, in_v1, "cgroup", controller)
    elif in_v2 is not None:
        found = cgroups._directory(mounts, in_v2, "cgroup2", None)
        limits = limits if limits_v2 is None else limits_v2
    if found is None:
        pytest.skip(f"no {controller} cgroup mounted here")
    path = os.path.join(found[0], f"fastspawn-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot make a {controller} cgroup here: {exc}")
    try:
        for name, value in limits.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(value)
    except OSError as exc:
        os.rmdir(path)
        pytest.skip(f"cannot limit a {controller} cgroup here: {exc}")
    return path


def _run_in(path: str, driver: str) -> list[str]:
    """``driver`` run by a new interpreter that moves itself into cgroup
    ``path`` first; its output's words.  The cgroup is removed after."""
    tests = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(
            [sys.executable, "-c", JOIN + driver, path],
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
    return done.stdout.split()


JOIN = """
import os, sys, time
import fastspawn, workers
from fastspawn._zygote import client

with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))  # the zygote starts in it too
"""

NEAR_MEMORY_LIMIT = """
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
    limit = str(384 << 20)
    path = _cgroup_of_our_own("memory", {"memory.limit_in_bytes": limit}, {"memory.max": limit})
    assert _run_in(path, NEAR_MEMORY_LIMIT) == ["0", "True", "0"]


OUT_OF_PIDS = """
import tempfile
from fastspawn import elastic
from fastspawn._zygote.ready import MAX_WAKE_WORK

def squeeze():
    # Four more tasks allowed than the cgroup has now, ready workers and all.
    with open(os.path.join(sys.argv[1], "pids.current")) as f:
        current = int(f.read())
    with open(os.path.join(sys.argv[1], "pids.max"), "w") as f:
        f.write(str(current + 4))

fastspawn.start_processes(workers.succeed, nprocs=1)
# Binaries, which ready workers cannot become.
print(fastspawn.prefork(8, refill=False), flush=True)
squeeze()
with tempfile.TemporaryDirectory() as logs:
    run = elastic.start_processes(
        "bin", "/bin/true", {r: () for r in range(6)}, {r: {} for r in range(6)}, logs
    )
    print(not run.wait(timeout=60).is_failed(), flush=True)
print(len(client.ready_workers(client.zygote_pid())), flush=True)
with open(os.path.join(sys.argv[1], "pids.max"), "w") as f:
    f.write("max")
# Python ranks of an argument too large to send to ready workers.
print(fastspawn.prefork(8, refill=False), flush=True)
squeeze()
large = b"\x01" * (MAX_WAKE_WORK + 1)
ctx = fastspawn.start_processes(workers.total, args=(large,), nprocs=6)
print(sorted(ctx.return_values.values()) == [len(large) + r for r in range(6)], flush=True)
"""


QUARTER_OF_PIDS = """
fastspawn.start_processes(workers.succeed, nprocs=1)
print(fastspawn.prefork(40, refill=False), flush=True)
"""


@pytest.mark.version_neutral
def test_a_zygote_in_a_pids_cgroup_keeps_a_quarter_of_its_limit_ready():
    path = _cgroup_of_our_own("pids", {"pids.max": "40"})
    assert _run_in(path, QUARTER_OF_PIDS) == ["10"]


@pytest.mark.version_neutral
def test_a_launch_short_of_processes_has_the_ready_workers_make_room():
    """A launch whose ranks cannot take the ready workers (binaries, a
    large argument) and whose forks run out of processes (a pids cgroup's
    limit here; RLIMIT_NPROC or the machine's pids alike) kills and reaps
    them and goes on: it starts as it would have without them."""
    path = _cgroup_of_our_own("pids", {})
    assert _run_in(path, OUT_OF_PIDS) == ["8", "True", "0", "8", "True"]
