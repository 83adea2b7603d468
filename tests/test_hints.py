"""Every hint in fastspawn's errors, followed.

Each test triggers an error or warning that tells the user what to do, does
what it says, and checks that the launch (or the command) then works.  A hint
that loops (its advice leads back to the same error), names an API or an
option that does not exist, or gives a value that does not fit fails here.

Hints followed elsewhere: the fork-context queue (test_api.py,
test_a_fork_context_queue_gets_the_hint_that_works) and ``fastspawn stacks``
of a process without ranks (test_stacks.py: ..._without_ranks, then
..._of_a_program_that_started_ranks and ..._on_a_running_job).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import workers
from helpers import run_script
from test_limits import NOGROUP, private_dir, unprivileged  # noqa: F401  (fixtures)

import fastspawn
from fastspawn import elastic
from fastspawn._os import limits as _limits
from fastspawn._zygote import client
from fastspawn.elastic import Std

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

TESTS = os.path.dirname(os.path.abspath(__file__))
# A Python that finds fastspawn and the tests' worker module.
PYTHONPATH = os.pathsep.join([TESTS, *sys.path])
# torch made unimportable, as where it is not installed (as test_torchrun does).
WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; from fastspawn._cli.main import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def python(code: str, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """``python -c code args``, finding fastspawn and the tests' workers."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, **kwargs.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        **kwargs,
    )


def fastspawn_run(
    *args: str, code: str | None = None, **kwargs
) -> subprocess.CompletedProcess[str]:
    """``fastspawn run args``; ``code``: in place of ``python -m fastspawn``."""
    command = ["-m", "fastspawn"] if code is None else ["-c", code]
    return subprocess.run(
        [sys.executable, *command, "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd left out


def number_after(text: str, words: str) -> int:
    """The number that follows ``words`` in ``text``."""
    found = re.search(re.escape(words) + r" (\d+)", text)
    assert found is not None, f"no {words!r} N in: {text}"
    return int(found.group(1))


def empty_envs(nprocs: int) -> dict[int, dict[str, str]]:
    return {rank: {} for rank in range(nprocs)}


def elastic_run(
    entrypoint, nprocs: int = 1, log_dir=os.devnull, **kwargs
) -> elastic.RunProcsResult:
    """start_processes, then wait: the result of a run that must succeed."""
    args = kwargs.pop("args", {rank: () for rank in range(nprocs)})
    ctx = elastic.start_processes("hint", entrypoint, args, empty_envs(nprocs), log_dir, **kwargs)
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed(), result
    return result


# ------------------------------------------------------- start_processes, spawn


@pytest.mark.parametrize("way", ["as_told", "fork"])
@pytest.mark.parametrize("culprit", ["fn", "arg"])
def test_unpicklable_hint(culprit, way):
    # "Define functions at module top level and pass picklable arguments, or
    # start them with fastspawn.start_processes(..., start_method='fork')".
    fn, args = {
        "fn": (lambda rank: rank, ()),
        "arg": (workers.total, ((n for n in [1, 2]),)),
    }[culprit]
    with pytest.raises(pickle.PicklingError) as raised:
        fastspawn.spawn(fn, args, nprocs=2)
    message = str(raised.value)
    assert "Define functions at module top level and pass picklable arguments" in message
    assert "fastspawn.start_processes(..., start_method='fork')" in message
    if way == "as_told":
        fn, args = {"fn": (workers.succeed, ()), "arg": (workers.total, ([1, 2],))}[culprit]
        ctx = fastspawn.spawn(fn, args, nprocs=2)
    else:
        ctx = fastspawn.start_processes(fn, args, nprocs=2, start_method="fork")
    assert ctx.return_values == ({0: 0, 1: 1} if culprit == "fn" else {0: 3, 1: 4})


BY_VALUE = """\
import os, sys, threading
import fastspawn
sys.path.insert(0, sys.argv[1])
guard = threading.Semaphore(2)
def guarded(rank):
    with guard:
        return rank
def report(way, fn, args=(), method="zygote"):
    try:
        ctx = fastspawn.start_processes(fn, args, nprocs=2, start_method=method)
    except Exception as exc:
        print(way, type(exc).__name__, exc)
    else:
        print(way, [value for _rank, value in sorted(ctx.return_values.items())])
report("as_is", guarded)
def guarded_inside(rank):
    guard = threading.Semaphore(2)
    with guard:
        return rank
report("inside", guarded_inside)
from guarded_module import guarded as guarded_in_module
report("module", guarded_in_module)
def guarded_made_from(rank, n):
    with threading.Semaphore(n):
        return rank
report("args", guarded_made_from, (2,))
report("fork", guarded, method="fork")
if sys.version_info >= (3, 11):  # 3.10 pickles a fork context's lock without a word
    import multiprocessing
    queue = multiprocessing.get_context("fork").SimpleQueue()  # the default before 3.14
    def put_rank(rank):
        queue.put(rank)
    report("fork_context", put_rank)
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    report("spawn_context", put_rank)
    print("received", sorted([queue.get(), queue.get()]))
"""


def test_unpicklable_global_of_a_main_without_file_hint(tmp_path):
    # python -c: what __main__ defines travels by value, with the globals it
    # uses.  Each way the message offers works.  (The object moved to an
    # importable module and imported into __main__ by name still travels by
    # value: the hint says to define the function there.)
    (tmp_path / "guarded_module.py").write_text(
        "import threading\n"
        "guard = threading.Semaphore(2)\n"
        "def guarded(rank):\n"
        "    with guard:\n"
        "        return rank\n"
    )
    done = python(BY_VALUE, str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    error = lines.pop("as_is")
    assert error.startswith("PicklingError fn (function "), error
    assert "it refers to global 'guard' of guarded(), a Semaphore" in error
    for way in (
        "create such an object inside the function",
        "define the function in an importable module",
        "pass what the object is made from in args",
        "fastspawn.start_processes(..., start_method='fork')",
    ):
        assert way in error, error
    for way in ("inside", "module", "args", "fork"):
        assert lines.pop(way) == "[0, 1]", done.stdout
    if sys.version_info >= (3, 11):
        error = lines.pop("fork_context")
        assert "it refers to global 'queue' of put_rank(), a SimpleQueue" in error, error
        assert "from multiprocessing.get_context('spawn')" in error, error
        assert lines.pop("spawn_context") == "[None, None]", done.stdout
        assert lines.pop("received") == "[0, 1]", done.stdout
    assert lines == {}, done.stdout


def test_spawn_with_another_start_method_hint():
    # spawn() warns and uses the zygote; the warning names start_processes,
    # which starts the method asked for (fork: the workers are our children).
    with pytest.warns(FutureWarning) as record:
        ctx = fastspawn.spawn(workers.pid_and_ppid, nprocs=2, start_method="fork")
    assert "To use a different start_method use:" in str(record[0].message)
    assert "fastspawn.start_processes(...)" in str(record[0].message)
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {client.zygote_pid()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=2, start_method="fork")
    # No warning of ours; Python's own for a fork of a process with threads
    # (this one has the zygote's watch thread) may come, as it comes for
    # multiprocessing's fork: from 3.15 it does, for any thread.
    ours = [w for w in caught if "is multi-threaded, use of fork()" not in str(w.message)]
    assert ours == []
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {os.getpid()}


def test_unknown_start_method_hint():
    with pytest.raises(ValueError) as raised:
        fastspawn.start_processes(workers.succeed, nprocs=1, start_method="threads")
    named = re.findall(r"'(\w+)'", str(raised.value).split("choose one of", 1)[1])
    assert {"zygote", "spawn", "fork", "forkserver"} <= set(named), raised.value
    for name in named:
        ctx = fastspawn.start_processes(workers.succeed, nprocs=2, start_method=name)
        assert ctx.return_values == {0: 0, 1: 1}, name


def test_paddle_option_hint():
    with pytest.raises(ValueError) as raised:
        fastspawn.spawn(workers.report_env, (["CUDA_VISIBLE_DEVICES"],), nprocs=2, gpus="0,1")
    assert "per-rank envs= can carry CUDA_VISIBLE_DEVICES" in str(raised.value)
    envs = {rank: {"CUDA_VISIBLE_DEVICES": str(rank)} for rank in range(2)}
    ctx = fastspawn.spawn(workers.report_env, (["CUDA_VISIBLE_DEVICES"],), nprocs=2, envs=envs)
    assert ctx.return_values == envs


def test_unknown_option_hint():
    # It lists the keyword options there are: each is taken, the deprecated
    # ones with a warning.
    with pytest.raises(ValueError) as raised:
        fastspawn.start_processes(workers.succeed, nprocs=1, gpu_ids=[0])
    listed = str(raised.value).split("known keyword options are ", 1)[1]
    known, deprecated = listed.split(", and (deprecated, ignored) ")
    assert known == "envs, preload", listed
    ctx = fastspawn.start_processes(workers.succeed, nprocs=1, envs={0: {}}, preload=["json"])
    assert ctx.return_values == {0: 0}
    for name in deprecated.split(", "):
        with pytest.warns(DeprecationWarning, match=f"option {name!r} is deprecated"):
            ctx = fastspawn.start_processes(workers.succeed, nprocs=1, **{name: None})
        assert ctx.return_values == {0: 0}, name


def test_args_not_a_tuple_hint():
    with pytest.raises(TypeError, match=r"for one argument write args=\(x,\)"):
        fastspawn.spawn(workers.sleep_for, 0, nprocs=2)
    assert fastspawn.spawn(workers.sleep_for, (0,), nprocs=2).return_values == {0: None, 1: None}


def test_nan_timeout_hint():
    ctx = fastspawn.start_processes(workers.succeed, nprocs=1, join=False)
    with pytest.raises(ValueError, match=r"\(inf for no limit\)"):
        ctx.join(timeout=math.nan)
    assert ctx.join(timeout=math.inf)
    assert ctx.return_values == {0: 0}


@pytest.mark.parametrize("way", ["sig_dfl", "zygote"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ignored_sigchld_hint(method, way):
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        with pytest.raises(RuntimeError) as raised:
            fastspawn.start_processes(workers.succeed, nprocs=2, start_method=method)
        message = str(raised.value)
        assert "restore the default first (signal.signal(signal.SIGCHLD, signal.SIG_DFL))" in (
            message
        )
        assert "or use start_method='zygote'" in message
        if way == "sig_dfl":
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        else:
            method = "zygote"
        ctx = fastspawn.start_processes(workers.succeed, nprocs=2, start_method=method)
        assert ctx.return_values == {0: 0, 1: 1}
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.mark.parametrize("method", ["zygote", "spawn"])
def test_deleted_cwd_hint(method, tmp_path):
    here = os.getcwd()
    doomed = tmp_path / "doomed"
    doomed.mkdir()
    os.chdir(doomed)
    try:
        doomed.rmdir()
        with pytest.raises(FileNotFoundError, match=r"so os.chdir\(\) to one that exists"):
            fastspawn.start_processes(workers.cwd, nprocs=1, start_method=method)
        os.chdir(tmp_path)
        ctx = fastspawn.start_processes(workers.cwd, nprocs=1, start_method=method)
        assert ctx.return_values == {0: str(tmp_path)}
    finally:
        os.chdir(here)


ENDS_AT_IMPORT = """\
import os
import fastspawn

def work(rank):
    return rank

def leave_unless_main():
    if __name__ != "__main__":
        os._exit(3)

{outside}
if __name__ == "__main__":
    {inside}
    try:
        print(fastspawn.start_processes(work, nprocs=2).return_values)
    except RuntimeError as exc:
        print(exc)
"""


def test_zygote_died_hint(tmp_path):
    # Code outside the guard that ends the process ends the zygote, which
    # imports __main__ as a spawned worker does; moved under the guard, the
    # same program runs.
    done = run_script(
        tmp_path / "outside.py",
        ENDS_AT_IMPORT.format(outside="leave_unless_main()", inside="pass"),
        cwd=tmp_path,
    )
    assert "the zygote died during the launch" in done.stdout, done.stdout + done.stderr
    assert "exited with status 3" in done.stdout
    assert "move it under that guard" in done.stdout
    done = run_script(
        tmp_path / "inside.py",
        ENDS_AT_IMPORT.format(outside="", inside="leave_unless_main()"),
        cwd=tmp_path,
    )
    assert done.stdout == "{0: 0, 1: 1}\n", done.stdout + done.stderr


def test_warden_cannot_start_hint():
    # A fresh process: the warden starts with its first fork launch.
    done = python(
        """
        import sys
        import fastspawn, workers
        python = sys.executable
        sys.executable = "/nonexistent/python"
        try:
            fastspawn.start_processes(workers.succeed, nprocs=2, start_method="fork")
        except OSError as exc:
            print(exc)
        sys.executable = python
        ctx = fastspawn.start_processes(workers.succeed, nprocs=2, start_method="fork")
        print(ctx.return_values)
        """
    )
    error, result = done.stdout.splitlines()
    assert "could not start the warden" in error, done.stdout + done.stderr
    assert "point sys.executable at a Python interpreter" in error
    assert result == "{0: 0, 1: 1}", done.stderr


@pytest.fixture
def mp_processes():
    """multiprocessing processes a test starts: joined and closed after it."""
    processes: list[multiprocessing.process.BaseProcess] = []
    yield processes
    for proc in processes:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        proc.close()


def started(mp_processes, nprocs: int) -> list[multiprocessing.process.BaseProcess]:
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=sys.exit, args=(0,)) for _ in range(nprocs)]
    mp_processes.extend(procs)
    for proc in procs:
        proc.start()
    return procs


def join_all(ctx) -> None:
    for _ in range(12):
        if ctx.join(timeout=5):
            return
    raise AssertionError("the processes did not end")


def test_process_context_of_torchs_shape_hint(mp_processes):
    # ProcessContext(processes, error_files) names SpawnContext; that works,
    # and its warning (torch's) does not send the caller back.
    procs = started(mp_processes, 2)
    with pytest.raises(TypeError) as raised:
        fastspawn.ProcessContext(procs, [None, None])
    assert "is fastspawn.SpawnContext(processes, error_files)" in str(raised.value)
    with pytest.warns(UserWarning) as record:
        ctx = fastspawn.SpawnContext(procs, [None, None])
    warning = str(record[0].message)
    assert warning.startswith("SpawnContext is renamed to ProcessContext since 1.4 release.")
    assert "keep SpawnContext(processes, error_files)" in warning
    join_all(ctx)
    assert [proc.exitcode for proc in procs] == [0, 0]


@pytest.mark.parametrize("problem", ["count", "not_started"])
def test_spawn_context_arguments_hint(mp_processes, problem):
    fork = multiprocessing.get_context("fork")
    if problem == "count":
        procs, files = started(mp_processes, 1), [None, None]
        hint, fixed = "give one path (or None) per process", (procs, [None])
    else:
        procs = [fork.Process(target=sys.exit, args=(0,))]
        mp_processes.extend(procs)
        files = [None]
        hint, fixed = "give started multiprocessing.Process objects", (procs, files)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=re.escape(hint)):
        fastspawn.SpawnContext(procs, files)
    if problem == "not_started":
        procs[0].start()
    with pytest.warns(UserWarning):
        ctx = fastspawn.SpawnContext(*fixed)
    join_all(ctx)


# ------------------------------------------------------------------- limits


@pytest.fixture
def nofile_limit():
    """Sets this process's soft RLIMIT_NOFILE; the limit as it was, and
    every zygote started meanwhile stopped, after the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def set_limit(value: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))

    fastspawn.stop_zygote()  # the next one starts under the limit the test sets
    try:
        yield set_limit
    finally:
        set_limit(soft)
        fastspawn.stop_zygote()


@pytest.mark.parametrize("way", ["fewer", "raise"])
@pytest.mark.parametrize("method", ["zygote", "fork"])
def test_too_many_ranks_for_open_files_hint(method, way, nofile_limit, monkeypatch):
    # Refused up front: "start fewer ranks (at most N here), or raise the
    # limit with ulimit -n M".  Raised as a program does (setrlimit, what
    # ulimit -n does) after its zygote started under the lower limit: the
    # zygote takes the caller's raised limit for the launch.
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)  # not under test
    low = open_fds() + 2 * _limits.LAUNCH_FDS
    nprocs = low + 10
    nofile_limit(low)
    fastspawn.start_processes(workers.succeed, nprocs=1, start_method=method)
    with pytest.raises(ValueError) as raised:
        fastspawn.start_processes(workers.succeed, nprocs=nprocs, start_method=method)
    message = str(raised.value)
    assert f"RLIMIT_NOFILE (ulimit -n) is {low}: start fewer ranks (at most " in message
    if way == "fewer":
        nprocs = number_after(message, "at most")
        assert nprocs > 0
    else:
        nofile_limit(number_after(message, "raise the limit with ulimit -n"))
    ctx = fastspawn.start_processes(workers.succeed, nprocs=nprocs, start_method=method)
    assert ctx.return_values == {rank: rank for rank in range(nprocs)}


def test_too_many_teed_ranks_for_open_files_hint(tmp_path, nofile_limit, monkeypatch):
    # fastspawn.elastic counts each rank's pipes and log files too: the limit
    # it names lets them all open.
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    nprocs = 20
    nofile_limit(open_fds() + nprocs + 4)
    logs = tmp_path / "logs"
    logs.mkdir()
    tee = {"redirects": Std.ALL, "tee": Std.ALL, "log_line_prefixes": {}}
    with pytest.raises(ValueError) as raised:
        elastic_run("/bin/true", nprocs, str(logs), **tee)
    assert "per rank), but RLIMIT_NOFILE (ulimit -n) is" in str(raised.value)
    assert list(logs.iterdir()) == []
    nofile_limit(number_after(str(raised.value), "raise the limit with ulimit -n"))
    elastic_run("/bin/true", nprocs, str(logs), **tee)


@pytest.mark.parametrize("way", ["fewer", "raise"])
@pytest.mark.parametrize("method", ["zygote", "fork"])
def test_out_of_open_files_hint(method, way, nofile_limit):
    # Past the check up front (one fd per rank fits) but not beside the fds
    # held: EMFILE, "raise the limit on open files (ulimit -n) or start fewer
    # processes".
    fastspawn.start_processes(workers.succeed, nprocs=1, start_method=method)  # the helpers
    nprocs = 20
    low = open_fds() + nprocs
    nofile_limit(low)
    with pytest.raises(OSError) as raised:
        fastspawn.start_processes(workers.succeed, nprocs=nprocs, start_method=method)
    assert "raise the limit on open files (ulimit -n) or start fewer processes" in str(raised.value)
    if way == "fewer":
        nprocs //= 2
    else:
        nofile_limit(low + 32)
    ctx = fastspawn.start_processes(workers.succeed, nprocs=nprocs, start_method=method)
    assert ctx.return_values == {rank: rank for rank in range(nprocs)}


def test_more_ranks_than_the_machine_has_pids_hint(tmp_path, monkeypatch):
    # 400: a value a kernel allows (pid_max_min is 301), beside which a
    # launch of fewer ranks reads no file (limits._PID_MAX_LEAST).
    pid_max = tmp_path / "pid_max"
    pid_max.write_text("400\n")
    monkeypatch.setattr(_limits, "_PID_MAX", str(pid_max))
    monkeypatch.setattr(_limits, "nproc_enforced", lambda: False)
    with pytest.raises(ValueError, match=r"kernel.pid_max, .* is 400: start fewer ranks$"):
        fastspawn.start_processes(workers.succeed, nprocs=450)
    assert fastspawn.start_processes(workers.succeed, nprocs=2).return_values == {0: 0, 1: 1}


NPROC_DRIVER = """
    import os, resource, sys, time
    import fastspawn
    from fastspawn._os import limits


    def succeed(rank):
        return rank


    def sleep_forever(rank):
        time.sleep(600)


    def attempt(label, nprocs, fn=succeed):
        try:
            ctx = fastspawn.start_processes(
                fn, nprocs=nprocs, start_method=method, join=fn is succeed
            )
        except Exception as exc:
            print(f"{label}:", type(exc).__name__, exc)
            return
        print(f"{label}: started {len(ctx.processes)}")
        for process in ctx.processes:
            process.kill()
        try:
            ctx.join(timeout=30)
        except fastspawn.ProcessExitedException:
            pass


    def settle(tasks):
        # The ranks of a failed launch are killed; wait until they are reaped.
        deadline = time.monotonic() + 30
        while limits.tasks_of(os.getuid()) > tasks and time.monotonic() < deadline:
            time.sleep(0.05)


    if __name__ == "__main__":
        method, limit = sys.argv[1], int(sys.argv[2])
        own = resource.getrlimit(resource.RLIMIT_NPROC)
        attempt("helpers", 1)  # the zygote or the warden, under the limit as it was
        tasks = limits.tasks_of(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, own[1]))
        attempt("refused", 2 * limit)
        attempt("eagain", limit - 1, sleep_forever)
        settle(tasks)
        time.sleep(0.5)  # time for the zygote to make workers ready, if it would
        attempt("fewer", limit // 2)
        resource.setrlimit(resource.RLIMIT_NPROC, own)  # raised, as ulimit -u does
        attempt("raised", limit - 1, sleep_forever)
        attempt("raised_past_refused", 2 * limit)
        fastspawn.stop_zygote()
"""


@pytest.mark.parametrize("method", ["zygote", "fork"])
def test_rlimit_nproc_hint(method, unprivileged, private_dir):  # noqa: F811  (fixtures)
    # Run as a user the kernel holds to RLIMIT_NPROC (see test_limits.py).
    # Both errors, the refusal up front and EAGAIN from a fork beside the
    # user's other processes, say "start fewer ..., or raise the limit with
    # ulimit -u"; each way works.
    uid, python_path, path = unprivileged
    limit = 40
    done = run_script(
        private_dir / "driver.py",
        NPROC_DRIVER,
        [python_path, str(private_dir / "driver.py"), method, str(limit)],
        user=uid,
        group=NOGROUP,
        extra_groups=[],
        cwd=private_dir,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": path,
            "TMPDIR": str(private_dir),
            "HOME": str(private_dir),
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["refused"].startswith("LimitError "), done.stdout
    assert "start fewer ranks, or raise the limit with ulimit -u" in lines["refused"]
    assert lines["eagain"].startswith("BlockingIOError "), done.stdout
    assert "start fewer processes, or raise the limit with ulimit -u" in lines["eagain"]
    assert lines["fewer"] == f"started {limit // 2}", done.stdout
    assert lines["raised"] == f"started {limit - 1}", done.stdout
    assert lines["raised_past_refused"] == f"started {2 * limit}", done.stdout


# ------------------------------------------------------------------ elastic


def test_std_spec_hint():
    # "give one of 0 (none), 1 (stdout), 2 (stderr), 3 (both), or rank:value
    # pairs such as '0:1,1:2'": each parses, and the pairs run.
    with pytest.raises(ValueError) as raised:
        Std.from_str("both")
    message = str(raised.value)
    for text in re.findall(r"(\d) \(", message) + re.findall(r"such as '([\d:,]+)'", message):
        Std.from_str(text)
    assert "'0:1,1:2'" in message
    elastic_run(workers.elastic_add, 2, tee=Std.from_str("0:1,1:2"), args={0: (1, 2), 1: (3, 4)})


def test_std_as_string_hint():
    with pytest.raises(TypeError, match="use Std.from_str for strings"):
        elastic_run(workers.elastic_add, 1, redirects="3", args={0: (1, 2)})
    result = elastic_run(workers.elastic_add, 1, redirects=Std.from_str("3"), args={0: (1, 2)})
    assert result.return_values == {0: 3}


@pytest.mark.parametrize("kept", ["log_dir", "logs_specs"])
def test_log_dir_and_logs_specs_hint(tmp_path, kept):
    specs = elastic.DefaultLogsSpecs(str(tmp_path / "specs"))
    run = ("hint", workers.elastic_add, {0: (1, 2)}, empty_envs(1))
    with pytest.raises(TypeError, match="give exactly one"):
        elastic.start_processes(*run, str(tmp_path / "dir"), logs_specs=specs)
    (tmp_path / "dir").mkdir()
    where = {"log_dir": str(tmp_path / "dir")} if kept == "log_dir" else {"logs_specs": specs}
    assert elastic.start_processes(*run, **where).wait(timeout=60).return_values == {0: 3}


def test_redirects_beside_logs_specs_hint(tmp_path):
    run = ("hint", workers.elastic_add, {0: (1, 2)}, empty_envs(1))
    specs = elastic.DefaultLogsSpecs(str(tmp_path))
    with pytest.raises(TypeError) as raised:
        elastic.start_processes(*run, logs_specs=specs, redirects=Std.ALL)
    assert "give them to the LogsSpecs (DefaultLogsSpecs(log_dir, redirects=..., tee=...))" in (
        str(raised.value)
    )
    specs = elastic.DefaultLogsSpecs(str(tmp_path), redirects=Std.ALL)
    ctx = elastic.start_processes(*run, logs_specs=specs)
    result = ctx.wait(timeout=60)
    assert result.return_values == {0: 3}
    assert Path(result.stdouts[0]).read_text() == "out 1 2\n"


def test_log_dir_not_empty_hint(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.log").write_text("")
    with pytest.raises(RuntimeError, match="please provide an empty log_dir"):
        elastic_run(workers.elastic_add, 1, str(tmp_path / "full"), args={0: (1, 2)})
    (tmp_path / "empty").mkdir()
    elastic_run(workers.elastic_add, 1, str(tmp_path / "empty"), args={0: (1, 2)})


class _NamedFiles(elastic.LogsSpecs):
    """Each rank's stdout to the file ``names[rank]`` in ``directory``, and
    tee'd from ``tee[rank]`` where given."""

    def __init__(self, directory: Path, names: list[str], tee: list[str] | None = None):
        super().__init__(str(directory))
        self.names = names
        self.tee = tee

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs):
        out = {rank: os.path.join(self.root_log_dir, self.names[rank]) for rank in envs}
        tee = {rank: self.tee[rank] for rank in envs} if self.tee else {}
        return elastic.LogsDest(stdouts=out, tee_stdouts=tee)


def named_run(specs: elastic.LogsSpecs, nprocs: int = 1) -> elastic.RunProcsResult:
    args = {rank: (rank, 1) for rank in range(nprocs)}
    ctx = elastic.start_processes("hint", workers.elastic_add, args, empty_envs(nprocs), specs)
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed(), result
    return result


@pytest.mark.parametrize("way", ["remove", "elsewhere"])
def test_log_file_symlink_hint(tmp_path, way):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "out0").symlink_to(victim)
    with pytest.raises(FileExistsError, match=r"remove it, or log elsewhere"):
        named_run(_NamedFiles(tmp_path, ["out0"]))
    if way == "remove":
        (tmp_path / "out0").unlink()
        named_run(_NamedFiles(tmp_path, ["out0"]))
    else:
        (tmp_path / "elsewhere").mkdir()
        named_run(_NamedFiles(tmp_path / "elsewhere", ["out0"]))
    assert victim.read_text() == "keep"


def test_log_file_exists_hint(tmp_path):
    with pytest.raises(FileExistsError, match="give each rank and each attempt a path of its own"):
        named_run(_NamedFiles(tmp_path, ["out", "out"]), nprocs=2)
    named_run(_NamedFiles(tmp_path, ["out0", "out1"]), nprocs=2)
    named_run(_NamedFiles(tmp_path, ["attempt1-out0", "attempt1-out1"]), nprocs=2)


def test_tee_from_another_file_hint(tmp_path):
    with pytest.raises(ValueError, match="tee_stdouts must name the same file as stdouts"):
        named_run(_NamedFiles(tmp_path, ["out0"], tee=[str(tmp_path / "other")]))
    named_run(_NamedFiles(tmp_path, ["out0"], tee=[str(tmp_path / "out0")]))


@pytest.mark.parametrize("way", ["path", "name"])
def test_binary_path_not_found_hint(way):
    with pytest.raises(
        FileNotFoundError, match=r"check the path, or give a name to look up on PATH"
    ):
        elastic_run("/no/such/dir/true")
    elastic_run("/bin/true" if way == "path" else "true")


@pytest.mark.parametrize("way", ["full_path", "add_to_path"])
def test_binary_not_on_path_hint(tmp_path, way, monkeypatch):
    tool = tmp_path / "fastspawn-hint-tool"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    with pytest.raises(
        FileNotFoundError, match=r"give its full path, or add its directory to PATH"
    ):
        elastic_run(tool.name)
    if way == "full_path":
        elastic_run(str(tool))
    else:
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        elastic_run(tool.name)


@pytest.mark.parametrize("way", ["chmod", "binary"])
def test_binary_not_executable_hint(tmp_path, way):
    tool = tmp_path / "tool.sh"
    tool.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(PermissionError, match=r"chmod \+x it, or give the path of a binary"):
        elastic_run(str(tool))
    if way == "chmod":
        tool.chmod(0o755)
        elastic_run(str(tool))
    else:
        elastic_run("/bin/sh", args={0: (str(tool),)})


RECORDED = """\
import sys
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise ValueError("recorded: " + sys.argv[1])

if __name__ == "__main__":
    main()
"""


def test_no_error_file_hint(tmp_path):
    # A rank that writes no error file: torch's message points at its docs
    # (https://pytorch.org/docs/stable/elastic/errors.html), which say to
    # decorate the entrypoint with @record.  Done, its error comes through.
    pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    script = tmp_path / "main.py"
    script.write_text("import sys\nraise ValueError('unrecorded')\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    ctx = elastic.start_processes(
        "hint", sys.executable, {0: (str(script),)}, empty_envs(1), str(logs)
    )
    result = ctx.wait(timeout=60)
    assert result.failures[0].message.startswith("To enable traceback see: https://pytorch.org")
    script.write_text(RECORDED)
    logs = tmp_path / "logs2"
    logs.mkdir()
    ctx = elastic.start_processes(
        "hint", sys.executable, {0: (str(script), "it works")}, empty_envs(1), str(logs)
    )
    result = ctx.wait(timeout=120)
    assert "recorded: it works" in result.failures[0].message, result.failures[0]


# ---------------------------------------------------------------- fastspawn run


@pytest.mark.parametrize("problem", ["not_empty", "a_file"])
def test_run_log_dir_hint(tmp_path, problem):
    given = tmp_path / "given"
    if problem == "not_empty":
        given.mkdir()
        (given / "old.log").write_text("")
    else:
        given.write_text("")
    done = fastspawn_run("--nproc-per-node", "2", "--log-dir", str(given), "/bin/true")
    assert done.returncode == 2 and "give a new or empty directory" in done.stderr, done.stderr
    done = fastspawn_run("--nproc-per-node", "2", "--log-dir", str(tmp_path / "new"), "/bin/true")
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "new")) == ["attempt_0"]


# Where the temporary directory's every candidate is unusable (a read-only
# container), save $TMPDIR if set.
NO_TEMP_DIR = (
    "import os, sys, tempfile; everywhere = tempfile._candidate_tempdir_list; "
    "tempfile._candidate_tempdir_list = lambda: [d for d in everywhere() "
    "if d == os.environ.get('TMPDIR')]; "
    "from fastspawn._cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize("way", ["log_dir", "tmpdir"])
def test_run_without_a_temp_dir_hint(tmp_path, way):
    program = ("--nproc-per-node", "2", "--redirects", "3", "/bin/true")
    env = {**os.environ, "TMPDIR": str(tmp_path / "missing")}
    done = fastspawn_run(*program, code=NO_TEMP_DIR, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("fastspawn run: cannot make a log directory: ")
    assert "give --log-dir, or set TMPDIR to a directory you can write to" in done.stderr
    if way == "log_dir":
        done = fastspawn_run(
            "--log-dir", str(tmp_path / "logs"), *program, code=NO_TEMP_DIR, env=env
        )
        assert done.returncode == 0, done.stderr
        assert os.listdir(tmp_path / "logs") == ["attempt_0"]
    else:
        (tmp_path / "tmp").mkdir()
        env["TMPDIR"] = str(tmp_path / "tmp")
        done = fastspawn_run(*program, code=NO_TEMP_DIR, env=env)
        assert done.returncode == 0, done.stderr
        assert f"fastspawn run: logs in {tmp_path / 'tmp'}" in done.stderr


def test_run_unreadable_slurm_node_list_hint():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_STEP_ID="0", SLURM_NNODES="2", SLURM_NODEID="0", SLURM_NODELIST="node[1-")
    program = [sys.executable, "-c", "import os; print(os.environ['MASTER_ADDR'])"]
    done = fastspawn_run("--nproc-per-node", "1", *program, env=env)
    assert done.returncode != 0 and done.stderr.rstrip().endswith("; give --master-addr")
    done = fastspawn_run("--master-addr", "127.0.0.1", "--nproc-per-node", "1", *program, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "127.0.0.1\n"


@pytest.mark.parametrize("problem", ["exec", "binary"])
def test_run_preload_hint(tmp_path, problem):
    script = tmp_path / "prog.py"
    script.write_text("import sys; print('json' in sys.modules)\n")
    program = ["--exec", str(script)] if problem == "exec" else ["/bin/true"]
    done = fastspawn_run("--preload", "json", *program)
    assert done.returncode == 2, done.stderr
    assert "(a .py program or -m module, without --exec or --no-python)" in done.stderr
    done = fastspawn_run("--preload", "json", "--nproc-per-node", "2", str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\nTrue\n"


# Each word in one process: gpu, xpu and auto import torch to count devices.
EACH_WORD = """\
import sys
from fastspawn._cli.main import main
for word in sys.argv[1:]:
    print("word", word, file=sys.stderr, flush=True)
    try:
        code = main(["run", "--nproc-per-node", word, "/bin/true"])
    except SystemExit as exc:
        code = exc.code
    print(word, code, flush=True)
"""


def test_run_nproc_per_node_word_hint():
    # The words count devices through torch; without it, the next test.
    pytest.importorskip("torch")
    done = fastspawn_run("--nproc-per-node", "lots", "/bin/true")
    assert done.returncode == 2, done.stderr
    words = re.search(r"give a number or one of ([\w, ]+), got 'lots'", done.stderr)
    assert words is not None, done.stderr
    done = python(EACH_WORD, "2", *words.group(1).split(", "))
    assert done.returncode == 0, done.stderr
    said = dict(part.split("\n", 1) for part in done.stderr.split("word ")[1:])
    for line in done.stdout.splitlines():
        word, code = line.split()
        # A word for devices this machine lacks (gpu here) is a usage error
        # naming what works, not a traceback.
        if code != "0":
            assert code == "2" and "Traceback" not in said[word], (word, said[word])
            assert said[word].rstrip().endswith("give a number, or cpu or auto"), said[word]
            assert word in ("gpu", "xpu"), (word, said[word])
    assert len(done.stdout.splitlines()) == 1 + len(words.group(1).split(", ")), done.stdout


def test_run_nproc_per_node_counting_devices_without_torch_hint():
    done = fastspawn_run("--nproc-per-node", "gpu", "/bin/true", code=WITHOUT_TORCH)
    assert done.returncode == 2 and done.stderr.rstrip().endswith("is not installed: give a number")
    done = fastspawn_run("--nproc-per-node", "2", "/bin/true", code=WITHOUT_TORCH)
    assert done.returncode == 0, done.stderr


def test_run_nnodes_hint():
    done = fastspawn_run("--nnodes", "0", "/bin/true")
    assert done.returncode == 2 and "give N or MIN:MAX" in done.stderr, done.stderr
    done = fastspawn_run("--nnodes", "1", "--nproc-per-node", "2", "/bin/true")
    assert done.returncode == 0, done.stderr


def test_run_local_ranks_filter_hint(tmp_path):
    done = fastspawn_run("--local-ranks-filter", "first", "/bin/true")
    assert done.returncode == 2 and "like 0,1" in done.stderr, done.stderr
    program = [sys.executable, "-c", "import os; print(os.environ['LOCAL_RANK'])"]
    done = fastspawn_run(
        "--nproc-per-node", "3", "--tee", "1", "--local-ranks-filter", "0,1",
        "--log-dir", str(tmp_path / "logs"), *program,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = sorted(line.rsplit(":", 1)[1] for line in done.stdout.splitlines())
    assert shown == ["0", "1"], done.stdout


@pytest.mark.parametrize(
    "dynamic",
    [
        ["--standalone"],
        ["--nnodes", "1:2"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"],
    ],
)
def test_run_dynamic_rendezvous_without_torch_hint(dynamic, tmp_path):
    # "install torch, or use the static rendezvous in place of <option>,
    # which does not: --nnodes N --node-rank R --master-addr HOST
    # --master-port PORT".
    program = ["--nproc-per-node", "2", "/bin/true"]
    done = fastspawn_run(*dynamic, *program, code=WITHOUT_TORCH, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    option = re.search(r"use the static rendezvous in place of (.+), which does not", done.stderr)
    assert option is not None, done.stderr
    assert option.group(1) == " ".join(dynamic[:2]), done.stderr
    static = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1"]
    static += ["--master-port", "29512"]
    kept = [arg for arg in dynamic if arg not in option.group(1).split()]  # --rdzv-endpoint
    done = fastspawn_run(*kept, *static, *program, code=WITHOUT_TORCH, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    if dynamic == ["--standalone"] and _torch_importable():
        done = fastspawn_run(*dynamic, *program, cwd=tmp_path)  # torch installed
        assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path) == []


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def test_run_too_many_ranks_hint():
    done = fastspawn_run("--nproc-per-node", "100000000000000000000", "/bin/true")
    assert done.returncode == 2 and "lower --nproc-per-node" in done.stderr, done.stderr
    done = fastspawn_run("--nproc-per-node", "2", "/bin/true")
    assert done.returncode == 0, done.stderr
