"""Drop-in fidelity, judged by torch's own test suites: what
``test/test_multiprocessing_spawn.py`` and
``test/distributed/elastic/multiprocessing/api_test.py`` (torch 2.13) check
where fastspawn used to differ, as our own tests, one section per gap.
None of them needs torch (test_torch.py runs torch's names through
``patch_torch``)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
import warnings
from datetime import datetime
from types import SimpleNamespace

import pytest
import workers
from helpers import TWELVE_CPUS_GPUS, fake_sysfs, gone, twelve_cpus

import fastspawn
from fastspawn import elastic
from fastspawn._launch.methods import registry
from fastspawn._os import numa
from fastspawn.elastic import Std

# ----------------------------------------------- 1. start_method=None
# torch hands None to multiprocessing.get_context(), which gives the
# platform's default; its ParallelForkServerShouldWorkTest never sets a
# method and relies on that (with a queue from get_context(None) too).
# fastspawn takes None as multiprocessing's default method, in spawn() as
# its own default.


@pytest.fixture
def parallel_start(monkeypatch):
    # What ParallelForkServerShouldWorkTest sets around each test.
    monkeypatch.setenv(fastspawn.ENV_VAR_PARALLEL_START, "1")


def start_none(fn, args=(), nprocs=2, **kwargs):
    return fastspawn.start_processes(fn, args, nprocs=nprocs, start_method=None, **kwargs)


def test_start_method_none_success(parallel_start):
    assert start_none(workers.succeed).return_values == {0: 0, 1: 1}


def test_start_method_none_success_non_blocking(parallel_start):
    ctx = start_none(workers.succeed, join=False)
    ctx.join(timeout=None)
    ctx.join(timeout=None)
    assert ctx.join(timeout=None) is True


def test_start_method_none_first_argument_index(parallel_start):
    queue = multiprocessing.get_context(None).SimpleQueue()
    try:
        start_none(workers.put_rank, (queue,))
        assert sorted([queue.get(), queue.get()]) == [0, 1]
    finally:
        queue.close()


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_start_method_none_exception_single(parallel_start, bad_rank):
    with pytest.raises(
        fastspawn.ProcessRaisedException,
        match=f"\nValueError: legitimate exception from process {bad_rank}\n?$",
    ):
        start_none(workers.raise_on, (bad_rank,))


def test_start_method_none_exception_all(parallel_start):
    with pytest.raises(
        fastspawn.ProcessRaisedException,
        match="\nValueError: legitimate exception from process (0|1)\n?$",
    ):
        start_none(workers.raise_after_random_sleep)


def test_start_method_none_terminate_signal(parallel_start):
    with pytest.raises(
        fastspawn.ProcessExitedException, match="process 0 terminated with signal (SIGABRT|SIGIOT)"
    ):
        start_none(workers.abort_rank0)


# Seconds of waiting by design, in fastspawn's own code and the kernel's: one
# CPython version in CI (.ci/run), for the 30-minute budget.
@pytest.mark.version_neutral
@pytest.mark.parametrize("grace_period", [None, 20])
def test_start_method_none_terminate_exit(parallel_start, caplog, grace_period):
    caplog.set_level(logging.WARNING)
    ctx = start_none(workers.exit_rank0, (123, 4.0), join=False)
    pid1 = ctx.processes[1].pid
    with pytest.raises(
        fastspawn.ProcessExitedException, match="process 0 terminated with exit code 123"
    ):
        while not ctx.join(grace_period=grace_period):
            pass
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if grace_period is None:
        # torch's line first, as torch's test reads it, then fastspawn's
        # one record of where rank 1 was.
        assert f"Terminating process {pid1} via signal" in warned[0]
        assert "where the other processes were" in warned[1]
    else:
        assert warned == []  # rank 1 ended its sleep by itself
    assert not any(p.is_alive() for p in ctx.processes)


def test_start_method_none_success_first_then_exception(parallel_start):
    with pytest.raises(fastspawn.ProcessRaisedException, match="ValueError: legitimate exception"):
        start_none(workers.return_or_raise)


# fastspawn's context names and the method each stands for; from Python 3.14
# multiprocessing.get_all_start_methods() lists them too.
CONTEXT_METHODS = {
    "fastspawn": "zygote",
    "fastspawn-spawn": "spawn",
    "fastspawn-fork": "fork",
    "fastspawn-forkserver": "forkserver",
}


@pytest.fixture(
    params=list(dict.fromkeys([*multiprocessing.get_all_start_methods(), *CONTEXT_METHODS]))
)
def multiprocessing_default(request):
    """multiprocessing's default start method set to each it offers, and
    to each of fastspawn's contexts."""
    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(request.param, force=True)
    yield request.param
    multiprocessing.set_start_method(saved, force=True)


def test_start_method_none_is_multiprocessings_default(multiprocessing_default):
    # As in torch: objects made from get_context(None) (a fork context's
    # SimpleQueue, whose semaphore only a fork of this process can use)
    # work in the workers, whatever the default is.
    assert registry.get(None).name == CONTEXT_METHODS.get(
        multiprocessing_default, multiprocessing_default
    )
    queue = multiprocessing.get_context(None).SimpleQueue()
    try:
        start_none(workers.put_rank, (queue,))
        assert sorted([queue.get(), queue.get()]) == [0, 1]
    finally:
        queue.close()


def test_start_method_none_without_a_namesake_is_fastspawns_default(monkeypatch):
    monkeypatch.setattr(registry, "multiprocessing_default", lambda: "threads")
    assert registry.get(None).name == registry.DEFAULT


@pytest.fixture
def callers_tracker():
    """The inode of the pipe to this process's resource tracker, started;
    with the zygote's ready workers off meanwhile, so that its ranks are
    forked at launch (those from ready workers: test_ready.py)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    fastspawn.start_processes(workers.succeed, nprocs=1)  # the zygote up
    fastspawn.prefork(0, refill=False)
    yield os.fstat(resource_tracker._resource_tracker._fd).st_ino
    fastspawn.prefork(0)  # the background back on


@pytest.mark.parametrize("method", ["zygote", "fork", "spawn", "forkserver"])
def test_ranks_share_the_callers_resource_tracker(callers_tracker, method):
    # As multiprocessing's children do: what a rank registers (a semaphore,
    # shared memory) is the caller's tracker's to clean up at the caller's
    # exit, not a tracker of the rank's own that unlinks it when the rank
    # ends.  Python 3.14.10 closes the pipe in a bare os.fork()'s child.
    ctx = fastspawn.start_processes(workers.tracker_pipe, nprocs=2, start_method=method)
    assert ctx.return_values == {0: callers_tracker, 1: callers_tracker}


@pytest.mark.parametrize("name", ["fastspawn", "fastspawn-fork", "fastspawn-spawn"])
def test_context_processes_share_the_callers_resource_tracker(callers_tracker, name):
    context = fastspawn.get_context(name)
    queue = context.SimpleQueue()
    process = context.Process(target=workers.tracker_pipe, args=(0, queue))
    process.start()
    try:
        assert queue.get() == callers_tracker
    finally:
        process.join()
        queue.close()
    assert process.exitcode == 0


def test_spawn_start_method_none_is_the_default_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = fastspawn.spawn(workers.pid_and_ppid, nprocs=2, start_method=None)
    zygote = fastspawn._zygote.client.zygote_pid()
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {zygote}


def test_elastic_start_method_none_is_multiprocessings_default(tmp_path):
    ctx = elastic.start_processes(
        "t", workers.elastic_add, {0: (1, 2)}, {0: {}}, str(tmp_path), start_method=None
    )
    result = ctx.wait(timeout=60)
    assert result is not None and result.return_values == {0: 3}
    assert ctx.start_method == registry.multiprocessing_default()


def test_unknown_start_method_still_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown start_method 'threads'; choose one of"):
        fastspawn.start_processes(workers.succeed, start_method="threads")


# ------------------------- 2. a function rank that exits: torch's message
# torch's test_function_exit: rank 0 calls sys.exit(138) (or os._exit) and
# writes no error file; ProcessFailure.message is torch's fixed sentence.

NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
RANK_ENVS = {0: {"RANK": "0"}, 1: {"RANK": "1"}}


def assert_in_file(lines, path):
    with open(path) as f:
        found = f.readlines()
    for line in lines:
        assert f"{line.rstrip()}\n" in found


@contextlib.contextmanager
def real_stdio():
    """sys.stdout and sys.stderr on fds 1 and 2, as in a program, while
    ranks start.  pytest's capture puts objects that write elsewhere there
    (again before each test's call, so a fixture cannot undo it); a "fork"
    rank inherits them, and its prints would miss the log files its fds 1
    and 2 go to (as under torch)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def test_function_exit_message(tmp_path, start_method):
    fail = 138
    with real_stdio():
        pc = elastic.start_processes(
            name="echo",
            entrypoint=workers.echo_rank_or_exit,
            args={0: ("hello", fail), 1: ("hello",)},
            envs=RANK_ENVS,
            logs_specs=elastic.DefaultLogsSpecs(log_dir=str(tmp_path), redirects={0: Std.ERR}),
            start_method=start_method,
        )
    results = pc.wait(timeout=60)
    assert results is not None and results.is_failed()
    assert all(gone(pid) for pid in pc.pids().values())
    assert len(results.failures) == 1
    assert not results.return_values
    failure = results.failures[0]
    assert failure.exitcode == fail
    assert failure.signal_name() == "<N/A>"
    assert failure.pid == pc.pids()[0]
    assert failure.error_file == "<N/A>"
    assert failure.message == NO_ERROR_FILE_MESSAGE
    assert failure.error_file_data["message"] == "<NONE>"
    assert failure.timestamp <= int(time.time())
    assert_in_file([f"exit {fail} from 0"], results.stderrs[0])
    assert not results.stdouts[0]
    assert not results.stderrs[1]
    assert not results.stdouts[1]


def test_function_os_exit_message(tmp_path, start_method):
    pc = elastic.start_processes(
        "t", workers.elastic_os_exit, {0: (7,)}, {0: {}}, str(tmp_path), start_method=start_method
    )
    results = pc.wait(timeout=60)
    failure = results.failures[0]
    assert (failure.exitcode, failure.error_file) == (7, "<N/A>")
    assert failure.message == NO_ERROR_FILE_MESSAGE


def test_exit_without_error_file_data_has_torchs_error_traits():
    failure = elastic.ProcessFailure(local_rank=0, pid=998, exitcode=138, error_file="none.json")
    assert failure.error_file_data == {
        "message": "<NONE>",
        "errorTraits": {"category": "system_terminated_error", "retryability": "False"},
    }
    # ... on this failure only: another one starts from torch's empty data.
    signalled = elastic.ProcessFailure(local_rank=0, pid=998, exitcode=-9, error_file="none.json")
    assert signalled.error_file_data == {"message": "<NONE>"}


def test_signal_failure_messages():
    # torch's test_multiprocessing_context_poll_raises_exception: exit code -1.
    failure = elastic.ProcessFailure(local_rank=0, pid=123, exitcode=-1, error_file="none.json")
    assert failure.message == "Signal 1 (SIGHUP) received by PID 123"
    unnamed = elastic.ProcessFailure(local_rank=0, pid=123, exitcode=-40, error_file="none.json")
    assert unnamed.signal_name() == "<N/A>"
    assert unnamed.message == "Signal 40 (<N/A>) received by PID 123"


def test_timestamp_isoformat():
    failure = elastic.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="none.json")
    failure.timestamp = 0
    assert failure.timestamp_isoformat() == datetime.fromtimestamp(0).isoformat(sep="_")


# ------------------------- 3. after a failure, wait() reports what torch does
# torch's test_binary_exit: binary rank 0 exits 138 while rank 1 sleeps; torch
# stops rank 1 (SIGTERM) and reports both.  For function ranks torch reports
# the rank that failed alone (test_function_exit: one failure).

# torch's bin/echo4.py: exit with the code given, or sleep.
ECHO4 = """
import os, sys, time
rank, code = int(os.environ["RANK"]), int(sys.argv[1])
if code:
    print(f"exit {code} from {rank}", file=sys.stderr)
    sys.exit(code)
time.sleep(1000)
"""


def test_binary_exit_reports_the_stopped_ranks_too(tmp_path):
    fail = 138
    pc = elastic.start_processes(
        name="echo",
        entrypoint=sys.executable,
        args={0: ("-c", ECHO4, fail), 1: ("-c", ECHO4, 0)},
        envs=RANK_ENVS,
        logs_specs=elastic.DefaultLogsSpecs(log_dir=str(tmp_path), redirects={0: Std.ALL}),
    )
    results = pc.wait(timeout=60)
    assert results is not None and results.is_failed()
    assert len(results.failures) == 2
    assert list(results.failures) == [0, 1]  # the first failure first
    failure = results.failures[0]
    assert failure.exitcode == fail
    assert failure.signal_name() == "<N/A>"
    assert failure.error_file_data["message"] == "<NONE>"
    assert failure.message == NO_ERROR_FILE_MESSAGE
    assert_in_file([f"exit {fail} from 0"], results.stderrs[0])
    assert_in_file([], results.stdouts[0])
    assert not results.stderrs[1]
    assert not results.stdouts[1]
    failure = results.failures[1]
    assert failure.exitcode == -signal.SIGTERM
    assert failure.signal_name() == "SIGTERM"
    assert failure.error_file_data["message"] == "<NONE>"
    assert "Signal 15 (SIGTERM) received by PID" in failure.message
    assert failure.pid == pc.pids()[1]
    assert all(gone(pid) for pid in pc.pids().values())


def test_binary_exit_leaves_ranks_that_succeeded_out(tmp_path):
    # Rank 1 exits 0 before rank 0 fails: torch reports rank 0 alone.
    script = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"
    pc = elastic.start_processes(
        "t",
        sys.executable,
        {0: ("-c", script, 1.0, 3), 1: ("-c", script, 0, 0)},
        {0: {}, 1: {}},
        str(tmp_path),
    )
    results = pc.wait(timeout=60)
    assert list(results.failures) == [0]
    assert results.failures[0].exitcode == 3


def test_function_exit_reports_the_failed_rank_alone(tmp_path, start_method):
    pc = elastic.start_processes(
        "t",
        workers.elastic_exit_or_sleep,
        {0: (138, 0), 1: (0, 60)},
        {0: {}, 1: {}},
        str(tmp_path),
        start_method=start_method,
    )
    results = pc.wait(timeout=60)
    assert results is not None and list(results.failures) == [0]
    assert results.failures[0].exitcode == 138
    assert results.failures[0].message == NO_ERROR_FILE_MESSAGE
    assert not results.return_values
    assert all(gone(pid) for pid in pc.pids().values())


# ------------------------------- 4. SpawnContext(processes, error_files)
# torch's constructor takes multiprocessing processes started by the caller
# and the files torch's wrapper pickles tracebacks to; fastspawn's gives a
# context that joins them as torch's does.


@pytest.fixture(params=["fork", "spawn"])
def mp_context(request):
    """A multiprocessing context of each start method torch's tests use.
    (Not "forkserver": its server and the temp directory it makes live as
    long as this process, not as long as a test.)"""
    return multiprocessing.get_context(request.param)


@pytest.fixture
def mp_processes():
    """Processes a test starts: stopped if need be, then closed (their
    sentinel fds released) after it."""
    processes = []
    yield processes
    for proc in processes:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        proc.close()


def torch_shaped(mp_processes, mp_context, tmp_path, fn, args=(), nprocs=2):
    """Start processes as torch's start_processes does, then build the
    context the torch way."""
    error_files = [str(tmp_path / f"pytorch-errorfile-{rank}.pickle") for rank in range(nprocs)]
    processes = [
        mp_context.Process(
            target=workers.torch_style_wrap, args=(fn, rank, args, error_files[rank])
        )
        for rank in range(nprocs)
    ]
    for proc in processes:
        proc.start()
        mp_processes.append(proc)
    with pytest.warns(UserWarning, match="SpawnContext is renamed to ProcessContext since 1.4"):
        ctx = fastspawn.SpawnContext(processes, error_files)
    return ctx


def join_all(ctx, grace_period=None):
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=5, grace_period=grace_period):
        assert time.monotonic() < deadline


def test_spawn_context_torch_shaped_success(mp_processes, mp_context, tmp_path):
    ctx = torch_shaped(mp_processes, mp_context, tmp_path, workers.succeed)
    assert isinstance(ctx, fastspawn.SpawnContext) and isinstance(ctx, fastspawn.ProcessContext)
    assert ctx.pids() == [p.pid for p in ctx.processes]
    join_all(ctx)
    assert ctx.join() is True  # again, after all exited
    assert [p.exitcode for p in ctx.processes] == [0, 0]
    assert ctx.return_values == {}


def test_spawn_context_torch_shaped_raised(mp_processes, mp_context, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    ctx = torch_shaped(mp_processes, mp_context, tmp_path, workers.raise_on, (1, 30.0))
    pid0 = ctx.processes[0].pid
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        join_all(ctx)
    message = str(info.value)
    assert message.startswith("\n\n-- Process 1 terminated with the following error:\n")
    assert message.rstrip("\n").endswith("\nValueError: legitimate exception from process 1")
    assert (info.value.error_index, info.value.error_pid) == (1, ctx.processes[1].pid)
    assert f"Terminating process {pid0} via signal SIGTERM" in caplog.text
    assert list(tmp_path.iterdir()) == []  # the error file read, then removed
    # As torch: one more join raises for rank 0 (stopped), then True.
    with pytest.raises(fastspawn.ProcessExitedException, match="process 0 terminated with signal"):
        ctx.join()
    assert ctx.join() is True
    assert not any(p.is_alive() for p in ctx.processes)


# Seconds of waiting by design, in fastspawn's own code and the kernel's: one
# CPython version in CI (.ci/run), for the 30-minute budget.
@pytest.mark.version_neutral
def test_spawn_context_torch_shaped_exit(mp_processes, mp_context, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    ctx = torch_shaped(mp_processes, mp_context, tmp_path, workers.exit_rank0, (123, 4.0))
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        join_all(ctx, grace_period=20)
    assert str(info.value) == "process 0 terminated with exit code 123"
    assert info.value.exit_code == 123
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def write_pickle(path, value):
    with open(path, "wb") as f:
        pickle.dump(value, f)


def test_spawn_context_reads_no_planted_error_file(mp_processes, tmp_path, caplog):
    # A pickle that would run code, a file of another user's, a symlink:
    # none is read, and the rank's exit code is reported.
    procs = [multiprocessing.get_context("fork").Process(target=sys.exit, args=(3,))]
    procs[0].start()
    mp_processes.extend(procs)
    target = tmp_path / "real.pickle"
    write_pickle(target, "Traceback: planted\n")
    cases = {
        "code": lambda path: write_pickle(path, workers.RunsCode()),
        "symlink": lambda path: os.symlink(target, path),
    }
    if os.geteuid() == 0:  # only root can give a file away
        cases["foreign"] = lambda path: (write_pickle(path, "x"), os.chown(path, 65534, 65534))
    for name, plant in cases.items():
        path = tmp_path / name
        plant(path)
        assert spawn_context_read(path) is None, name
    if "foreign" in cases:
        assert "not a file of this user's" in caplog.text
    with pytest.warns(UserWarning):
        ctx = fastspawn.SpawnContext(procs, [str(tmp_path / "code")])
    with pytest.raises(fastspawn.ProcessExitedException, match="exit code 3"):
        join_all(ctx)


def spawn_context_read(path):
    from fastspawn._torch.spawn_context import read_traceback

    return read_traceback(str(path))


def test_spawn_context_with_error_queues_of_older_torch(mp_processes, mp_context):
    queues = [mp_context.SimpleQueue() for _ in range(2)]
    processes = [
        mp_context.Process(
            target=workers.torch_style_wrap_queue, args=(workers.raise_on, rank, (0,), queues[rank])
        )
        for rank in range(2)
    ]
    for proc in processes:
        proc.start()
        mp_processes.append(proc)
    try:
        with pytest.warns(UserWarning):
            ctx = fastspawn.SpawnContext(processes, queues)
        with pytest.raises(
            fastspawn.ProcessRaisedException,
            match="\nValueError: legitimate exception from process 0",
        ):
            join_all(ctx)
    finally:
        for queue in queues:
            queue.close()


def test_process_context_of_torchs_shape_says_where_to_go():
    with pytest.raises(TypeError, match=r"is fastspawn.SpawnContext\(processes, error_files\)"):
        fastspawn.ProcessContext([], [])


def test_spawn_context_torch_shaped_bad_arguments():
    proc = multiprocessing.get_context("fork").Process(target=sys.exit)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="has no sentinel"):
        fastspawn.SpawnContext([proc], [None])  # not started
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="1 processes but 2 error"):
        fastspawn.SpawnContext([proc], [None, None])


# --------------------------------- 5a. duplicate_stdout/stderr_filters
# torch 2.13's test_function_duplicate_log_filters and
# test_binary_duplicate_log_filters: the lines of the tee'd ranks that
# contain any filter string, prefixed, in one file per stream.

# torch's bin/echo1.py: echo1 above, as a program.
ECHO1 = """
import os, sys
rank = int(os.environ["RANK"])
for part in sys.argv[1].split(","):
    print(f"{part} stdout from {rank}")
    print(f"{part} stderr from {rank}", file=sys.stderr)
"""


def assert_not_in_file(lines, path):
    with open(path) as f:
        found = f.readlines()
    for line in lines:
        assert f"{line.rstrip()}\n" not in found


def duplicate_log_filters(tmp_path, entrypoint, args, start_method, **kwargs):
    envs = {0: {"RANK": "0"}, 1: {"RANK": "1"}}
    logs_specs = elastic.DefaultLogsSpecs(
        log_dir=str(tmp_path),
        redirects={0: Std.ERR, 1: Std.NONE},
        tee={0: Std.OUT, 1: Std.ERR},
    )
    logs_dest = logs_specs.reify(envs)
    with real_stdio():
        pc = elastic.start_processes(
            name="trainer",
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            logs_specs=logs_specs,
            duplicate_stdout_filters=["helloA"],
            duplicate_stderr_filters=["worldA", "B"],
            start_method=start_method,
            **kwargs,
        )
    result = pc.wait(timeout=60)
    assert result is not None and not result.is_failed()
    return logs_dest


def test_function_duplicate_log_filters(tmp_path, start_method):
    logs_dest = duplicate_log_filters(
        tmp_path,
        workers.echo_rank_or_exit,
        {0: ("helloA,helloB",), 1: ("worldA,worldB",)},
        start_method,
    )
    assert_in_file(["[trainer0]:helloA stdout from 0"], logs_dest.filtered_stdout)
    assert_not_in_file(["[trainer0]:helloB stdout from 0"], logs_dest.filtered_stdout)
    assert_in_file(["[trainer1]:worldA stderr from 1"], logs_dest.filtered_stderr)
    assert_in_file(["[trainer1]:worldB stderr from 1"], logs_dest.filtered_stderr)


def test_binary_duplicate_log_filters(tmp_path):
    logs_dest = duplicate_log_filters(
        tmp_path,
        sys.executable,
        {0: ("-c", ECHO1, "helloA,helloB"), 1: ("-c", ECHO1, "worldA,worldB")},
        None,
        log_line_prefixes={0: "[rank0]:", 1: "[rank1]:"},
    )
    with open(logs_dest.filtered_stdout) as f:
        assert f.read() == "[rank0]:helloA stdout from 0\n"
    with open(logs_dest.filtered_stderr) as f:
        assert sorted(f.readlines()) == [
            "[rank1]:worldA stderr from 1\n",
            "[rank1]:worldB stderr from 1\n",
        ]


def test_duplicate_log_filters_with_log_dir_take_text_lines(tmp_path):
    # Lines end as a text file's do (\r too); the last, unfinished one
    # counts; only tee'd ranks are copied; with log_dir the files sit in it.
    script = "import sys; sys.stdout.write('load A 1%\\rload A 2%\\r\\nskip\\nlast A')"
    pc = elastic.start_processes(
        "t",
        sys.executable,
        {0: ("-c", script), 1: ("-c", script)},
        {0: {}, 1: {}},
        str(tmp_path),
        tee={0: Std.OUT},
        redirects={1: Std.OUT},
        duplicate_stdout_filters=["A"],
    )
    assert not pc.wait(timeout=60).is_failed()
    assert (
        tmp_path / "filtered_stdout.log"
    ).read_text() == "[t0]:load A 1%\n[t0]:load A 2%\n[t0]:last A\n"
    assert not (tmp_path / "filtered_stderr.log").exists()  # no stderr filters


def test_duplicate_log_filters_skip_ranks_left_off_the_console(tmp_path):
    logs_specs = elastic.DefaultLogsSpecs(str(tmp_path), tee=Std.OUT, local_ranks_filter={1})
    pc = elastic.start_processes(
        "t",
        "/bin/echo",
        {0: ("x0",), 1: ("x1",)},
        {0: {}, 1: {}},
        logs_specs,
        duplicate_stdout_filters=["x"],
    )
    assert not pc.wait(timeout=60).is_failed()
    (filtered,) = tmp_path.glob("*/attempt_0/filtered_stdout.log")
    assert filtered.read_text() == "[t1]:x1\n"


def test_duplicate_log_filters_to_devnull_and_empty(tmp_path):
    for log_dir, filters in ((os.devnull, ["x"]), (str(tmp_path), [])):
        pc = elastic.start_processes(
            "t", "/bin/echo", {0: ("x",)}, {0: {}}, log_dir, duplicate_stdout_filters=filters
        )
        assert not pc.wait(timeout=60).is_failed()
    assert [p.name for p in tmp_path.iterdir()] == ["0"]  # no filtered file


def test_duplicate_log_filters_bad_arguments(tmp_path):
    class NoFilteredFile(elastic.LogsSpecs):
        root_log_dir = str(tmp_path)

        def reify(self, envs):
            return elastic.LogsDest(stdouts={0: ""}, stderrs={0: ""})

    with pytest.raises(TypeError, match="takes a list of strings"):
        elastic.start_processes(
            "t", "/bin/true", {0: ()}, {0: {}}, str(tmp_path), duplicate_stdout_filters="x"
        )
    with pytest.raises(ValueError, match="names no filtered_stderr file"):
        elastic.start_processes(
            "t", "/bin/true", {0: ()}, {0: {}}, NoFilteredFile(), duplicate_stderr_filters=["x"]
        )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------- 5b. numa_options
# torch binds rank i to the CPUs near GPU i (torch.numa.binding); the modes
# are checked on a sysfs tree of our own (test_torch.py compares them with
# torch's own functions), the launch paths with that tree and stand-in GPUs.


def numa_options(mode="node", fall_back=False):
    # torch's NumaOptions, duck-typed: these tests need no torch.
    return SimpleNamespace(affinity_mode=mode, should_fall_back_if_binding_fails=fall_back)


def twelve_cpu_topology(tmp_path, allowed=None):
    return numa.Topology(
        root=str(twelve_cpus(tmp_path)),
        gpu_node=TWELVE_CPUS_GPUS.__getitem__,
        gpus=lambda: len(TWELVE_CPUS_GPUS),
        allowed=set(range(12)) if allowed is None else allowed,
    )


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("node", {0: range(4), 1: range(4), 2: range(4, 8), 3: range(8, 12)}),
        ("socket", {0: range(8), 1: range(8), 2: range(8), 3: range(8, 12)}),
        ("exclusive", {0: [0, 1], 1: [2, 3], 2: range(4, 8), 3: range(8, 12)}),
        ("core-complex", {0: [0, 1, 2], 1: [3], 2: range(4, 8), 3: range(8, 12)}),
    ],
)
def test_numa_options_modes_as_torch_defines_them(tmp_path, mode, expected):
    topology = twelve_cpu_topology(tmp_path)
    for gpu, cpus in expected.items():
        assert numa.cpus_for(mode, gpu, topology) == set(cpus), (mode, gpu)


def test_numa_options_bind_only_allowed_cpus(tmp_path):
    topology = twelve_cpu_topology(tmp_path, allowed=set(range(12)) - {1, 5})
    assert numa.cpus_for("node", 0, topology) == {0, 2, 3}
    assert numa.cpus_for("exclusive", 0, topology) == {0}  # core {0, 1}, less CPU 1
    assert numa.cpus_for("exclusive", 1, topology) == {2, 3}
    assert numa.cpus_for("socket", 3, topology) == set(range(8, 12))
    no_node0 = twelve_cpu_topology(tmp_path, allowed=set(range(4, 12)))
    with pytest.raises(RuntimeError, match="no allowed CPU to bind to near GPU 0"):
        numa.cpus_for("node", 0, no_node0)


def test_numa_options_exclusive_needs_a_core_per_gpu(tmp_path):
    topology = twelve_cpu_topology(tmp_path)
    topology.gpu_node = lambda gpu: 0
    topology.gpus = lambda: 3  # three GPUs on node 0's two cores
    with pytest.raises(RuntimeError, match="2 physical cores for its 3 GPUs"):
        numa.cpus_for("exclusive", 0, topology)


def test_numa_options_cpu_lists():
    assert numa.parse_cpu_list("0-2,4,6-7\n") == {0, 1, 2, 4, 6, 7}
    assert numa.format_cpu_list({7, 0, 1, 2, 4, 6}) == "0-2,4,6-7"
    assert numa.format_cpu_list({3}) == "3"


def test_numa_options_gpu_node_from_its_pci_address(tmp_path, monkeypatch):
    # torch's way: the GPU's PCI address, then sysfs; -1 (one node) is 0.
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0xDC, pci_device_id=0)
    cuda = SimpleNamespace(get_device_properties=lambda index: props)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(numa, "SYSFS", str(tmp_path))
    node_file = tmp_path / "bus/pci/devices/0000:dc:00.0/numa_node"
    node_file.parent.mkdir(parents=True)
    for text, node in (("1\n", 1), ("-1\n", 0)):
        node_file.write_text(text)
        assert numa.gpu_numa_node(0) == node


def test_numa_options_clear_error_where_they_cannot_apply(tmp_path, monkeypatch, caplog):
    # Here: no GPU torch can see (or no torch); elsewhere, no NUMA information.
    with pytest.raises(RuntimeError, match="numa_options cannot apply: .*(GPU|torch)"):
        elastic.start_processes(
            "t", "/bin/true", {0: ()}, {0: {}}, str(tmp_path), numa_options=numa_options()
        )
    monkeypatch.setattr(numa, "SYSFS", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="shows no NUMA information"):
        elastic.start_processes(
            "t",
            workers.elastic_add,
            {0: (1, 2)},
            {0: {}},
            str(tmp_path),
            numa_options=numa_options(),
        )
    with pytest.raises(ValueError, match="affinity_mode 'nearby' is not one of"):
        elastic.start_processes(
            "t", "/bin/true", {0: ()}, {0: {}}, str(tmp_path), numa_options=numa_options("nearby")
        )
    assert list(tmp_path.iterdir()) == []  # nothing made
    # Told to fall back, the ranks run unbound, with a warning.
    caplog.set_level(logging.WARNING)
    pc = elastic.start_processes(
        "t",
        workers.elastic_add,
        {0: (1, 2)},
        {0: {}},
        str(tmp_path),
        numa_options=numa_options(fall_back=True),
    )
    assert pc.wait(timeout=60).return_values == {0: 3}
    assert "NUMA binding failed" in caplog.text and "runs unbound" in caplog.text


@pytest.fixture
def numa_machine(tmp_path, monkeypatch):
    """numa looks at a two-node tree (node 0: the lowest CPU we may use,
    node 1: the highest) and two stand-in GPUs, one per node."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = {cpu: {cpu} for cpu in allowed}
    root = fake_sysfs(
        tmp_path / "sys",
        {0: {allowed[0]}, 1: {allowed[-1]}},
        dict.fromkeys(allowed, 0),
        cores,
        cores,
    )
    monkeypatch.setattr(numa, "SYSFS", str(root))
    monkeypatch.setattr(numa, "gpu_count", lambda: 2)
    monkeypatch.setattr(numa, "gpu_numa_node", lambda gpu: gpu)
    return allowed


def _two_bound_ranks(options: object) -> dict[int, list[int]]:
    """The CPUs each of two "fork" ranks may run on, bound by ``options``
    ("fork" ranks inherit the stand-ins; the other methods' ranks would ask
    the real machine, see test_numa_options_binding_that_fails_in_a_rank)."""
    pc = elastic.start_processes(
        "t",
        workers.elastic_affinity,
        {0: (), 1: ()},
        {0: {}, 1: {}},
        os.devnull,
        start_method="fork",
        numa_options=options,
    )
    return pc.wait(timeout=60).return_values


def test_numa_options_bind_function_ranks(tmp_path, numa_machine):
    bound = _two_bound_ranks(numa_options())
    assert bound == {0: [numa_machine[0]], 1: [numa_machine[-1]]}


def test_fastspawn_runs_numa_binding_binds_as_numa_options_do(tmp_path, numa_machine):
    # fastspawn run --numa-binding hands fastspawn.elastic the mode as its
    # numa_options: the same binding torch's NumaOptions gives.
    from fastspawn._cli import main as cli_main
    from fastspawn._cli import topology

    args = cli_main.build_parser().parse_args(["run", "--numa-binding", "node", "x.py"])
    config = topology.run_config(args, {})
    assert config.numa is not None and config.numa.affinity_mode == "node"
    bound = _two_bound_ranks(config.numa)
    assert bound == {0: [numa_machine[0]], 1: [numa_machine[-1]]}


@pytest.mark.parametrize("fall_back", [False, True])
def test_numa_options_binding_that_fails_in_a_rank(tmp_path, start_method, fall_back, monkeypatch):
    # The launcher is told there are GPUs; the rank, asking the real
    # machine, finds none: it fails as torch's does (its error file says
    # why), or runs unbound when told to fall back.
    monkeypatch.setattr(numa, "gpu_count", lambda: 1)
    pc = elastic.start_processes(
        "t",
        workers.elastic_add,
        {0: (1, 2)},
        {0: {}},
        str(tmp_path),
        start_method=start_method,
        numa_options=numa_options(fall_back=fall_back),
    )
    result = pc.wait(timeout=120)
    if fall_back:
        assert result.return_values == {0: 3}
    else:
        failure = result.failures[0]
        assert failure.exitcode == 1
        assert failure.error_file != "<N/A>"
        assert "Traceback" in failure.error_file_data["message"]["extraInfo"]["py_callstack"]


def test_numa_options_bind_binaries_through_numactl(tmp_path, numa_machine):
    # A numactl of our own, which records its option and runs the rest.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    numactl = bin_dir / "numactl"
    numactl.write_text('#!/bin/sh\necho "$1" > "$OUT.$RANK"\nshift\nexec "$@"\n')
    numactl.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "numactl")}
    pc = elastic.start_processes(
        "t",
        "/bin/true",
        {0: (), 1: ()},
        {0: {**env, "RANK": "0"}, 1: {**env, "RANK": "1"}},
        os.devnull,
        numa_options=numa_options(),
    )
    assert not pc.wait(timeout=60).is_failed()
    for rank, cpu in ((0, numa_machine[0]), (1, numa_machine[-1])):
        assert (tmp_path / f"numactl.{rank}").read_text() == f"--physcpubind={cpu}\n"
    # Without numactl on PATH: torch's requirement, said before anything starts.
    with pytest.raises(RuntimeError, match="numactl, not found"):
        elastic.start_processes(
            "t",
            "/bin/true",
            {0: ()},
            {0: {"PATH": "/nonexistent"}},
            os.devnull,
            numa_options=numa_options(),
        )
