"""Where every rank was: the other ranks' Python stacks at a failure, on
demand (ctx.dump_stacks(), fastspawn stacks PID, SIGUSR1 to fastspawn run),
and when a fastspawn run hangs (--hang-timeout)."""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import workers
from helpers import gone

import fastspawn
from fastspawn import elastic
from fastspawn._launch import stacks as _stacks
from fastspawn._worker import stacks as worker_stacks

SPAWN_CTX = multiprocessing.get_context("spawn")
FAILED = "ValueError: rank 1 fails while the others wait"
# CPython 3.12.0-3.12.7 and 3.13.0, whose stack dump may crash the rank it
# dumps: a failure takes no stacks there (see _stacks.DUMP_MAY_CRASH, and
# test_a_failure_says_why_it_took_no_stacks).
failure_stacks = pytest.mark.skipif(
    _stacks.DUMP_MAY_CRASH, reason="no failure stacks on this CPython (gh-123967)"
)
NOT_TAKEN = "the other ranks' stacks are not taken at a failure on Python"


@pytest.fixture(scope="module", autouse=True)
def shared_heap() -> Any:
    """multiprocessing's shared heap, made before the leak fixture's first
    baseline: a Barrier or a Value lives in it, and its arena's fds stay
    open for the life of the process by design (see test_linux)."""
    return SPAWN_CTX.Value("i", 0)


def waiting_line(fn: Callable[..., Any]) -> str:
    """How faulthandler names the line of ``fn`` marked "the waiting line"."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if "# the waiting line" in line)
    return f'File "{inspect.getsourcefile(fn)}", line {first + offset} in {fn.__name__}'


def until_all_show(line: str, dump: Callable[[], dict[Any, str]]) -> dict[Any, str]:
    """``dump()`` again until every text shows ``line``: a rank that said
    it is ready may not be on the waiting line yet (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        found = dump()
        if (found and all(line in text for text in found.values())) or (
            time.monotonic() > deadline
        ):
            return found
        time.sleep(0.1)


def handles_stack_signal(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (worker_stacks.STACKS_SIGNAL - 1) & 1)


def fail_in_barrier(start_method: str, **options: Any) -> fastspawn.ProcessRaisedException:
    barrier = SPAWN_CTX.Barrier(4)
    try:
        with pytest.raises(fastspawn.ProcessRaisedException) as raised:
            fastspawn.start_processes(
                workers.barrier_or_raise, (barrier,), nprocs=4, start_method=start_method, **options
            )
    finally:
        del barrier
    # The traceback's frames hold the barrier (the launch's args) in a cycle
    # with this frame: left so, its semaphores would wait for a garbage
    # collection, which may come while multiprocessing's resource tracker
    # holds its lock in a later launch (CPython 3.13 then warns
    # "ResourceTracker called reentrantly ... might leak").  Freed here,
    # they unregister now.
    traceback.clear_frames(raised.tb)
    return raised.value


@failure_stacks
def test_failure_carries_the_other_ranks_stacks(start_method, caplog):
    caplog.set_level(logging.WARNING, logger="fastspawn")
    exc = fail_in_barrier(start_method)
    # The message is torch's, whole; the stacks come beside it.
    assert str(exc).startswith("\n\n-- Process 1 terminated with the following error:\n")
    assert str(exc).rstrip().endswith(FAILED)
    assert sorted(exc.rank_stacks) == [0, 2, 3]
    line = waiting_line(workers.barrier_or_raise)
    for rank, text in exc.rank_stacks.items():
        assert "(most recent call first)" in text, (rank, text)
        assert line in text, (rank, text)
        # Below fn, the frames are fastspawn's (and with "fork", the
        # caller's own): left out.
        assert "fastspawn/_worker/" not in text and "fastspawn/_zygote" not in text, text
    records = [r for r in caplog.records if hasattr(r, "rank_stacks")]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].rank_stacks == exc.rank_stacks
    message = records[0].getMessage()
    assert message.startswith(f"process 1 (pid {exc.pid}) failed")
    for rank in (0, 2, 3):
        assert f"--- rank {rank} (pid " in message
    assert message.count(line) == 3
    # Taken before the others were stopped, logged after torch's records:
    # the first WARNING of a failure stays torch's (torch's own
    # test_terminate_exit reads records[0]).
    terminating = [r for r in caplog.records if "via signal SIGTERM" in r.getMessage()]
    assert len(terminating) == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings[0] is terminating[0]
    assert caplog.records.index(records[0]) > caplog.records.index(terminating[-1])


def test_stacks_off_restores_torch_output(start_method, caplog):
    caplog.set_level(logging.DEBUG, logger="fastspawn")
    on = fail_in_barrier(start_method)
    caplog.clear()
    off = fail_in_barrier(start_method, stacks=False)
    assert off.rank_stacks == {}
    assert str(off) == str(on)
    # Torch's records, and nothing else.
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert all(re.fullmatch(r"Terminating process \d+ via signal SIGTERM", m) for m in messages)


def test_stacks_off_leaves_the_signal_alone(start_method):
    queue = SPAWN_CTX.SimpleQueue()
    ctx = fastspawn.start_processes(
        workers.ready_then_wait,
        (queue,),
        nprocs=2,
        join=False,
        start_method=start_method,
        stacks=False,
    )
    try:
        assert sorted(queue.get() for _ in range(2)) == [0, 1]
        assert not any(handles_stack_signal(pid) for pid in ctx.pids())
        stacks = ctx.dump_stacks()
        assert sorted(stacks) == [0, 1]
        for text in stacks.values():
            assert text.startswith("no Python stacks: it does not handle signal"), text
        assert all(p.is_alive() for p in ctx.processes)  # not killed by a signal it ignores
    finally:
        for proc in ctx.processes:
            proc.kill()
        with pytest.raises(fastspawn.ProcessExitedException):
            ctx.join(30)
        queue.close()


def test_dump_stacks_on_demand(start_method):
    queue = SPAWN_CTX.SimpleQueue()
    ctx = fastspawn.start_processes(
        workers.ready_then_wait, (queue,), nprocs=3, join=False, start_method=start_method
    )
    try:
        assert sorted(queue.get() for _ in range(3)) == [0, 1, 2]
        line = waiting_line(workers.wait_in_sleep)
        first = until_all_show(line, ctx.dump_stacks)
        assert sorted(first) == [0, 1, 2]
        assert all(line in text for text in first.values()), first
        # Each dump is what was written since the last one, not all so far.
        second = ctx.dump_stacks(timeout=5)
        for rank, text in second.items():
            assert text.count("(most recent call first)") == first[rank].count(
                "(most recent call first)"
            ), text
        assert all(p.is_alive() for p in ctx.processes)
    finally:
        for proc in ctx.processes:
            proc.terminate()
        with pytest.raises(fastspawn.ProcessExitedException):
            ctx.join(30)
        queue.close()
    assert ctx.dump_stacks() == {}  # nothing runs


def test_a_rank_that_closed_its_memfd_is_not_signalled():
    queue = SPAWN_CTX.SimpleQueue()
    ctx = fastspawn.start_processes(
        workers.close_stack_memfd_then_wait, (queue,), nprocs=1, join=False
    )
    try:
        assert queue.get() == 0
        text = ctx.dump_stacks()[0]
        assert text.startswith("no Python stacks: it no longer holds its stack memfd"), text
        time.sleep(0.2)
        assert ctx.processes[0].is_alive()
    finally:
        ctx.processes[0].kill()
        with pytest.raises(fastspawn.ProcessExitedException):
            ctx.join(30)
        queue.close()


def test_exception_keeps_its_stacks_through_pickle():
    exc = fastspawn.ProcessExitedException("process 0 terminated with exit code 1", 0, 42, 1)
    exc.rank_stacks = {1: "Current thread 0x1 (most recent call first):\n  ..."}
    again = pickle.loads(pickle.dumps(exc))
    assert (again.msg, again.pid, again.exit_code, again.rank_stacks) == (
        exc.msg,
        42,
        1,
        exc.rank_stacks,
    )
    plain = pickle.loads(pickle.dumps(fastspawn.ProcessRaisedException("m", 1, 2)))
    assert plain.rank_stacks == {}


@failure_stacks
@pytest.mark.parametrize("start_method", ["zygote", "fork"])
def test_gloo_all_reduce(start_method, tmp_path):
    pytest.importorskip("torch.distributed")
    ready = SPAWN_CTX.Value("i", 0)
    with pytest.raises(fastspawn.ProcessRaisedException) as raised:
        fastspawn.start_processes(
            workers.gloo_all_reduce_or_raise,
            (str(tmp_path / "store"), ready),
            nprocs=4,
            start_method=start_method,
        )
    exc = raised.value
    assert str(exc).rstrip().endswith(FAILED)
    assert sorted(exc.rank_stacks) == [0, 2, 3]
    line = waiting_line(workers.gloo_all_reduce_or_raise)
    for rank, text in exc.rank_stacks.items():
        assert line in text, (rank, text)


# ------------------------------------------------------------------ elastic


@failure_stacks
def test_elastic_result_carries_the_stacks(tmp_path):
    barrier = SPAWN_CTX.Barrier(4)
    ctx = elastic.start_processes(
        "stacks",
        workers.elastic_barrier_or_raise,
        args={rank: (rank, barrier) for rank in range(4)},
        envs={rank: {} for rank in range(4)},
        log_dir=str(tmp_path),
    )
    result = ctx.wait(120)
    assert result is not None and sorted(result.failures) == [1]
    assert sorted(result.rank_stacks) == [0, 2, 3]
    assert result.failures[1].rank_stacks == result.rank_stacks
    line = waiting_line(workers.barrier_or_raise)
    assert all(line in text for text in result.rank_stacks.values()), result.rank_stacks
    assert "rank_stacks" not in repr(result.failures[1])  # the repr stays short


def test_elastic_binary_rank_gets_its_kernel_state():
    ctx = elastic.start_processes(
        "sleepers", "sleep", args={0: ("60",)}, envs={0: {}}, log_dir=os.devnull
    )
    try:
        # Once sleep(1) is exec'd and sleeping.
        text = until_all_show("sleeping (S)", ctx.dump_stacks)[0]
        assert text.startswith("no Python stacks: it does not handle signal"), text
        assert "in the kernel at" in text or "wchan" not in os.listdir("/proc/self"), text
    finally:
        ctx.close(timeout=10)


# ----------------------------------------------------- fastspawn run, stacks

RANKS_WAIT = """\
import os, sys, time

rank = int(os.environ["RANK"])
folder = sys.argv[1]
with open(os.path.join(folder, f"argv-{rank}"), "w") as f:
    f.write(repr(sys.orig_argv))


def marked_ready(seconds):
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    return seconds


def wait_for_peers():
    # The mark on the waiting line itself: a dump taken once every mark is
    # there finds this frame on that line even if the mark's close has not
    # returned yet (on a line of its own, a slow host caught rank 0 there).
    while True:
        time.sleep(marked_ready(60))  # the waiting line


if rank == 1:
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(folder) if n.startswith("ready-")]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    raise ValueError("rank 1 fails while the others wait")
wait_for_peers()
"""


def program(tmp_path: Path, code: str = RANKS_WAIT) -> tuple[str, str]:
    """The program's path and how its waiting line reads in a dump."""
    path = tmp_path / "prog.py"
    path.write_text(code)
    number = code.splitlines().index(
        next(line for line in code.splitlines() if "# the waiting line" in line)
    )
    return str(path), f'File "{path}", line {number + 1} in wait_for_peers'


def fastspawn_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastspawn", *args]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        fastspawn_command("run", *args), capture_output=True, text=True, timeout=120
    )


def blocks(stderr: str) -> dict[str, str]:
    """``--- title ---`` blocks of a stacks report, by title."""
    found = {}
    for match in re.finditer(
        r"^--- (.+?) ---\n(.*?)(?=^---|^fastspawn run:|\Z)", stderr, re.M | re.S
    ):
        found[match.group(1)] = match.group(2)
    return found


@failure_stacks
def test_fastspawn_run_shows_and_writes_the_stacks(tmp_path):
    folder = tmp_path / "marks"
    folder.mkdir()
    prog, line = program(tmp_path)
    done = run("--nprocs-per-node", "3", "--log-dir", str(tmp_path / "logs"), prog, str(folder))
    assert done.returncode == 1, done.stderr
    assert "fastspawn run: where the other ranks were when rank 1 failed:" in done.stderr
    found = blocks(done.stderr)
    titles = sorted(found)
    assert [t.split(" (")[0] for t in titles] == ["rank 0", "rank 2"], done.stderr
    for title, text in found.items():
        assert line in text, (title, done.stderr)
        assert '"<string>"' not in text  # the bootstrap's frame is left out
    for rank in (0, 2):
        log = (tmp_path / "logs" / "attempt_0" / str(rank) / "stacks.log").read_text()
        assert log.startswith("=== ") and "rank 1 failed ===" in log.splitlines()[0], log
        assert line in log
    assert not (tmp_path / "logs" / "attempt_0" / "1" / "stacks.log").exists()
    # The program ran as `python -u prog.py`: sys.argv and a traceback
    # that starts at the program.
    assert 'Traceback (most recent call last):\n  File "' + prog + '", line' in done.stderr


def test_a_failure_says_why_it_took_no_stacks(tmp_path):
    # On a CPython whose dump may crash the rank it dumps, a failure takes
    # no stacks and says so once, naming the fix; elsewhere it takes them
    # and says nothing of the kind.
    folder = tmp_path / "marks"
    folder.mkdir()
    prog, line = program(tmp_path)
    done = run("--nprocs-per-node", "3", prog, str(folder))
    assert done.returncode == 1, done.stderr
    version = ".".join(map(str, sys.version_info[:3]))
    if _stacks.DUMP_MAY_CRASH:
        assert done.stderr.count(f"{NOT_TAKEN} {version}: ") == 1, done.stderr
        assert "gh-123967" in done.stderr and "3.13.1" in done.stderr
        assert "where the other ranks were" not in done.stderr and blocks(done.stderr) == {}
    else:
        assert NOT_TAKEN not in done.stderr
        assert line in done.stderr


def _without_block(stderr: str) -> str:
    head, _, _ = stderr.partition("fastspawn run: where the other ranks were")
    return re.sub(r"\d+", "N", head)


@failure_stacks
def test_fastspawn_run_no_stacks_restores_todays_output(tmp_path):
    outputs = []
    for flags in ([], ["--no-stacks"]):
        folder = tmp_path / f"marks{len(flags)}"
        folder.mkdir()
        prog, _line = program(tmp_path)
        # --exec: a fresh interpreter per rank, where the bootstrap applies
        # (without it the script runs in zygote workers, armed as any).
        done = run("--nprocs-per-node", "3", "--exec", *flags, prog, str(folder))
        assert done.returncode == 1, done.stderr
        outputs.append(done.stderr)
        argv = eval((folder / "argv-0").read_text())
        if flags:
            assert argv == [sys.executable, "-u", prog, str(folder)]
        else:
            assert argv[:3] == [sys.executable, "-u", "-c"] and argv[-2:] == [prog, str(folder)]
    with_stacks, without = outputs
    assert "where the other ranks were" in with_stacks
    assert "where the other ranks were" not in without and "---" not in without
    assert _without_block(with_stacks) == _without_block(without)
    # What today prints: the rank's traceback, torch's lines, the summary.
    assert re.fullmatch(
        r"Traceback \(most recent call last\):\n(.|\n)*\n" + re.escape(FAILED) + r"\n"
        r"(Terminating process \d+ via signal SIGTERM\n){2}"
        r"fastspawn run: rank 1 \(local rank 1, pid \d+\) failed with exit code 1\n",
        without,
    ), without


def start_sleepers(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """A fastspawn run of two ranks waiting in wait_for_peers, once both
    are there; and how its waiting line reads."""
    folder = tmp_path / "marks"
    folder.mkdir()
    code = RANKS_WAIT.replace("if rank == 1:", "if False:")
    prog, line = program(tmp_path, code)
    job = subprocess.Popen(
        fastspawn_command("run", "--nprocs-per-node", "2", *flags, prog, str(folder)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(folder) if n.startswith("ready-")]) < 2:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    return job, line


def stop(job: subprocess.Popen[str]) -> tuple[str, str]:
    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
    try:
        return job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def test_fastspawn_stacks_and_sigusr1_on_a_running_job(tmp_path):
    job, line = start_sleepers(tmp_path, "--log-dir", str(tmp_path / "logs"))
    try:
        runs = []

        def stacks() -> dict[str, str]:
            runs.append(
                subprocess.run(
                    fastspawn_command("stacks", str(job.pid)),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            )
            return blocks(runs[-1].stdout)

        found = until_all_show(line, stacks)
        done = runs[-1]
        assert done.returncode == 0, done.stderr
        assert [t.split(" (")[0] for t in sorted(found)] == ["rank 0", "rank 1"], done.stdout
        assert all(line in text for text in found.values()), done.stdout
        job.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        log = tmp_path / "logs" / "attempt_0" / "1" / "stacks.log"
        while not (log.exists() and line in log.read_text()):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        assert job.poll() is None  # SIGUSR1 did not end it
    finally:
        out, err = stop(job)
    assert job.returncode == 128 + signal.SIGTERM, err
    assert "fastspawn run: where every rank is (SIGUSR1):" in err
    assert [t.split(" (")[0] for t in sorted(blocks(err))] == ["rank 0", "rank 1"], err


def test_fastspawn_stacks_of_a_program_that_started_ranks(start_method):
    queue = SPAWN_CTX.SimpleQueue()
    ctx = fastspawn.start_processes(
        workers.ready_then_wait, (queue,), nprocs=2, join=False, start_method=start_method
    )
    try:
        assert sorted(queue.get() for _ in range(2)) == [0, 1]
        runs = []

        def stacks() -> dict[str, str]:
            runs.append(
                subprocess.run(
                    fastspawn_command("stacks", str(os.getpid())),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            )
            return blocks(runs[-1].stdout)

        line = waiting_line(workers.wait_in_sleep)
        found = until_all_show(line, stacks)
        assert runs[-1].returncode == 0, runs[-1].stderr
        assert sorted(found) == [f"rank {r} (pid {pid})" for r, pid in enumerate(ctx.pids())]
        assert all(line in text for text in found.values()), runs[-1].stdout
    finally:
        for proc in ctx.processes:
            proc.terminate()
        with pytest.raises(fastspawn.ProcessExitedException):
            ctx.join(30)
        queue.close()


def test_fastspawn_stacks_without_ranks():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        done = subprocess.run(
            fastspawn_command("stacks", str(sleeper.pid)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and "no rank runs below process" in done.stderr
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(30)
    done = subprocess.run(
        fastspawn_command("stacks", str(sleeper.pid)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and f"no process {sleeper.pid}" in done.stderr


def test_hang_timeout_kill_shows_every_rank_and_stops_the_job(tmp_path):
    job, line = start_sleepers(
        tmp_path,
        *("--log-dir", str(tmp_path / "logs")),
        *("--hang-timeout", "2", "--hang-action", "kill"),
    )
    pids = [int(p) for p in subprocess.check_output(["pgrep", "-f", str(tmp_path)]).split()]
    try:
        out, err = job.communicate(timeout=60)
    finally:
        stop(job)
    assert job.returncode == 124, err
    assert "no rank wrote anything or exited for 2 s (--hang-timeout)" in err
    found = blocks(err)
    assert [t.split(" (")[0] for t in sorted(found)] == ["rank 0", "rank 1"], err
    assert all(line in text for text in found.values()), err
    assert err.rstrip().endswith("fastspawn run: stopping every rank (--hang-action kill)")
    for rank in (0, 1):
        assert line in (tmp_path / "logs" / "attempt_0" / str(rank) / "stacks.log").read_text()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if not gone(pid)]
        time.sleep(0.05)


def test_hang_timeout_spares_a_job_that_prints(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text("import time\nfor i in range(15):\n    print(i)\n    time.sleep(0.2)\n")
    done = run("--nprocs-per-node", "2", "--hang-timeout", "5", "--hang-action", "kill", str(path))
    assert done.returncode == 0, done.stderr
    assert "--hang-timeout" not in done.stderr


def test_hang_timeout_needs_seconds():
    done = run("--nprocs-per-node", "1", "--hang-timeout", "0", "prog.py")
    assert done.returncode == 2 and "above 0" in done.stderr


# ------------------------------------------- the .py bootstrap, against python

PROBE = """\
import sys, os
print(sys.argv, sys.path[0] == os.path.dirname(os.path.realpath(__file__)))
print(__file__, __name__, __package__, __spec__, __cached__, type(__loader__).__name__)
print(sorted(k for k in globals() if not k.startswith("_") or k.startswith("__")))
print(os.fstat(0).st_size >= 0)
def fail():
    raise KeyError("from the program")
if sys.argv[1:] == ["fail"]:
    fail()
"""


def _both(tmp_path: Path, name: str, args: list[str]) -> list[subprocess.CompletedProcess[str]]:
    runs = []
    for argv in (
        ["-u", name, *args],
        worker_stacks.python_rank_argv(3, name, args),
    ):
        runs.append(
            subprocess.run(
                [sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60
            )
        )
    return runs


@pytest.mark.parametrize("args", [["a", "b"], ["fail"]])
def test_bootstrap_runs_a_program_as_python_does(tmp_path, args):
    (tmp_path / "probe.py").write_text(PROBE)
    plain, booted = _both(tmp_path, "probe.py", args)
    assert booted.returncode == plain.returncode
    assert (booted.stdout, booted.stderr) == (plain.stdout, plain.stderr)


@pytest.mark.parametrize("text", [None, "x = (\n"])
def test_bootstrap_fails_as_python_does(tmp_path, text):
    if text is not None:
        (tmp_path / "bad.py").write_text(text)
    plain, booted = _both(tmp_path, "bad.py", [])
    assert booted.returncode == plain.returncode != 0
    assert (booted.stdout, booted.stderr) == (plain.stdout, plain.stderr)


def test_bootstrap_arms_the_dump(tmp_path):
    (tmp_path / "wait.py").write_text(
        textwrap.dedent(
            """\
            import time
            print("ready", flush=True)
            while True:
                time.sleep(60)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, *worker_stacks.python_rank_argv(3, "wait.py", [])],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert _stacks.find_memfd(proc.pid) is not None
        assert _stacks.find_memfd(proc.pid)[1] == "3"  # type: ignore[index]
        pidfd = os.pidfd_open(proc.pid)
        line = f'File "{tmp_path / "wait.py"}", line 4 in <module>'
        try:
            found = until_all_show(
                line, lambda: _stacks.collect([_stacks.Target(3, proc.pid, pidfd)], 10)
            )
        finally:
            os.close(pidfd)
        assert line in found[3], found
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize("stacks", [True, False])
def test_a_rank_that_launches_with_fork(stacks):
    # The outer rank is armed (born so, by the zygote); its own "fork"
    # workers get files of their own (or, stacks off, drop what they
    # inherited), and the outer rank keeps its own.
    ctx = fastspawn.start_processes(workers.nested_fork_launch, (stacks,), nprocs=1)
    reports, found, before, after = ctx.return_values[0]
    assert before is not None and before == after
    for rank, links, catches in reports:
        if stacks:
            assert links == [f"/memfd:fastspawn-stacks:{rank} (deleted)"] and catches
        else:
            assert links == [] and not catches
    if stacks:
        assert sorted(found) == [0, 1]
        line = waiting_line(workers.wait_in_sleep)
        assert all(line in text for text in found.values()), found
    else:
        assert all(text.startswith("no Python stacks") for text in found.values()), found


def test_fastspawn_stacks_refuses_a_pid_that_is_not_one():
    done = subprocess.run(
        [sys.executable, "-m", "fastspawn", "stacks", "abc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "PID must be a positive integer, got 'abc'" in done.stderr
    assert "_positive" not in done.stderr
