"""Binary ranks: the C launcher sets up what a forked worker would have
(process settings, signals), and the zygote starts elastic's binary ranks
with it, as its own children."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from fastspawn import elastic
from fastspawn._os import oscall
from fastspawn._zygote import client

SHOW = (
    "umask; ulimit -Sn; ps -o ni= -p $$; "
    "grep -E '^(SigBlk|SigIgn|Cpus_allowed_list):' /proc/$$/status"
)


def _run(process_state, argv=("/bin/sh", "sh", "-c", SHOW), **kwargs):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid, pidfd = oscall.launch(
            argv[0],
            list(argv[1:]),
            dict(os.environ),
            stdout=out_w,
            stderr=err_w,
            process_state=process_state,
            **kwargs,
        )
    finally:
        os.close(out_w)
        os.close(err_w)
    try:
        status = oscall.pidfd_wait(pidfd, nohang=False)
    finally:
        os.close(pidfd)
    with open(out_r) as out, open(err_r) as err:
        return status, out.read().split("\n"), err.read()


def _field(lines, name):
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith(name))


def test_launch_applies_the_process_settings_it_is_given():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    cpu = min(os.sched_getaffinity(0))
    state = {
        "umask": 0o027,
        "nice": nice + 1,
        "affinity": [cpu],
        "rlimits": {resource.RLIMIT_NOFILE: (min(soft, 200), hard)},
    }
    status, lines, err = _run(state)
    assert status == 0, err
    assert lines[0] == "0027"
    assert int(lines[1]) == min(soft, 200)
    assert int(lines[2]) == nice + 1
    assert _field(lines, "Cpus_allowed_list") == str(cpu)
    assert err == ""


def test_launch_notes_a_setting_the_kernel_refuses_and_runs_on():
    # No such CPU: sched_setaffinity refuses, the program still runs.
    status, lines, err = _run({"affinity": [4095]})
    assert status == 0, err
    assert "fastspawn: this rank keeps its launcher's CPU affinity" in err
    assert _field(lines, "Cpus_allowed_list") == _cpus_allowed()


def _cpus_allowed() -> str:
    with open("/proc/self/status") as f:
        return next(
            line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list:")
        )


def test_launch_resets_the_default_signals_and_sets_the_mask():
    # grep reports its own mask (a shell would clear it at start).
    grep = ("/bin/grep", "grep", "-E", "^(SigBlk|SigIgn):", "/proc/self/status")
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with oscall.held_signals():
            status, lines, err = _run(
                None, grep, default_signals=(signal.SIGUSR2,), signal_mask=(signal.SIGUSR1,)
            )
        kept_status, kept_lines, _ = _run(None, grep)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert status == 0, err
    assert int(_field(lines, "SigIgn"), 16) & (1 << (signal.SIGUSR2 - 1)) == 0
    assert int(_field(lines, "SigBlk"), 16) == 1 << (signal.SIGUSR1 - 1)
    # Without default_signals an ignored signal stays ignored across exec.
    assert kept_status == 0
    assert int(_field(kept_lines, "SigIgn"), 16) & (1 << (signal.SIGUSR2 - 1))


def test_elastic_binary_ranks_are_the_zygotes_children_with_the_callers_settings(tmp_path):
    client.get_server()  # started before the caller changes its settings
    zygote = client.zygote_pid()
    old_umask = os.umask(0o077)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 300), hard))
    try:
        ctx = elastic.start_processes(
            "bin",
            "/bin/sh",
            {0: ("-c", f"echo $PPID; {SHOW}")},
            {0: {}},
            log_dir=str(tmp_path),
            redirects=elastic.Std.ALL,
        )
        result = ctx.wait(timeout=60)
    finally:
        os.umask(old_umask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert result is not None and not result.is_failed(), result
    lines = (tmp_path / "0" / "stdout.log").read_text().split("\n")
    assert int(lines[0]) == zygote
    assert lines[1] == "0077"
    assert int(lines[2]) == min(soft, 300)
    assert int(_field(lines, "SigIgn"), 16) & (1 << (signal.SIGINT - 1)) == 0


def test_elastic_binary_ranks_start_with_no_signal_blocked(tmp_path):
    # grep itself, not under a shell (which clears its mask at start).
    ctx = elastic.start_processes(
        "bin",
        "/bin/grep",
        {0: ("-E", "^(SigBlk|SigIgn):", "/proc/self/status")},
        {0: {}},
        log_dir=str(tmp_path),
        redirects=elastic.Std.ALL,
    )
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed(), result
    lines = (tmp_path / "0" / "stdout.log").read_text().split("\n")
    assert int(_field(lines, "SigBlk"), 16) == 0
    assert int(_field(lines, "SigIgn"), 16) & (1 << (signal.SIGINT - 1)) == 0


def test_elastic_binary_rank_dies_by_sigint_though_the_zygote_ignores_it(tmp_path):
    ctx = elastic.start_processes(
        "bin",
        "/bin/sh",
        {0: ("-c", "kill -INT $$; echo survived")},
        {0: {}},
        log_dir=str(tmp_path),
        redirects=elastic.Std.ALL,
    )
    result = ctx.wait(timeout=60)
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGINT
    assert "survived" not in (tmp_path / "0" / "stdout.log").read_text()


@pytest.mark.skipif(not os.path.exists("/bin/true"), reason="needs /bin/true")
def test_many_binary_ranks_all_succeed(tmp_path):
    ctx = elastic.start_processes(
        "bin",
        "/bin/true",
        {rank: () for rank in range(64)},
        {rank: {} for rank in range(64)},
        log_dir=str(tmp_path),
    )
    result = ctx.wait(timeout=120)
    assert result is not None and not result.is_failed()
    assert sorted(result.return_values) == list(range(64))


def test_binary_rank_that_cannot_run_fails_the_launch_with_nothing_left(tmp_path):
    script = tmp_path / "prog"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    code = f"""
import os, sys
from fastspawn import elastic
from fastspawn.elastic import pcontext
# Resolved (and found executable) before the start; made unrunnable after.
real = pcontext.resolve_binary
def resolve_then_break(name, env):
    path = real(name, env)
    os.chmod(path, 0o644)
    return path
pcontext.resolve_binary = resolve_then_break
try:
    elastic.start_processes("bin", {str(script)!r}, {{0: (), 1: ()}}, {{0: {{}}, 1: {{}}}},
                            log_dir={str(log_dir)!r})
except BaseException as exc:
    print(type(exc).__name__, exc)
    sys.exit(0)
print("started")
"""
    # Even root's execve needs an execute bit set: EACCES here.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "started" not in done.stdout
    assert "Permission denied" in done.stdout
