"""fastspawn run's hang watch and stack requests (issue 29, items 3-5 and
the stacks parts of 7): stack dumps are not progress; a rank whose
/proc/PID/io cannot be read is watched by its CPU time, or not at all,
never taken for hung; torch's agent (--standalone) serves SIGUSR1 and
--hang-timeout as the static path does; a rank that blocks the stack
signal gets no second one queued; ``fastspawn stacks`` finds the ranks of
a zygote (or its guard) given as the PID, and says what a bad PID is."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import workers
from test_stacks import RANKS_WAIT, blocks, fastspawn_command, program

import fastspawn
from fastspawn._cli import stacks as cli_stacks
from fastspawn._launch import stacks as _stacks
from fastspawn._worker.stacks import STACKS_SIGNAL
from fastspawn._zygote import protocol

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

SPAWN_CTX = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module", autouse=True)
def shared_heap() -> Any:
    """multiprocessing's shared heap, made before the leak fixture's first
    baseline (see test_stacks)."""
    return SPAWN_CTX.Value("i", 0)


def block_stacks_then_wait(rank: int, queue: Any) -> None:
    """A rank that blocks the stack signal in its one thread, then waits."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
    queue.put(rank)
    while True:
        time.sleep(60)


def _start_waiting(fn: Any, nprocs: int = 2) -> tuple[fastspawn.ProcessContext, Any]:
    queue = SPAWN_CTX.SimpleQueue()
    ctx = fastspawn.start_processes(fn, (queue,), nprocs=nprocs, join=False)
    assert sorted(queue.get() for _ in range(nprocs)) == list(range(nprocs))
    return ctx, queue


def _stop(ctx: fastspawn.ProcessContext, queue: Any) -> None:
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    with pytest.raises(fastspawn.ProcessExitedException):
        ctx.join(30)
    queue.close()


# ------------------------------------------------- stack dumps are not progress


def test_stack_dumps_are_not_progress():
    ctx, queue = _start_waiting(workers.ready_then_wait)
    try:
        pids = dict(enumerate(ctx.pids()))
        progress = cli_stacks.Progress(pids)
        line = "in wait_in_sleep"
        # A rank's put() may not have returned yet when its rank reaches us.
        deadline = time.monotonic() + 30
        while not all(line in text for text in ctx.dump_stacks().values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        progress.moved()  # what the ranks wrote up to now
        for _ in range(3):
            stacks = ctx.dump_stacks()
            assert all(line in text for text in stacks.values()), stacks
            assert not progress.moved()  # faulthandler wrote, into the memfd
        ctx.processes[1].kill()
        deadline = time.monotonic() + 30
        while not progress.moved():  # an exit is progress
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _stop(ctx, queue)


# ----------------------------------- a rank whose /proc/PID/io cannot be read


def _unreadable(pid: int) -> int:
    raise PermissionError(13, "Permission denied", f"/proc/{pid}/io")


@pytest.fixture
def printer_and_sleeper():
    """Two processes, once both run their loop: one prints every 0.05 s,
    one sleeps."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"import time\nprint(flush=True)\n{loop}"],
            stdout=subprocess.PIPE,
        )
        for loop in (
            "while True:\n    print('x', flush=True)\n    time.sleep(0.05)",
            "time.sleep(60)",
        )
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()


def test_unreadable_io_falls_back_to_cpu_time(monkeypatch, printer_and_sleeper):
    monkeypatch.setattr(cli_stacks, "_written", _unreadable)
    printer, sleeper = printer_and_sleeper
    notes: list[tuple[int, str]] = []
    working = cli_stacks.Progress({0: printer.pid}, lambda rank, why: notes.append((rank, why)))
    deadline = time.monotonic() + 30
    while not working.moved():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    asleep = cli_stacks.Progress({3: sleeper.pid}, lambda rank, why: notes.append((rank, why)))
    for _ in range(3):
        time.sleep(0.1)
        assert not asleep.moved()
    assert [rank for rank, _why in notes] == [0, 3]  # once each
    assert f"its /proc/{printer.pid}/io cannot be read here" in notes[0][1]
    assert "counts its CPU time instead" in notes[0][1]


def test_a_rank_that_cannot_be_seen_is_never_hung(monkeypatch, printer_and_sleeper):
    monkeypatch.setattr(cli_stacks, "_written", _unreadable)
    monkeypatch.setattr(cli_stacks, "_ran", _unreadable)
    notes: list[str] = []
    asleep = cli_stacks.Progress({0: printer_and_sleeper[1].pid}, lambda r, why: notes.append(why))
    assert all(asleep.moved() for _ in range(3))
    assert len(notes) == 1 and "cannot see it, and never takes the job for hung" in notes[0]


# ------------------------------------------- the signal pending: none queued


def _queued_signals() -> int:
    """This user's queued signals (SigQ), as the kernel counts them."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("SigQ:"))
    return int(line.split()[1].split("/")[0])


def test_a_rank_that_blocks_the_signal_gets_one_request():
    ctx, queue = _start_waiting(block_stacks_then_wait, nprocs=1)
    try:
        first = ctx.dump_stacks(timeout=0.2)[0]
        assert first.startswith("no Python stacks: the dump did not complete"), first
        queued = _queued_signals()
        for _ in range(3):
            text = ctx.dump_stacks(timeout=0.2)[0]
            assert "has not answered an earlier request" in text, text
        assert _queued_signals() - queued < 2  # was +3: one queued per request
    finally:
        _stop(ctx, queue)


# --------------------------------------------- fastspawn stacks <zygote pid>


def _zygote_and_guard(rank_pid: int) -> tuple[int, int]:
    with open(f"/proc/{rank_pid}/status") as f:
        zygote = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    with open(f"/proc/{zygote}/status") as f:
        guard = int(next(line for line in f if line.startswith("PPid:")).split()[1])
    return zygote, guard


def test_ranks_below_a_zygote_and_its_guard():
    ctx, queue = _start_waiting(workers.ready_then_wait)
    try:
        pids = ctx.pids()
        zygote, guard = _zygote_and_guard(pids[0])
        with open(f"/proc/{guard}/cmdline", "rb") as f:
            assert protocol.MAIN_MARK in f.read()
        expected = sorted((str(rank), pid) for rank, pid in enumerate(pids))
        for root in (os.getpid(), guard, zygote):
            assert sorted(_stacks.ranks_below(root)) == expected, root
        assert _stacks.ranks_below(pids[0]) == []  # a rank: nothing below it
    finally:
        _stop(ctx, queue)


def test_fastspawn_stacks_says_what_a_pid_is():
    assert cli_stacks.process_id("42") == 42
    for text in ("abc", "0", "-3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="PID must be a positive integer"):
            cli_stacks.process_id(text)


# ------------------------------------------------------- under torch's agent


def test_agent_serves_sigusr1_and_the_hang_watch(tmp_path: Path):
    pytest.importorskip("torch.distributed")
    folder = tmp_path / "marks"
    folder.mkdir()
    prog, line = program(tmp_path, RANKS_WAIT.replace("if rank == 1:", "if False:"))
    logs = tmp_path / "logs"
    job = subprocess.Popen(
        fastspawn_command(
            "run",
            *("--standalone", "--nproc-per-node", "2", "--log-dir", str(logs)),
            *("--hang-timeout", "2", "--hang-action", "kill"),
            prog,
            str(folder),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(folder) if n.startswith("ready-")]) < 2:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        # Both ranks wrote their mark last: the job is quiet for at least
        # 2 s from now, and the requests land well inside that.
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 124, err
    assert "fastspawn run: where every rank is (SIGUSR1):" in err
    assert "no rank wrote anything or exited for 2 s (--hang-timeout)" in err
    assert err.rstrip().endswith("fastspawn run: stopping every rank (--hang-action kill)")
    found = blocks(err.partition("(--hang-timeout)")[2])
    assert [t.split(" (")[0] for t in sorted(found)] == ["rank 0", "rank 1"], err
    assert all(line in text for text in found.values()), err
    stacks_logs = sorted(logs.glob("*/attempt_0/*/stacks.log"))
    assert [p.parent.name for p in stacks_logs] == ["0", "1"], err
    for path in stacks_logs:
        text = path.read_text()
        assert "(SIGUSR1) ===" in text and "(--hang-timeout)" in text, text
