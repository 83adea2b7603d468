"""Arguments, extras (envs, return values, nprocs=-1) and the Process API."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings

import pytest
import workers

import fastspawn

TESTS = os.path.dirname(os.path.abspath(__file__))


def start(fn, args=(), nprocs=1, start_method="spawn", **kwargs):
    return fastspawn.start_processes(fn, args, nprocs=nprocs, start_method=start_method, **kwargs)


@pytest.mark.parametrize("nprocs", [-2, -100])
def test_bad_nprocs_value(nprocs):
    with pytest.raises(ValueError, match=f"nprocs must be a number of processes.*got {nprocs}"):
        start(workers.succeed, nprocs=nprocs)


@pytest.mark.parametrize("join", [True, False])
def test_nprocs_zero_starts_nothing(join):
    # As torch: spawn(fn, nprocs=torch.cuda.device_count()) on a CPU machine.
    ctx = fastspawn.start_processes(workers.succeed, nprocs=0, join=join)
    assert ctx.processes == [] and ctx.pids() == []
    assert ctx.join() is True and ctx.join() is True
    assert ctx.return_values == {}


@pytest.mark.parametrize("nprocs", ["2", 2.0, None, True])
def test_bad_nprocs_type(nprocs):
    with pytest.raises(TypeError, match="nprocs must be an int"):
        start(workers.succeed, nprocs=nprocs)


def test_nprocs_takes_any_integer_type():
    class Count:  # numpy integers behave so: __index__, not an int subclass
        def __index__(self) -> int:
            return 2

    ctx = start(workers.succeed, nprocs=Count())
    assert len(ctx.processes) == 2


def test_nprocs_minus_one_means_usable_cpus():
    ctx = start(workers.succeed, nprocs=-1, start_method="fork")
    assert len(ctx.processes) == len(os.sched_getaffinity(0))


def test_fn_not_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        start(42)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_fn_not_picklable(start_method):
    with pytest.raises(pickle.PicklingError, match=r"^fn \(function .*lambda"):
        start(lambda rank: rank, start_method=start_method)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_arg_not_picklable_names_it(start_method):
    with pytest.raises(pickle.PicklingError, match=r"^args\[1\] \(generator"):
        start(workers.sleep_for, (0, (x for x in [])), start_method=start_method)


@pytest.mark.parametrize("start_method", ["zygote", "spawn", "forkserver"])
def test_arguments_are_pickled_once_per_launch(start_method):
    # The check that names what cannot be pickled is the pickling that is
    # sent: a large argument is not pickled twice (its time and memory).
    workers.CountsPickling.pickled = 0
    ctx = start(workers.is_counts_pickling, (workers.CountsPickling(),), 2, start_method)
    assert ctx.return_values == {0: True, 1: True}
    assert workers.CountsPickling.pickled == 1


def test_the_unpicklable_hint_works_when_followed():
    # It says to start the workers with start_processes and "fork": done so,
    # the same function runs.
    with pytest.raises(pickle.PicklingError) as raised:
        fastspawn.spawn(lambda rank: rank, nprocs=2)
    hint = "fastspawn.start_processes(..., start_method='fork')"
    assert hint in str(raised.value)
    ctx = fastspawn.start_processes(lambda rank: rank * 3, nprocs=2, start_method="fork")
    assert ctx.return_values == {0: 0, 1: 3}


@pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Python 3.10's multiprocessing pickles a fork context's semaphore without a word "
    "(the worker then crashes on it); 3.11 refuses it, which the hint is for",
)
@pytest.mark.parametrize("method", ["zygote", "spawn"])
def test_a_fork_context_queue_gets_the_hint_that_works(method):
    # A queue from multiprocessing's fork context cannot reach a zygote or
    # spawn worker; fastspawn.spawn() takes no "fork", so the hint must not
    # lead back to the same error: it names the spawn context, and both
    # ways it offers work when followed.
    fork_queue = multiprocessing.get_context("fork").SimpleQueue()
    try:
        with pytest.raises(pickle.PicklingError) as raised:
            fastspawn.spawn(workers.put_rank, (fork_queue,), nprocs=2, start_method=method)
        message = str(raised.value)
        assert message.startswith("args[0] (SimpleQueue")
        assert "multiprocessing.get_context('spawn')" in message and ".. " not in message
        # Followed: a queue from the spawn context.
        spawn_queue = multiprocessing.get_context("spawn").SimpleQueue()
        try:
            fastspawn.spawn(workers.put_rank, (spawn_queue,), nprocs=2, start_method=method)
            assert sorted([spawn_queue.get(), spawn_queue.get()]) == [0, 1]
        finally:
            spawn_queue.close()
        # Or the same queue, with start_processes and "fork".
        fastspawn.start_processes(workers.put_rank, (fork_queue,), nprocs=2, start_method="fork")
        assert sorted([fork_queue.get(), fork_queue.get()]) == [0, 1]
    finally:
        fork_queue.close()


def test_fork_takes_unpicklable_fn():
    captured = []
    ctx = start(lambda rank: captured.append(rank) or rank * 3, nprocs=2, start_method="fork")
    assert ctx.return_values == {0: 0, 1: 3}


@pytest.mark.parametrize("args", [5, "ab", b"ab", {"a": 1}, {1}, None])
def test_args_must_be_a_sequence_of_arguments(args):
    with pytest.raises(TypeError, match=r"args must be a tuple of fn's arguments.*args=\(x,\)"):
        start(workers.succeed, args)


@pytest.mark.parametrize("args", [[0.0], range(0, 1), iter([0.0])], ids=["list", "range", "iter"])
def test_args_any_iterable_accepted(args):
    ctx = start(workers.sleep_for, args, nprocs=2, start_method="fork")
    assert ctx.return_values == {0: None, 1: None}


def test_unknown_start_method():
    with pytest.raises(ValueError, match="unknown start_method 'threads'"):
        start(workers.succeed, start_method="threads")


@pytest.mark.parametrize(
    "envs, error, match",
    [
        ({2: {"A": "1"}}, ValueError, "envs has key 2, which is not a rank"),
        ({"0": {"A": "1"}}, ValueError, "envs has key '0'"),
        ({0: {"A": 1}}, TypeError, r"envs\[0\] must map str to str"),
        ({0: {1: "x"}}, TypeError, r"envs\[0\] must map str to str"),
        ({0: "A=1"}, TypeError, r"envs\[0\] must be a dict"),
        ({0: {"A=B": "1"}}, ValueError, "invalid variable name"),
        ([{"A": "1"}], TypeError, "envs must be a dict"),
    ],
)
def test_bad_envs(envs, error, match):
    with pytest.raises(error, match=match):
        start(workers.succeed, nprocs=2, envs=envs)


def test_unknown_option_names_it():
    with pytest.raises(ValueError, match="unknown option 'gpu_ids'"):
        start(workers.succeed, gpu_ids="0,1")


def test_paddle_option_says_what_to_do_instead():
    with pytest.raises(ValueError, match="option 'backend' is paddle.distributed.spawn's"):
        start(workers.succeed, backend="gloo")


@pytest.mark.parametrize("through", ["start_processes", "spawn"])
def test_deprecated_option_warns_at_the_callers_line(through):
    call = getattr(fastspawn, through)
    with pytest.warns(DeprecationWarning, match="'node_ip' is deprecated") as record:
        ctx = call(workers.succeed, nprocs=1, start_method="spawn", node_ip="127.0.0.1")
    assert ctx.return_values == {0: 0}
    # Attributed to this file, so the default filters (which show a
    # DeprecationWarning only in __main__'s code) treat it as the user's.
    assert record[0].filename == __file__


def test_envs_applied_per_rank(start_method):
    ctx = start(
        workers.report_env,
        (["FS_RANK_VAR", "FS_SHARED"],),
        nprocs=2,
        start_method=start_method,
        envs={0: {"FS_RANK_VAR": "zero"}, 1: {"FS_RANK_VAR": "one", "FS_SHARED": "x"}},
    )
    assert ctx.return_values == {
        0: {"FS_RANK_VAR": "zero", "FS_SHARED": None},
        1: {"FS_RANK_VAR": "one", "FS_SHARED": "x"},
    }
    assert "FS_RANK_VAR" not in os.environ


def test_caller_environment_reaches_workers(start_method, monkeypatch):
    monkeypatch.setenv("FS_CALLER_VAR", "from-caller")
    ctx = start(workers.report_env, (["FS_CALLER_VAR"],), start_method=start_method)
    assert ctx.return_values == {0: {"FS_CALLER_VAR": "from-caller"}}


def test_join_true_returns_context_with_return_values(start_method):
    ctx = start(workers.succeed, nprocs=3, start_method=start_method)
    assert isinstance(ctx, fastspawn.ProcessContext)
    assert ctx.return_values == {0: 0, 1: 1, 2: 2}


def test_large_return_value(start_method):
    size = 10 * 1024 * 1024
    ctx = start(workers.big_result, (size,), nprocs=2, start_method=start_method)
    assert ctx.return_values[0] == b"\0" * size
    assert ctx.return_values[1] == b"\1" * size


def test_large_argument(start_method):
    # Over the 64 KiB a payload is read whole up to: read as it is unpickled.
    arg = bytes(range(256)) * (40 * 1024)
    ctx = start(workers.total, (arg,), nprocs=2, start_method=start_method)
    assert ctx.return_values == {0: sum(arg), 1: sum(arg) + 1}


def test_large_return_value_join_false(start_method):
    size = 4 * 1024 * 1024
    ctx = start(workers.big_result, (size,), nprocs=2, join=False, start_method=start_method)
    for proc in ctx.processes:  # joining one Process drains the channel too
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert ctx.join() is True
    assert ctx.return_values[1] == b"\1" * size


def test_sys_exit_zero_is_success(start_method):
    ctx = start(workers.exit_zero, nprocs=2, start_method=start_method)
    assert ctx.return_values == {0: None, 1: None}


def test_keyboard_interrupt_in_child_is_not_success(start_method):
    with pytest.raises(fastspawn.ProcessExitedException) as info:
        start(workers.interrupt_self, start_method=start_method)
    assert str(info.value) == "process 0 terminated with signal SIGINT"


def test_unpicklable_return_value_is_logged(caplog):
    ctx = start(workers.return_unpicklable, nprocs=1, start_method="fork")
    assert ctx.return_values == {}
    assert "rank 0 returned a value that cannot be pickled" in caplog.text


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_child_cannot_unpickle_fn(start_method):
    # A module that exists only in the parent: fn pickles by reference, and
    # the child fails to import it.
    module = types.ModuleType("fs_parent_only_module")
    exec("def work(rank):\n    return rank\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(fastspawn.ProcessRaisedException) as info:
            start(module.work, nprocs=2, start_method=start_method)
    finally:
        del sys.modules[module.__name__]
    message = str(info.value)
    assert "Traceback" in message
    assert "ModuleNotFoundError: No module named 'fs_parent_only_module'" in message


def test_spawn_warns_on_other_start_method():
    with pytest.warns(FutureWarning) as record:
        fastspawn.spawn(workers.succeed, nprocs=1, start_method="fork")
    assert str(record[0].message) == (
        "This method only supports start_method=spawn (got: fork).\n"
        "To use a different start_method use:\n\t\t fastspawn.start_processes(...)"
    )


def test_spawn_default_is_zygote():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = fastspawn.spawn(workers.pid_and_ppid, nprocs=2)
    zygote = fastspawn._zygote.client.zygote_pid()
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {zygote}


def test_spawn_with_spawn_method_execs_per_worker():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx = fastspawn.spawn(workers.pid_and_ppid, nprocs=2, start_method="spawn")
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {os.getpid()}


def test_spawn_context_is_deprecated_alias():
    ctx = start(workers.succeed, nprocs=1, start_method="fork", join=False)
    with pytest.warns(
        UserWarning, match="SpawnContext is renamed to ProcessContext since 1.4 release."
    ):
        alias = fastspawn.SpawnContext(ctx.processes, ctx._receiver)
    assert isinstance(alias, fastspawn.ProcessContext)
    assert alias.join(timeout=30)
    alias._finish()
    ctx._finish()


def test_parallel_start_env_var_accepted(monkeypatch):
    assert fastspawn.ENV_VAR_PARALLEL_START == "TORCH_MP_PARALLEL_START"
    monkeypatch.setenv("TORCH_MP_PARALLEL_START", "1")
    ctx = start(workers.succeed, nprocs=2, start_method="forkserver")
    assert ctx.return_values == {0: 0, 1: 1}


def _one_waiting_rank(start_method):
    """A launch of one rank blocked in workers.wait_on_pipe, once it has
    said it runs: (its context, its handle, our end of the pipe)."""
    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=True)
    ctx = start(workers.wait_on_pipe, (writer,), nprocs=1, join=False, start_method=start_method)
    writer.close()
    proc = ctx.processes[0]
    assert reader.poll(60)
    assert reader.recv() == ("ready", 0, proc.pid)
    return ctx, proc, reader


def test_process_api(start_method):
    ctx, proc, reader = _one_waiting_rank(start_method)
    assert proc.is_alive() and proc.exitcode is None
    assert isinstance(proc.sentinel, int)
    assert f"pid={proc.pid}" in repr(proc)
    proc.join(timeout=0.05)
    assert proc.is_alive()
    proc.kill()
    proc.join(timeout=30)
    assert not proc.is_alive()
    assert proc.exitcode == -9
    proc.terminate()  # after exit: a no-op, never a signal to a recycled pid
    with pytest.raises(fastspawn.ProcessExitedException, match="signal SIGKILL"):
        ctx.join()
    reader.close()


def test_process_interrupt_sends_sigint(start_method):
    """ProcessHandle.interrupt(): SIGINT through the pidfd, a Ctrl-C's
    signal: the rank is reported as terminated by it (docs/differences.md)."""
    ctx, proc, reader = _one_waiting_rank(start_method)
    proc.interrupt()
    proc.join(timeout=30)
    assert not proc.is_alive()
    assert proc.exitcode == -signal.SIGINT
    with pytest.raises(fastspawn.ProcessExitedException, match="signal SIGINT"):
        ctx.join()
    reader.close()


def test_daemon_flag_reaches_worker(start_method):
    ctx = start(workers.succeed, nprocs=1, daemon=True, start_method=start_method)
    assert ctx.return_values == {0: 0}


def test_failure_after_processes_reaped_individually_does_not_stall(start_method):
    ctx = start(workers.sleep_forever, nprocs=3, join=False, start_method=start_method)
    for proc in ctx.processes:
        proc.kill()
    for proc in ctx.processes:
        proc.join(timeout=30)
    began = time.monotonic()
    with pytest.raises(fastspawn.ProcessExitedException, match="SIGKILL"):
        while not ctx.join(timeout=0):
            pass
    # The failure path must not wait for workers that are already reaped.
    assert time.monotonic() - began < 10


def test_program_read_from_stdin_can_launch(start_method):
    # `python -` has no main script file; multiprocessing's own spawn child
    # dies trying to import "<stdin>" as __mp_main__.
    if start_method in ("fork",):
        pytest.skip("fork does not re-import __main__")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import fastspawn, workers
        if __name__ == "__main__":
            ctx = fastspawn.start_processes(
                workers.succeed, nprocs=2, start_method={start_method!r}
            )
            print(sorted(ctx.return_values.items()))
            fastspawn.stop_zygote()
        """
    )
    out = subprocess.run(
        [sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(0, 0), (1, 1)]"


def test_parent_process_is_the_caller(start_method):
    # As in multiprocessing's children: code tells a worker by it.
    ctx = start(workers.parent_info, nprocs=2, start_method=start_method)
    assert ctx.return_values == {0: (os.getpid(), True), 1: (os.getpid(), True)}


def test_a_spawned_worker_reaches_fn_without_the_c_extension():
    # Nothing before fn needs it (the caller's pidfd comes from
    # os.pidfd_open): cffi's backend and oscall were a spawned worker's
    # largest imports (benchmarks/README.md).
    names = ["_cffi_backend", "fastspawn._os.oscall", "fastspawn._os._core"]
    ctx = start(workers.modules_loaded, (names,), nprocs=1, start_method="spawn")
    assert ctx.return_values == {0: [False, False, False]}
