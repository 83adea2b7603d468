"""The limits a launch must stay within: an ``nprocs`` above what the
user's or the machine's limits allow refused before anything starts
(start_processes, fastspawn.elastic, ``fastspawn run``)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import psutil
import pytest
import workers
from conftest import START_METHODS

import fastspawn
from fastspawn import _limits, _zygote_client, elastic

# ------------------------------------------------ refused before anything starts


def _processes_now() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


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
    zygote = _zygote_client.helper_processes()[0]
    with pytest.raises(ValueError, match=rf"nprocs={nprocs} .* kernel.pid_max, .* is {pid_max}:"):
        fastspawn.start_processes(print, nprocs=nprocs, start_method=method)
    assert _processes_now() == before
    assert _zygote_client.helper_processes()[0] == zygote


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
    pid_max.write_text("100\n")
    monkeypatch.setattr(_limits, "_PID_MAX", str(pid_max))
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    before = _processes_now()
    ranks = range(150)
    with pytest.raises(ValueError, match=r"a launch of 150 ranks .* kernel.pid_max, .* is 100"):
        elastic.start_processes(
            "x",
            "/bin/true",
            {rank: () for rank in ranks},
            {rank: {} for rank in ranks},
            str(log_dir),
            tee=elastic.Std.ALL,
        )
    assert list(log_dir.iterdir()) == []
    assert _processes_now() == before


def test_fastspawn_run_absurd_nprocs_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", "--nprocs-per-node",
         "100000000000000000000", "/bin/true"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "usage:" in done.stderr and "lower --nprocs-per-node" in done.stderr
    assert "kernel.pid_max" in done.stderr or "RLIMIT_" in done.stderr
    assert done.stdout == ""
