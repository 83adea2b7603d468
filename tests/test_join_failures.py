"""A failure is never lost, a limit never overflows: join's teardown, ranks'
forked children, and timeouts of any size."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import workers

import fastspawn
from fastspawn import elastic
from fastspawn._launch import context

INF = float("inf")
NAN = float("nan")


def start(fn, args=(), nprocs=3, start_method="zygote", **kwargs):
    return fastspawn.start_processes(
        fn, args, nprocs=nprocs, join=False, start_method=start_method, **kwargs
    )


# ------------------------------------------------------------- teardown


@pytest.mark.version_neutral  # waits seconds by design, the same on every version
def test_join_grace_period_inf_raises_the_failure_and_leaves_nothing_running(start_method, caplog):
    caplog.set_level(logging.WARNING, logger="fastspawn")
    ctx = start(workers.raise_on_rank0_others_ignore_sigterm, (3.0,), start_method=start_method)
    # Bad values are refused at the call, before anything changes.
    with pytest.raises(ValueError, match="grace_period.*nan"):
        ctx.join(grace_period=NAN)
    with pytest.raises(TypeError, match="grace_period must be a number"):
        ctx.join(grace_period="x")
    # inf: the others get as long as they take, and are never signalled.
    with pytest.raises(
        fastspawn.ProcessRaisedException,
        match=r"\nValueError: legitimate exception from process 0\n?$",
    ) as info:
        while not ctx.join(grace_period=INF):
            pass
    assert info.value.error_index == 0
    assert [proc.exitcode for proc in ctx.processes] == [1, 0, 0]
    assert ctx.join() is True
    assert ctx.return_values == {1: None, 2: None}
    assert "Terminating process" not in caplog.text


def test_join_teardown_error_still_raises_the_failure_and_leaves_nothing_running(
    start_method, monkeypatch, caplog
):
    def broken_wait(self, timeout):
        raise OverflowError("the graceful wait broke")

    monkeypatch.setattr(context.ProcessContext, "_wait_all", broken_wait)
    ctx = start(workers.raise_on_rank0_others_ignore_sigterm, (600.0,), start_method=start_method)
    with pytest.raises(
        fastspawn.ProcessRaisedException,
        match=r"\nValueError: legitimate exception from process 0\n?$",
    ):
        while not ctx.join(grace_period=5):
            pass
    # The others ignore SIGTERM and would sleep for 10 minutes: killed.
    assert [proc.exitcode for proc in ctx.processes] == [1, -signal.SIGKILL, -signal.SIGKILL]
    assert "the graceful wait broke" in caplog.text
    # As after any failure, each later join raises for one more rank that
    # ended badly, then returns True.
    for rank in (1, 2):
        with pytest.raises(fastspawn.ProcessExitedException, match=f"process {rank} .* SIGKILL"):
            ctx.join()
    assert ctx.join() is True


def test_join_interrupted_teardown_keeps_the_failure_for_the_next_join(start_method, monkeypatch):
    def interrupted_wait(self, timeout):
        raise KeyboardInterrupt

    monkeypatch.setattr(context.ProcessContext, "_wait_all", interrupted_wait)
    ctx = start(workers.raise_on_rank0_others_ignore_sigterm, (600.0,), start_method=start_method)
    with pytest.raises(KeyboardInterrupt):
        while not ctx.join(grace_period=5):
            pass
    # Ctrl-C while the others stop: they are killed all the same, and the
    # failure is not lost: the next join raises it.
    assert [proc.exitcode for proc in ctx.processes] == [1, -signal.SIGKILL, -signal.SIGKILL]
    with pytest.raises(
        fastspawn.ProcessRaisedException, match="legitimate exception from process 0"
    ):
        ctx.join()
    for rank in (1, 2):
        with pytest.raises(fastspawn.ProcessExitedException, match=f"process {rank} .* SIGKILL"):
            ctx.join()
    assert ctx.join() is True


# ------------------------------------------------------- forked children


@pytest.mark.parametrize("outcome, child_status", [("raise", 1), ("return", 0)])
@pytest.mark.parametrize("rank_exit", [0, 3])
def test_forked_child_of_a_rank_cannot_report_for_it(
    start_method, outcome, child_status, rank_exit, tmp_path
):
    ctx = start(
        workers.fork_a_child_that,
        (outcome, rank_exit, str(tmp_path)),
        nprocs=1,
        start_method=start_method,
    )
    if rank_exit:
        # The rank's own exit status decides: not the child's exception.
        with pytest.raises(
            fastspawn.ProcessExitedException, match="^process 0 terminated with exit code 3$"
        ):
            while not ctx.join(timeout=120):
                pass
        assert ctx.return_values == {}  # not the child's value either
    else:
        while not ctx.join(timeout=120):
            pass
        assert ctx.return_values == {0: "the rank's value"}
    # The child ended as a plain forked Python process does.
    assert (tmp_path / "status").read_text() == str(child_status)
    stderr = (tmp_path / "stderr").read_text()
    if outcome == "raise":
        assert stderr.startswith("Traceback (most recent call last):")
        assert stderr.endswith("ValueError: raised in the rank's forked child\n")
    else:
        assert stderr == ""


def test_forked_child_of_an_elastic_rank_writes_no_error_file(start_method, tmp_path):
    logs, folder = tmp_path / "logs", tmp_path / "child"
    logs.mkdir()
    folder.mkdir()
    ctx = elastic.start_processes(
        "t",
        workers.fork_a_child_that,
        {0: (0, "raise", 0, str(folder))},
        {0: {}},
        str(logs),
        start_method=start_method,
    )
    result = ctx.wait(timeout=120)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: "the rank's value"}
    assert (folder / "status").read_text() == "1"
    assert os.listdir(logs / "0") == []  # no error.json


# ------------------------------------------------------------- timeouts


def test_join_timeout_inf_means_no_limit(start_method):
    ctx = start(workers.sleep_for, (0.5,), nprocs=2, start_method=start_method)
    for bad, error in ((NAN, ValueError), ("x", TypeError)):
        with pytest.raises(error, match="timeout"):
            ctx.join(timeout=bad)
        with pytest.raises(error, match="timeout"):
            ctx.processes[0].join(bad)
    ctx.processes[0].join(INF)
    assert ctx.processes[0].exitcode == 0
    # A finite timeout past what one wait takes (a C int of milliseconds) too.
    ctx.join(timeout=1e12)
    while not ctx.join(timeout=INF):
        pass
    assert ctx.return_values == {0: None, 1: None}


def test_elastic_wait_timeout_inf_means_no_limit(tmp_path):
    ctx = elastic.start_processes("t", workers.elastic_add, {0: (1, 2)}, {0: {}}, str(tmp_path))
    for bad, error in ((NAN, ValueError), ("x", TypeError)):
        with pytest.raises(error, match="timeout"):
            ctx.wait(timeout=bad)
        with pytest.raises(error, match="timeout"):
            ctx.close(timeout=bad)
    result = ctx.wait(timeout=INF)
    assert result is not None and result.return_values == {0: 3}
    ctx.close(timeout=INF)
