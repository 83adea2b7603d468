"""fastspawn as a multiprocessing context: the contexts themselves, their
Process, the multiprocessing objects (Queue, Pipe, Lock, Pool, Manager, ...)
used with them, concurrent.futures and torch's DataLoader over them, and
``import fastspawn as mp`` as a drop-in for (torch.)multiprocessing."""

from __future__ import annotations

import gc
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import pkgutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext
from typing import Any

import mp_targets
import pytest
from helpers import gone, wait_until_asleep

import fastspawn
from fastspawn._mp.popen import Popen as FastspawnPopen

# Every context, by the name multiprocessing knows it by.
# CI runs these on one Python version (.ci/run), for its 30-minute budget;
# by hand they pass on 3.12 and 3.13 too.
pytestmark = pytest.mark.version_neutral

METHODS = ["fastspawn", "fastspawn-fork", "fastspawn-spawn", "fastspawn-forkserver"]
# The ones that pickle the process object, as multiprocessing's spawn does.
PICKLING_METHODS = ["fastspawn", "fastspawn-spawn", "fastspawn-forkserver"]
# Each context's fastspawn start method, which fastspawn.get_context also takes.
SHORT_NAMES = {
    "fastspawn": "zygote",
    "fastspawn-fork": "fork",
    "fastspawn-spawn": "spawn",
    "fastspawn-forkserver": "forkserver",
}
DEADLINE = 60.0  # seconds: a generous bound on anything that should be quick


@pytest.fixture(params=METHODS)
def ctx(request: pytest.FixtureRequest) -> BaseContext:
    return fastspawn.get_context(request.param)


def run_process(ctx: Any, target, args=(), **kwargs) -> multiprocessing.process.BaseProcess:
    """Start ``target`` in a process of ``ctx`` (a context, or a module such
    as fastspawn or multiprocessing) and join it (within the deadline); the
    process, not yet closed."""
    process = ctx.Process(target=target, args=args, **kwargs)
    process.start()
    process.join(DEADLINE)
    assert process.exitcode is not None, f"{process} still runs after {DEADLINE} s"
    return process


@pytest.fixture(scope="module", autouse=True)
def shared_memory_heap() -> None:
    """Make multiprocessing's shared-memory heap (what Value and Array
    allocate from) before the leak checks look: its first arena, a file in
    /dev/shm held open by two fds, stays for the process's life, under any
    start method."""
    from multiprocessing import heap

    heap.BufferWrapper(1)  # freed at once; the small arena is kept for reuse


@pytest.fixture(autouse=True)
def collect_garbage() -> Iterator[None]:
    """Collect the test's garbage before the leak checks look: a Pool (with
    its threads), a Manager and a DataLoader iterator sit in reference
    cycles, and hold their pipes and process sentinels until collected."""
    yield
    gc.collect()


@pytest.fixture
def restore_start_methods() -> Iterator[None]:
    """Forget any start method a test chose, fastspawn's and multiprocessing's."""
    try:
        yield
    finally:
        fastspawn.set_start_method(None, force=True)
        multiprocessing.set_start_method(None, force=True)


# --- the contexts ----------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_context_is_a_multiprocessing_context(name):
    """Each context is a BaseContext named by its long name, the very object
    multiprocessing.get_context and fastspawn.get_context (long or short
    name) return."""
    ctx = fastspawn.get_context(name)
    assert isinstance(ctx, BaseContext)
    assert ctx.get_start_method() == name
    assert multiprocessing.get_context(name) is ctx
    assert fastspawn.get_context(SHORT_NAMES[name]) is ctx
    assert ctx.get_context() is ctx


def test_unknown_method_lists_the_valid_names():
    """An unknown name is a ValueError naming it and every valid name (a
    context's own get_context raises multiprocessing's ValueError)."""
    with pytest.raises(
        ValueError, match="cannot find context for 'nope': fastspawn's start methods are"
    ) as info:
        fastspawn.get_context("nope")
    for name in [*METHODS, *SHORT_NAMES.values()]:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="cannot find context for 'nope'"):
        fastspawn.get_context("fastspawn-spawn").get_context("nope")


def test_default_context_is_the_zygote(restore_start_methods):
    """Without a choice, fastspawn's default context is "fastspawn"."""
    fastspawn.set_start_method(None, force=True)
    assert fastspawn.get_context().get_start_method() == "fastspawn"
    assert fastspawn.get_context() is fastspawn.get_context("fastspawn")
    assert fastspawn.get_start_method() == "fastspawn"
    assert sorted(fastspawn.get_all_start_methods()) == sorted(METHODS)


# --- ctx.Process -----------------------------------------------------------


def test_exit_codes(ctx, capfd):
    """exitcode: 0 on return, sys.exit's code, 1 on an exception (whose
    traceback goes to stderr, as multiprocessing prints it)."""
    ok = run_process(ctx, mp_targets.noop)
    assert ok.exitcode == 0
    ok.close()
    three = run_process(ctx, mp_targets.exit_with, (3,))
    assert three.exitcode == 3
    three.close()
    raised = run_process(ctx, mp_targets.raise_value_error, ("raised in the child",))
    assert raised.exitcode == 1
    raised.close()
    err = capfd.readouterr().err
    assert "Traceback" in err and "ValueError: raised in the child" in err


@pytest.mark.parametrize("how", ["terminate", "kill", "interrupt"])
def test_terminate_kill_and_interrupt(ctx, how, capfd):
    """terminate() and kill() end a running process: exitcode -SIGTERM,
    -SIGKILL.  interrupt() (Python 3.14's Process method, which calls the
    Popen's; called there directly before) sends SIGINT: the target gets
    KeyboardInterrupt, which multiprocessing reports as exit code 1."""
    started = ctx.Event()
    process = ctx.Process(target=mp_targets.signal_then_sleep, args=(started,))
    process.start()
    assert started.wait(DEADLINE)
    assert process.is_alive()
    if how == "interrupt" and not hasattr(process, "interrupt"):
        process._popen.interrupt()
    else:
        getattr(process, how)()
    process.join(DEADLINE)
    expected = {"terminate": -signal.SIGTERM, "kill": -signal.SIGKILL, "interrupt": 1}[how]
    assert process.exitcode == expected
    assert not process.is_alive()
    process.close()
    if how == "interrupt":
        assert "KeyboardInterrupt" in capfd.readouterr().err


def test_process_handle(ctx):
    """pid, is_alive, the sentinel (waitable with connection.wait while the
    process runs and after it joined, until close()), and close() itself."""
    go = ctx.Event()
    process = ctx.Process(target=go.wait, args=(DEADLINE,))
    assert process.pid is None and not process.is_alive()
    process.start()
    assert isinstance(process.pid, int) and process.pid > 0
    assert process.is_alive()
    assert isinstance(process._popen, FastspawnPopen)
    sentinel = process.sentinel
    assert multiprocessing.connection.wait([sentinel], timeout=0) == []
    go.set()
    assert multiprocessing.connection.wait([sentinel], timeout=DEADLINE) == [sentinel]
    process.join(DEADLINE)
    assert process.exitcode == 0 and not process.is_alive()
    # Still waitable (and ready) after the join: multiprocessing waits on it.
    assert process.sentinel == sentinel
    assert multiprocessing.connection.wait([sentinel], timeout=0) == [sentinel]
    assert multiprocessing.connection.wait([sentinel], timeout=0) == [sentinel]
    process.close()
    with pytest.raises(ValueError, match="process object is closed"):
        process.sentinel  # noqa: B018


def test_close_refuses_a_running_process(ctx):
    """close() on a process that still runs is a ValueError, as multiprocessing's."""
    go = ctx.Event()
    process = ctx.Process(target=go.wait, args=(DEADLINE,))
    process.start()
    with pytest.raises(ValueError, match="still running"):
        process.close()
    go.set()
    process.join(DEADLINE)
    process.close()


@pytest.mark.parametrize("daemon", [False, True])
def test_child_knows_itself_and_its_parent(ctx, daemon):
    """In the child: parent_process() is the caller, current_process() has
    the name and daemon flag given."""
    queue = ctx.Queue()
    process = ctx.Process(
        target=mp_targets.report_self, args=(queue,), name=f"worker-{daemon}", daemon=daemon
    )
    assert process.name == f"worker-{daemon}" and process.daemon is daemon
    process.start()
    pid, parent, name, child_daemon, _ = queue.get(timeout=DEADLINE)
    process.join(DEADLINE)
    assert process.exitcode == 0
    assert pid == process.pid
    assert parent == os.getpid()
    assert name == f"worker-{daemon}"
    assert child_daemon is daemon
    process.close()
    queue.close()
    queue.join_thread()


def test_process_started_by_a_process(ctx):
    """A Process that starts one of its own: parent_process() there is that
    Process, and the grandchild outlives it, as under multiprocessing,
    seeing it gone.  With the zygote's contexts the grandchild comes from
    the caller's zygote (the child starts no zygote of its own); with fork
    and spawn it is the child's own child."""
    from fastspawn._zygote import client

    name = ctx.get_start_method()
    queue = ctx.Queue()
    child = ctx.Process(target=mp_targets.start_a_process, args=(name, queue))
    child.start()
    # The two first reports, in whichever order they came.
    first, second = sorted((queue.get(timeout=DEADLINE) for _ in range(2)), key=len)
    started, grandchild = first
    assert started == "started"
    pid, ppid, parent, parent_alive = second
    assert (pid, parent, parent_alive) == (grandchild, child.pid, True)
    from_zygote = name in ("fastspawn", "fastspawn-forkserver")
    assert ppid == (client.zygote_pid() if from_zygote else child.pid)
    # Terminated while its queue's feeder thread still held the queue's
    # lock (the message read here, the lock not yet let go), the child
    # would keep it from the grandchild for ever: once it sleeps, it is done.
    wait_until_asleep(child.pid, DEADLINE)
    child.terminate()
    child.join(DEADLINE)
    assert child.exitcode == -signal.SIGTERM
    assert queue.get(timeout=DEADLINE) == ("parent alive", False)
    deadline = time.monotonic() + DEADLINE
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(grandchild)
    child.close()
    queue.close()
    queue.join_thread()


@pytest.mark.parametrize("name", ["fastspawn", "fastspawn-forkserver"])
def test_zygote_serves_on_when_a_process_dies_in_the_middle_of_a_launch(name):
    """A Process's own launches reach the zygote through its link: one that
    dies after the LAUNCH message, before the fds it promised, ends that
    launch only, not the zygote and every process it serves."""
    from fastspawn._zygote import client

    ctx = fastspawn.get_context(name)
    run_process(ctx, mp_targets.noop).close()  # the zygote up
    zygote = client.zygote_pid()
    process = run_process(ctx, mp_targets.half_a_launch)
    assert process.exitcode == 0
    process.close()
    again = run_process(ctx, mp_targets.exit_with, (3,))
    assert again.exitcode == 3
    again.close()
    assert client.zygote_pid() == zygote


def test_default_process_name(ctx):
    """An unnamed process is called after its class, as multiprocessing's."""
    process = ctx.Process(target=mp_targets.noop)
    assert process.name.startswith(type(process).__name__ + "-")


def test_shared_state_reaches_the_child(ctx):
    """A Queue, a Pipe's end, a Lock, an Event, a Value, an Array and a
    Barrier given as arguments: the child uses each, the parent sees it."""
    queue = ctx.Queue()
    parent_end, child_end = ctx.Pipe()
    lock = ctx.Lock()
    event = ctx.Event()
    value = ctx.Value("i", 1)
    array = ctx.Array("d", [1.0, 2.0, 3.0])
    barrier = ctx.Barrier(2)
    process = ctx.Process(
        target=mp_targets.use_shared_state,
        args=(queue, child_end, lock, event, value, array, barrier),
    )
    process.start()
    child_end.close()
    assert queue.get(timeout=DEADLINE) == "from child"
    assert parent_end.poll(DEADLINE)
    assert parent_end.recv() == ("hello", process.pid)
    parent_end.send("ping")
    assert parent_end.poll(DEADLINE)
    assert parent_end.recv() == ("echo", "ping")
    barrier.wait(timeout=DEADLINE)
    assert event.wait(DEADLINE)
    process.join(DEADLINE)
    assert process.exitcode == 0
    with lock:
        assert value.value == 42
        assert list(array) == [2.0, 4.0, 6.0]
    process.close()
    parent_end.close()
    queue.close()
    queue.join_thread()


def test_process_outlives_the_thread_that_started_it(ctx):
    """A process started from a thread that then exits keeps running
    (PR_SET_PDEATHSIG follows the thread that forks)."""
    go = ctx.Event()
    box = []

    def starter():
        process = ctx.Process(target=go.wait, args=(DEADLINE,))
        process.start()
        box.append(process)

    thread = threading.Thread(target=starter)
    thread.start()
    thread.join(DEADLINE)
    (process,) = box
    process.join(0.5)  # time for a death signal the thread's exit sent to land
    assert process.is_alive(), f"exitcode {process.exitcode}"
    go.set()
    process.join(DEADLINE)
    assert process.exitcode == 0
    process.close()


# --- pickling --------------------------------------------------------------


@pytest.mark.parametrize("name", PICKLING_METHODS)
def test_unpicklable_target_fails_as_spawn_does(name):
    """A lambda as target cannot be pickled: start() raises what
    multiprocessing's spawn context raises for it."""
    with pytest.raises((pickle.PicklingError, AttributeError)) as expected:
        multiprocessing.get_context("spawn").Process(target=mp_targets.UNPICKLABLE).start()
    process = fastspawn.get_context(name).Process(target=mp_targets.UNPICKLABLE)
    with pytest.raises(type(expected.value), match="lambda"):
        process.start()


def test_unpicklable_target_runs_on_fork():
    """The fork context does not pickle the process: a lambda runs, as with
    multiprocessing's fork."""
    process = run_process(fastspawn.get_context("fastspawn-fork"), mp_targets.UNPICKLABLE)
    assert process.exitcode == 0
    process.close()


# --- Pool and Manager ------------------------------------------------------


def test_pool(ctx):
    """ctx.Pool: map, imap, apply_async, and a task's exception re-raised
    in the caller with its message."""
    with ctx.Pool(2) as pool:
        assert pool.map(mp_targets.square, range(8)) == [x * x for x in range(8)]
        assert list(pool.imap(mp_targets.square, range(5))) == [0, 1, 4, 9, 16]
        result = pool.apply_async(mp_targets.square, (7,))
        assert result.get(DEADLINE) == 49
        with pytest.raises(ValueError, match="task 3 failed on purpose"):
            pool.apply(mp_targets.fail_on, (3, 3))
        with pytest.raises(ValueError, match="task 2 failed on purpose"):
            pool.starmap(mp_targets.fail_on, [(1, 2), (2, 2)])
        pool.close()
        pool.join()


def test_manager_proxies_shared_with_a_process(ctx):
    """A ctx.Manager's dict, list and Lock proxies given to a ctx.Process:
    the child's changes show in the parent."""
    with ctx.Manager() as manager:
        shared = manager.dict(count=1)
        items = manager.list(["parent"])
        lock = manager.Lock()
        process = run_process(ctx, mp_targets.fill_manager, (shared, items, lock))
        assert process.exitcode == 0
        assert dict(shared) == {"count": 2, "child": process.pid}
        assert list(items) == ["parent", "child"]
        process.close()


# --- concurrent.futures ----------------------------------------------------


def test_executor_results_and_exceptions(ctx):
    """ProcessPoolExecutor(mp_context=ctx): results in order, and a task's
    exception raised from its future."""
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as executor:
        assert list(executor.map(mp_targets.square, range(6))) == [x * x for x in range(6)]
        future = executor.submit(mp_targets.fail_on, 4, 4)
        with pytest.raises(ValueError, match="task 4 failed on purpose"):
            future.result(DEADLINE)
        assert executor.submit(mp_targets.square, 9).result(DEADLINE) == 81


@pytest.mark.parametrize(
    "death", [mp_targets.exit_abruptly, mp_targets.kill_self], ids=["os._exit", "SIGKILL"]
)
def test_executor_worker_death_breaks_the_pool(ctx, death):
    """A worker that dies mid-task breaks the pool: BrokenProcessPool."""
    executor = ProcessPoolExecutor(max_workers=2, mp_context=ctx)
    try:
        future = executor.submit(death)
        with pytest.raises(BrokenProcessPool):
            future.result(DEADLINE)
        with pytest.raises(BrokenProcessPool):
            executor.submit(mp_targets.square, 2)
    finally:
        executor.shutdown(wait=True)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="max_tasks_per_child is new in 3.11")
def test_executor_max_tasks_per_child(ctx):
    """max_tasks_per_child=1: each task runs in a new worker.  (One worker:
    CPython 3.11 can hang with more, for multiprocessing's own contexts.)"""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as executor:
        pids = [executor.submit(mp_targets.getpid).result(DEADLINE) for _ in range(3)]
    assert len(set(pids)) == 3
    assert os.getpid() not in pids


def test_executor_survives_its_submitting_thread(ctx):
    """Workers started by a submit from a thread that has exited since keep
    serving the pool (PR_SET_PDEATHSIG follows the thread that forks)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as executor:
        pids = []
        thread = threading.Thread(
            target=lambda: pids.append(executor.submit(mp_targets.getpid).result(DEADLINE))
        )
        thread.start()
        thread.join(DEADLINE)
        (first,) = pids
        time.sleep(0.5)  # time for a death signal the thread's exit sent to land
        assert not gone(first)
        # A worker killed by the thread's exit breaks the pool here.
        assert executor.submit(mp_targets.getpid).result(DEADLINE) == first
        assert executor.submit(mp_targets.square, 5).result(DEADLINE) == 25


# --- torch -----------------------------------------------------------------


def epochs_of(loader, epochs: int = 2) -> list[tuple[list[int], set[int]]]:
    """Per epoch: the indices the loader yielded (sorted), and the worker
    ids that worker_init_fn recorded."""
    seen = []
    for _ in range(epochs):
        indices, workers = [], set()
        for index, square, worker in loader:
            assert (index * index == square).all()
            indices.extend(index.tolist())
            workers.update(worker.tolist())
        seen.append((sorted(indices), workers))
    return seen


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_dataloader(ctx, persistent):
    """DataLoader(multiprocessing_context=ctx, num_workers=2): every item
    arrives in each of 2 epochs, from workers that ran worker_init_fn;
    pin_memory=True is accepted (a no-op without an accelerator)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    loader = DataLoader(
        mp_targets.SquaresDataset(24),
        batch_size=3,
        num_workers=2,
        multiprocessing_context=ctx,
        persistent_workers=persistent,
        worker_init_fn=mp_targets.record_worker,
        pin_memory=True,
        timeout=DEADLINE,
    )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            seen = epochs_of(loader)
    finally:
        if persistent and loader._iterator is not None:
            loader._iterator._shutdown_workers()  # else at the loader's collection
    for indices, workers in seen:
        assert indices == list(range(24))
        assert workers == {0, 1}


def test_dataloader_reraises_a_dataset_error(ctx):
    """A dataset's exception in a worker is re-raised by the DataLoader with
    its original message."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    loader = DataLoader(
        mp_targets.FailingDataset(8, bad=5),
        batch_size=2,
        num_workers=2,
        multiprocessing_context=ctx,
        timeout=DEADLINE,
    )
    iterator = iter(loader)
    try:
        with pytest.raises(ValueError, match="item 5 is broken on purpose"):
            for _ in iterator:
                pass
    finally:
        # Left to the garbage collector (the raised exception's traceback
        # holds the iterator in a cycle), the shutdown finds its queues
        # finalized and waits out each worker (5 s), then SIGTERMs it; with
        # multiprocessing's own contexts too.
        iterator._shutdown_workers()


@pytest.fixture(scope="module")
def torch_shm_manager(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start torch's torch_shm_manager before the leak checks look: the
    "file_system" strategy's first share starts it, a child of ours for the
    rest of the process's life with a socket to it open, and its directory
    in TMPDIR (here one of pytest's, not the run's checked temp directory)."""
    torch = pytest.importorskip("torch")
    torch_mp = pytest.importorskip("torch.multiprocessing")
    default = torch_mp.get_sharing_strategy()
    saved_tmpdir = os.environ["TMPDIR"]
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("torch-shm"))
    try:
        torch_mp.set_sharing_strategy("file_system")
        torch.zeros(1).share_memory_()
    finally:
        os.environ["TMPDIR"] = saved_tmpdir
        torch_mp.set_sharing_strategy(default)


@pytest.fixture(params=["file_descriptor", "file_system"])
def sharing_strategy(request: pytest.FixtureRequest, torch_shm_manager: None) -> Iterator[str]:
    """torch's sharing strategy, set for the test, the default put back after."""
    torch_mp = pytest.importorskip("torch.multiprocessing")
    default = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy(request.param)
    try:
        yield str(request.param)
    finally:
        torch_mp.set_sharing_strategy(default)


def test_shared_tensor_hogwild(ctx, sharing_strategy):
    """A share_memory_() tensor given to a ctx.Process and changed in place
    there: the parent sees the change, under either sharing strategy."""
    import torch

    tensor = torch.zeros(16).share_memory_()
    process = run_process(ctx, mp_targets.add_to_tensor, (tensor, 2.5))
    assert process.exitcode == 0
    assert torch.equal(tensor, torch.full((16,), 2.5))
    process.close()


def test_dataloader_follows_multiprocessing_set_start_method(restore_start_methods):
    """With multiprocessing.set_start_method("fastspawn"), a DataLoader
    given no context starts its workers through fastspawn."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    multiprocessing.set_start_method("fastspawn", force=True)
    loader = DataLoader(mp_targets.SquaresDataset(6), batch_size=2, num_workers=2, timeout=DEADLINE)
    iterator = iter(loader)
    try:
        assert sorted(int(i) for index, _, _ in iterator for i in index) == list(range(6))
        assert [type(worker._popen) for worker in iterator._workers] == [FastspawnPopen] * 2
    finally:
        iterator._shutdown_workers()


def test_sharing_strategy_functions_are_torchs():
    """fastspawn's sharing strategy functions are torch.multiprocessing's."""
    torch_mp = pytest.importorskip("torch.multiprocessing")
    for name in ("set_sharing_strategy", "get_sharing_strategy", "get_all_sharing_strategies"):
        assert getattr(fastspawn, name) is getattr(torch_mp, name)
    assert fastspawn.get_sharing_strategy() == torch_mp.get_sharing_strategy()
    assert fastspawn.get_all_sharing_strategies() == torch_mp.get_all_sharing_strategies()


# --- the drop-in -----------------------------------------------------------


def test_every_multiprocessing_name_is_on_fastspawn():
    """Each name of multiprocessing.__all__ is an attribute of fastspawn and
    in fastspawn.__all__; each of torch.multiprocessing.__all__ (with
    torch) is an attribute, and in dir(fastspawn)."""
    names = list(multiprocessing.__all__)
    assert [name for name in names if not hasattr(fastspawn, name)] == []
    assert set(names) <= set(fastspawn.__all__)
    torch_mp = pytest.importorskip("torch.multiprocessing")
    assert [name for name in torch_mp.__all__ if not hasattr(fastspawn, name)] == []
    assert set(torch_mp.__all__) <= set(dir(fastspawn))
    assert fastspawn.ProcessHandle is not fastspawn.Process


def test_multiprocessing_levels_and_submodules_are_on_fastspawn():
    """What a program reaches through multiprocessing's module beyond
    __all__ it reaches through fastspawn: the logging levels, and each
    submodule (imported on first use: mp.connection.wait, mp.pool.ThreadPool)
    but spawn, torch's function here as in torch.multiprocessing, and the
    Windows one."""
    assert (fastspawn.SUBDEBUG, fastspawn.SUBWARNING) == (
        multiprocessing.SUBDEBUG,
        multiprocessing.SUBWARNING,
    )
    found = {module.name for module in pkgutil.iter_modules(multiprocessing.__path__)}
    submodules = sorted(found - {"spawn", "popen_spawn_win32"})
    assert "connection" in submodules and "shared_memory" in submodules
    for name in submodules:
        assert getattr(fastspawn, name) is importlib.import_module(f"multiprocessing.{name}")
        assert name in dir(fastspawn)
    from fastspawn import pool

    assert pool.ThreadPool is multiprocessing.pool.ThreadPool
    assert fastspawn.spawn is importlib.import_module("fastspawn._launch.api").spawn
    assert not hasattr(fastspawn, "popen_spawn_win32")


def test_fastspawn_process_is_started_by_fastspawn(restore_start_methods):
    """fastspawn.Process starts its process through fastspawn (the zygote
    by default), and follows fastspawn.set_start_method."""
    fastspawn.set_start_method(None, force=True)
    process = run_process(fastspawn, mp_targets.noop)
    assert isinstance(process, multiprocessing.process.BaseProcess)
    assert isinstance(process._popen, FastspawnPopen) and process._popen.method == "fastspawn"
    assert process.exitcode == 0
    process.close()
    fastspawn.set_start_method("spawn", force=True)
    assert fastspawn.get_start_method() == "fastspawn-spawn"
    process = run_process(fastspawn, mp_targets.noop)
    assert process._popen.method == "fastspawn-spawn" and process.exitcode == 0
    process.close()
    with pytest.raises(RuntimeError, match="already been set"):
        fastspawn.set_start_method("fork")
    with pytest.raises(ValueError, match="cannot find context for 'bogus'"):
        fastspawn.set_start_method("bogus", force=True)


def test_multiprocessing_set_start_method_fastspawn(restore_start_methods):
    """multiprocessing.set_start_method("fastspawn"): plain
    multiprocessing.Process is then started by fastspawn, and the child's
    multiprocessing default is "fastspawn" too."""
    multiprocessing.set_start_method("fastspawn", force=True)
    assert multiprocessing.get_start_method() == "fastspawn"
    queue = multiprocessing.Queue()
    process = run_process(multiprocessing, mp_targets.report_self, (queue,))
    assert isinstance(process._popen, FastspawnPopen)
    assert process.exitcode == 0
    pid, parent, _, _, method = queue.get(timeout=DEADLINE)
    assert (pid, parent, method) == (process.pid, os.getpid(), "fastspawn")
    process.close()
    queue.close()
    queue.join_thread()


# --- __main__ without a file -----------------------------------------------

DASH_C = """
import multiprocessing, os, sys
import fastspawn

def triple(x):
    return 3 * x

def report(queue):
    queue.put((multiprocessing.parent_process().pid, multiprocessing.current_process().name))

ctx = fastspawn.get_context(sys.argv[1])
if sys.argv[2] == "process":
    queue = ctx.Queue()
    process = ctx.Process(target=report, args=(queue,), name="from-dash-c")
    process.start()
    print("process", queue.get(timeout=60) == (os.getpid(), "from-dash-c"))
    process.join(60)
    print("exitcode", process.exitcode)
elif sys.argv[2] == "executor":
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=ctx) as executor:
        print("executor", list(executor.map(triple, range(4), timeout=60)))
else:
    pool = ctx.Pool(2)
    try:
        print("pool", pool.map_async(triple, range(4)).get(10))
    finally:
        pool.terminate()
        pool.join()
"""


def run_dash_c(name: str, what: str) -> subprocess.CompletedProcess[str]:
    """DASH_C run as ``python -c`` with the context ``name``, for its
    ``what`` ("process" or "pool")."""
    return subprocess.run(
        [sys.executable, "-c", DASH_C, name, what],
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.parametrize("name", ["fastspawn", "fastspawn-spawn"])
def test_process_target_of_dash_c_code(name):
    """A function defined in ``python -c`` code (a __main__ no process can
    import) works as a ctx.Process target."""
    result = run_dash_c(name, "process")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["process True", "exitcode 0"], result.stderr


@pytest.mark.parametrize("name", ["fastspawn", "fastspawn-spawn"])
def test_pool_task_of_dash_c_code(name):
    """A function defined in ``python -c`` code works as a ctx.Pool task:
    multiprocessing's queues send it by name, and the worker's ``__main__``
    has the caller's functions (under multiprocessing's spawn, every worker
    dies there with AttributeError: Can't get attribute 'triple')."""
    result = run_dash_c(name, "pool")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["pool [0, 3, 6, 9]"], result.stderr


@pytest.mark.parametrize("name", ["fastspawn", "fastspawn-spawn"])
def test_executor_task_of_dash_c_code(name):
    """The same for a ProcessPoolExecutor's task."""
    result = run_dash_c(name, "executor")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["executor [0, 3, 6, 9]"], result.stderr


# --- the program's exit ---------------------------------------------------------

AT_EXIT = """
import multiprocessing, sys, time
import fastspawn

def slow(path):
    time.sleep(0.5)
    open(path, "w").write("done")

def forever():
    time.sleep(600)

if __name__ == "__main__":
    ctx = fastspawn.get_context(sys.argv[1])
    manager = ctx.Manager()          # never shut down
    shared = manager.dict(a=1)
    ctx.Process(target=slow, args=(sys.argv[2],)).start()   # never joined
    ctx.Process(target=forever, daemon=True).start()
    pool = ctx.Pool(2)               # never closed
    print(pool.map(abs, [-1, -2]), dict(shared), flush=True)
"""


@pytest.mark.parametrize("name", METHODS)
def test_exit_ends_what_multiprocessing_ends(name, tmp_path):
    """At exit, as under multiprocessing: a Manager never shut down is
    stopped, a process never joined is waited for, a daemonic one is
    terminated, a Pool never closed is stopped; the program exits 0."""
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    done_file = tmp_path / "done"
    result = subprocess.run(
        [sys.executable, str(script), name, str(done_file)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[1, 2] {'a': 1}"], result.stderr
    assert done_file.read_text() == "done"


# --- multiprocessing's after-fork callables ----------------------------------
# multiprocessing.util.register_after_fork: each runs once in a child (the
# resource sharer's, torch's shared-memory cache's).  fastspawn's forked
# worker ran them in its set-up and then again in Process._bootstrap.


@pytest.fixture
def after_fork_probe() -> Iterator[Any]:
    """tests/after_fork_probe.py, imported here (the fork method's parent)
    and in the zygote; no ready workers but those a test asks for."""
    import after_fork_probe

    fastspawn.preload(["after_fork_probe"])
    fastspawn.prefork(0, refill=False)
    yield after_fork_probe
    fastspawn.prefork(0)


def _ready_workers(count: int) -> set[int]:
    """``count`` ready workers made now (none made in the background):
    their pids."""
    from fastspawn._zygote import client

    assert fastspawn.prefork(count, refill=False) == count
    zygote = client.zygote_pid()
    assert zygote is not None
    return client.ready_workers(zygote)


@pytest.mark.parametrize(
    ("name", "ready", "runs"),
    [
        ("fastspawn", False, 1),
        ("fastspawn", True, 1),
        ("fastspawn-fork", False, 1),
        ("fastspawn-forkserver", False, 1),
        ("fastspawn-spawn", False, 0),
        # multiprocessing's own, for the counts above (its forkserver's
        # processes have fork's _after_fork): spawn runs none, a new
        # interpreter having nothing to reset.
        ("fork", False, 1),
        ("spawn", False, 0),
    ],
)
def test_after_fork_callables_run_once_in_a_forked_process(after_fork_probe, name, ready, runs):
    waiting = _ready_workers(1) if ready else set()
    context = multiprocessing.get_context(name)
    queue = context.SimpleQueue()
    try:
        process = run_process(context, after_fork_probe.runs_in_target, (queue,))
        assert process.exitcode == 0
        assert queue.get() == runs
        assert not ready or process.pid in waiting  # the one made ready took it
    finally:
        queue.close()


@pytest.mark.parametrize(
    ("method", "ready"),
    [("zygote", False), ("zygote", True), ("fork", False), ("forkserver", False)],
)
def test_after_fork_callables_run_once_in_a_rank(after_fork_probe, method, ready):
    waiting = _ready_workers(2) if ready else set()
    ctx = fastspawn.start_processes(after_fork_probe.runs_here, nprocs=2, start_method=method)
    assert ctx.return_values == {0: 1, 1: 1}
    assert not ready or set(ctx.pids()) == waiting


def test_after_fork_callables_run_in_a_ranks_own_forked_child(after_fork_probe):
    # A ready worker ran them ahead of its wake; a child it forks once it is
    # a rank runs them again, as any forked child does.
    waiting = _ready_workers(1)
    ctx = fastspawn.start_processes(after_fork_probe.runs_in_a_forked_rank, nprocs=1)
    assert ctx.return_values == {0: 1}
    assert set(ctx.pids()) == waiting


class _CountingRegistry(weakref.WeakValueDictionary):  # type: ignore[type-arg]
    """multiprocessing's after-fork registry, counting its reads."""

    reads = 0

    def items(self):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().items()


def test_after_fork_callables_once_each_and_the_registry_left_alone_after(monkeypatch):
    # run_after_forkers in this process, on a registry of the test's own
    # (the real one holds this process's callables, meant for children).
    from multiprocessing import util

    from fastspawn._worker import runner

    monkeypatch.setattr(_CountingRegistry, "reads", 0)
    monkeypatch.setattr(util, "_afterfork_registry", _CountingRegistry())
    monkeypatch.setattr(util, "_afterfork_counter", itertools.count())
    monkeypatch.setattr(runner, "_after_forkers_run", set())
    monkeypatch.setattr(runner, "_after_forkers_counted", 0)
    ran: list[str] = []

    class Holder:
        def __init__(self, name: str) -> None:
            self.name = name

    first, second = Holder("first"), Holder("second")
    util.register_after_fork(first, lambda holder: ran.append(holder.name))
    runner.run_after_forkers()
    assert ran == ["first"] and _CountingRegistry.reads == 1
    runner.run_after_forkers()  # none registered since: the registry is not read
    assert ran == ["first"] and _CountingRegistry.reads == 1
    util.register_after_fork(second, lambda holder: ran.append(holder.name))
    runner.run_after_forkers()
    assert ran == ["first", "second"] and _CountingRegistry.reads == 2
    runner.run_after_forkers()
    assert ran == ["first", "second"] and _CountingRegistry.reads == 2
