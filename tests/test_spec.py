"""SPEC.md section 2: the behaviours torch's own spawn tests check, as ours,
for every start method."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time

import pytest
import workers
from helpers import gone

import fastspawn

SPAWN_CTX = multiprocessing.get_context("spawn")


def start(fn, args=(), nprocs=2, start_method="spawn", **kwargs):
    return fastspawn.start_processes(fn, args, nprocs=nprocs, start_method=start_method, **kwargs)


def test_success(start_method):
    ctx = start(workers.succeed, start_method=start_method)
    assert ctx.return_values == {0: 0, 1: 1}


def test_join_again_after_all_exited(start_method):
    ctx = start(workers.succeed, nprocs=2, join=False, start_method=start_method)
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline
    for _ in range(3):
        assert ctx.join() is True
    assert ctx.join(timeout=0) is True


def test_rank_is_first_argument(start_method):
    queue = SPAWN_CTX.SimpleQueue()
    try:
        start(workers.put_rank, (queue,), nprocs=2, start_method=start_method)
        assert {queue.get(), queue.get()} == {0, 1}
    finally:
        queue.close()


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_exception_single(start_method, bad_rank):
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        start(workers.raise_on, (bad_rank,), nprocs=2, start_method=start_method)
    message = str(info.value)
    assert message.startswith(f"\n\n-- Process {bad_rank} terminated with the following error:\n")
    assert message.rstrip("\n").endswith(
        f"\nValueError: legitimate exception from process {bad_rank}"
    )
    assert info.value.error_index == bad_rank
    assert info.value.error_pid == info.value.pid


def test_exception_all(start_method):
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        start(workers.raise_after_random_sleep, nprocs=2, start_method=start_method)
    message = str(info.value).rstrip("\n")
    assert message.endswith(
        (
            "\nValueError: legitimate exception from process 0",
            "\nValueError: legitimate exception from process 1",
        )
    )


def test_terminate_signal(start_method):
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        start(workers.abort_rank0, nprocs=2, start_method=start_method)
    assert str(info.value) in (
        "process 0 terminated with signal SIGABRT",
        "process 0 terminated with signal SIGIOT",
    )
    assert info.value.exit_code == -signal.SIGABRT
    assert info.value.signal_name in ("SIGABRT", "SIGIOT")


def test_terminate_exit_without_grace_period(start_method, caplog):
    caplog.set_level(logging.WARNING, logger="fastspawn")
    ctx = start(workers.exit_rank0, (123, 4), nprocs=2, join=False, start_method=start_method)
    pid1 = ctx.processes[1].pid
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        while not ctx.join():
            pass
    assert str(info.value) == "process 0 terminated with exit code 123"
    assert info.value.exit_code == 123
    assert f"Terminating process {pid1} via signal" in caplog.text
    assert all(not p.is_alive() for p in ctx.processes)
    assert all(gone(pid) for pid in ctx.pids())


# Seconds of waiting by design, in fastspawn's own code and the kernel's: one
# CPython version in CI (.ci/run), for the 30-minute budget.
@pytest.mark.version_neutral
def test_terminate_exit_with_grace_period(start_method, caplog):
    caplog.set_level(logging.WARNING, logger="fastspawn")
    ctx = start(workers.exit_rank0, (123, 4), nprocs=2, join=False, start_method=start_method)
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        while not ctx.join(grace_period=20):
            pass
    assert str(info.value) == "process 0 terminated with exit code 123"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert ctx.processes[1].exitcode == 0  # it finished its sleep by itself
    assert all(gone(pid) for pid in ctx.pids())


def test_success_first_then_exception(start_method):
    with pytest.raises(fastspawn.ProcessRaisedException, match="legitimate exception"):
        start(workers.return_or_raise, nprocs=3, start_method=start_method)


def test_any_exception_is_raised_exception(start_method):
    # workers.no_args takes no rank: TypeError inside the child.
    with pytest.raises(fastspawn.ProcessRaisedException, match="TypeError"):
        start(workers.no_args, nprocs=1, start_method=start_method)


def test_sigterm_from_outside_is_exited_exception(start_method):
    ctx = start(workers.sleep_forever, nprocs=2, join=False, start_method=start_method)
    os.kill(ctx.pids()[1], signal.SIGTERM)
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        while not ctx.join():
            pass
    assert str(info.value) == "process 1 terminated with signal SIGTERM"
    assert info.value.error_index == 1


def test_signal_without_name(start_method):
    number = next(
        n
        for n in range(signal.SIGRTMIN + 1, signal.SIGRTMAX)
        if n not in {s.value for s in signal.Signals}
    )
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        start(workers.kill_self_with, (number,), nprocs=1, start_method=start_method)
    assert str(info.value) == f"process 0 terminated with signal <Unknown signal {number}>"
    assert info.value.signal_name == f"<Unknown signal {number}>"
    assert info.value.exit_code == -number


def test_nested_grandchildren_die_with_child(start_method):
    queue = SPAWN_CTX.SimpleQueue()
    try:
        with pytest.raises(fastspawn.ProcessExitedException, match="SIGTERM"):
            start(workers.nested, (start_method, queue), nprocs=1, start_method=start_method)
        grandchildren = queue.get()
    finally:
        queue.close()
    assert len(grandchildren) == 2
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in grandchildren):
        assert time.monotonic() < deadline, "grandchildren outlived their parent"
        time.sleep(0.05)


def test_exceptions_pickle_roundtrip():
    raised = fastspawn.ProcessRaisedException("msg", 1, 123)
    exited = fastspawn.ProcessExitedException("msg2", 2, 456, exit_code=-6, signal_name="SIGABRT")
    base = fastspawn.ProcessException("msg3", 3, 789)
    for exc in (raised, exited, base):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc)
        assert (copy.msg, copy.error_index, copy.error_pid, copy.pid) == (
            exc.msg,
            exc.error_index,
            exc.error_pid,
            exc.pid,
        )
        assert str(copy) == str(exc)
    copy = pickle.loads(pickle.dumps(exited))
    assert (copy.exit_code, copy.signal_name) == (-6, "SIGABRT")


@pytest.mark.version_neutral  # waits 3 s per start method by design
def test_slow_import_costs_one_import(start_method, monkeypatch):
    seconds = 3.0
    monkeypatch.setenv("SLOW_IMPORT_SECONDS", str(seconds))
    sys.modules.pop("slow_import", None)
    slow_import = importlib.import_module("slow_import")  # the parent's own import
    try:
        ctx = start(slow_import.use, nprocs=4, start_method=start_method)
    finally:
        sys.modules.pop("slow_import", None)
    assert sorted(ctx.return_values) == list(range(4))
    imports = set(ctx.return_values.values())
    assert {cost for cost, _, _ in imports} == {seconds}
    # The ranks rely on one import, or on imports that ran at once: the
    # last to begin began before the first to end had ended.  One after
    # another, the start would cost four.
    assert max(began for _, began, _ in imports) < min(ended for _, _, ended in imports), (
        f"imports one after another: {sorted(imports)}"
    )


def test_raised_rank_keeps_its_exit_code_and_the_others_are_stopped(start_method):
    # The caller may act on a raising rank's report before the zygote has
    # sent its exit status; the status still arrives before join raises.
    ctx = start(workers.raise_on, (0, 30.0), nprocs=3, join=False, start_method=start_method)
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        while not ctx.join(timeout=60):
            pass
    assert info.value.error_index == 0
    assert ctx.processes[0].exitcode == 1
    assert [p.exitcode for p in ctx.processes[1:]] == [-signal.SIGTERM] * 2
    assert all(gone(pid) for pid in ctx.pids())


def test_later_joins_raise_for_the_stopped_ranks_then_true(start_method):
    # torch: each later join() raises for one more rank that ended badly,
    # here the two stopped by SIGTERM, before join() returns True.
    ctx = start(workers.raise_on, (0, 30.0), nprocs=3, join=False, start_method=start_method)
    with pytest.raises(fastspawn.ProcessRaisedException):
        while not ctx.join(timeout=60):
            pass
    for rank in (1, 2):
        with pytest.raises(fastspawn.ProcessExitedException) as info:
            ctx.join()
        assert info.value.error_index == rank
        assert str(info.value) == f"process {rank} terminated with signal SIGTERM"
    assert ctx.join() is True and ctx.join() is True


def test_ranks_that_returned_before_a_failure_keep_their_values(start_method, tmp_path):
    # paddle: each rank's return value is retrievable, a failure elsewhere
    # notwithstanding.  Rank 0 returns, rank 1 raises once rank 0 has exited.
    marker = str(tmp_path / "rank0")
    ctx = start(
        workers.return_then_raise, (marker,), nprocs=2, join=False, start_method=start_method
    )
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        while not ctx.join(timeout=60):
            pass
    assert info.value.error_index == 1
    assert ctx.return_values == {0: None}
