"""Ready workers (issue 31): ranks taken from workers the zygote forked
ahead are indistinguishable from ranks forked at launch time, never carry
an earlier launch's code, die with the caller or the zygote, and stay
within the cap and the caller's limits.

Where a rank's state could depend on the Python version (the first tests)
they run on every version; the rest on CI's first only (version_neutral:
the 30-minute budget)."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import mp_targets
import psutil
import pytest
import workers
from helpers import gone, kill_driver, wait_until_asleep

import fastspawn
from fastspawn import elastic
from fastspawn._os import oscall
from fastspawn._zygote import client, room

TESTS = os.path.dirname(os.path.abspath(__file__))
DEADLINE = 10.0  # seconds: a generous bound on what should be quick


def ready_now() -> set[int]:
    zygote = client.zygote_pid()
    assert zygote is not None
    return client.ready_workers(zygote)


def prefork(count: int) -> set[int]:
    """``count`` ready workers in this process's zygote, none made ready
    in the background after (a refill in the middle would make some ranks
    ready, some not, by timing): their pids."""
    assert fastspawn.prefork(count, refill=False) == count
    ready = ready_now()
    assert len(ready) >= count
    return ready


@pytest.fixture
def no_background_refill():
    """A zygote of the test's own, which makes workers ready only when
    asked (see prefork above); the background is on again after."""
    fastspawn.stop_zygote()  # no state of earlier tests' launches in it
    fastspawn.start_processes(workers.succeed, nprocs=1)
    fastspawn.prefork(0, refill=False)
    yield
    fastspawn.prefork(0)


def differences(states: dict[int, dict]) -> dict[str, dict[int, object]]:
    """What differs between ranks, but for what must differ."""
    keys = set().union(*states.values()) - {"pid", "random"}
    seen = {}
    for key in sorted(keys):
        values = {rank: state[key] for rank, state in states.items()}
        if len({repr(v) for v in values.values()}) > 1:
            seen[key] = values
    return seen


@pytest.mark.parametrize("tracker", [False, True], ids=["alone", "with_a_resource_tracker"])
def test_ready_and_forked_ranks_of_one_launch_are_alike(
    no_background_refill, tmp_path, monkeypatch, tracker
):
    """Two ranks from ready workers, two forked at launch, the caller's
    state changed in between: the same environment, cwd, umask, sys.path,
    CPU affinity, limits, signal dispositions and mask, fds (stack file
    armed), name, process group; their own pids and random states."""
    if tracker:  # its pipe travels with every launch, as an argument's fd
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    monkeypatch.setenv("FASTSPAWN_TEST_GONE", "set before prefork")
    fastspawn.start_processes(workers.succeed, nprocs=1)  # the zygote has it too
    ready = prefork(2)
    monkeypatch.setenv("FASTSPAWN_TEST_READY", "changed after prefork")
    monkeypatch.delenv("FASTSPAWN_TEST_GONE")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    old_mask = os.umask(0o027)
    old_core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old_core[1]))
    old_cpus = os.sched_getaffinity(0)
    cpus = {min(old_cpus)}  # one CPU fewer, where there are two or more
    os.sched_setaffinity(0, cpus)
    try:
        ctx = fastspawn.start_processes(workers.rank_state, nprocs=4)
    finally:
        os.umask(old_mask)
        resource.setrlimit(resource.RLIMIT_CORE, old_core)
        os.sched_setaffinity(0, old_cpus)
    states = ctx.return_values
    assert {states[0]["pid"], states[1]["pid"]} <= ready
    assert not {states[2]["pid"], states[3]["pid"]} & ready
    different = differences(states)
    assert different == {}, "\n".join(f"{key}: {value}" for key, value in different.items())
    for state in states.values():
        assert state["env"]["FASTSPAWN_TEST_READY"] == "changed after prefork"
        assert "FASTSPAWN_TEST_GONE" not in state["env"]
        assert state["cwd"] == str(tmp_path)
        assert state["sys.path"][0] == str(tmp_path)
        assert state["umask"] == 0o027
        assert state["limits"]["RLIMIT_CORE"] == (0, old_core[1])
        assert state["affinity"] == sorted(cpus)
        assert "/memfd:fastspawn-stacks:RANK" in state["fds"]
        assert state["comm"] != "fastspawn-ready"
        assert state["ppid"] == client.zygote_pid()
    assert len({state["pid"] for state in states.values()}) == 4
    assert len({state["random"] for state in states.values()}) == 4


def test_each_rank_from_a_ready_worker_has_its_stack_file_named_for_its_rank(
    no_background_refill,
):
    """A ready worker waits with its stack file named for a rank ahead (its
    slot), and a launch gives each rank the worker named for it where one
    waits; where none does, the worker it takes names its file at the
    wake: either way the file bears the rank's number, as a forked rank's."""
    from fastspawn._launch import stacks as _stacks

    ready = prefork(3)
    slots = {pid: _stacks.find_memfd(pid) for pid in ready}
    assert sorted(found[1] for found in slots.values() if found is not None) == ["0", "1", "2"]
    ctx = fastspawn.start_processes(workers.stack_file_name, nprocs=3)
    for rank, (pid, name) in ctx.return_values.items():
        assert pid in ready and name == str(rank)
        assert slots[pid][1] == str(rank)  # type: ignore[index]  # the one named for it
    # Slots 1 and 2 left waiting after a launch of one (rank 0, slot 0):
    # a launch of two takes slot 1 for rank 1 and the other for rank 0.
    prefork(3)
    fastspawn.start_processes(workers.stack_file_name, nprocs=1)
    left = {pid: _stacks.find_memfd(pid) for pid in ready_now()}
    assert sorted(found[1] for found in left.values() if found is not None) == ["1", "2"]
    ctx = fastspawn.start_processes(workers.stack_file_name, nprocs=2)
    for rank, (pid, name) in ctx.return_values.items():
        assert pid in left and name == str(rank)
    assert left[ctx.return_values[1][0]][1] == "1"  # type: ignore[index]


def test_each_launch_from_ready_workers_draws_fresh_random_numbers(no_background_refill):
    draws = []
    for _ in range(2):
        ready = prefork(3)
        ctx = fastspawn.start_processes(workers.pid_and_random, nprocs=3)
        assert {pid for pid, _draw in ctx.return_values.values()} <= ready
        draws += [draw for _pid, draw in ctx.return_values.values()]
    assert len(set(draws)) == 6


@pytest.mark.version_neutral
def test_ready_workers_run_only_their_own_launchs_code(no_background_refill):
    """A worker made ready after a launch unpickles and runs the next
    launch's fn and arguments, never the earlier one's."""
    fastspawn.start_processes(workers.total, args=([1, 2, 3],), nprocs=2)
    ready = prefork(2)
    ctx = fastspawn.start_processes(workers.pid_and_random, nprocs=2)
    assert {pid for pid, _draw in ctx.return_values.values()} == ready
    ready = prefork(2)
    ctx = fastspawn.start_processes(workers.total, args=([4, 5],), nprocs=2)
    assert ctx.return_values == {0: 9, 1: 10}  # sum(values) + rank
    assert not ready_now() & ready


def test_a_failing_unpickle_in_a_ready_worker_reports_the_traceback(no_background_refill):
    """As a forked rank reports the zygote's failure to unpickle."""
    prefork(1)
    argument = workers.UnpicklableByWorkers(client.zygote_pid())
    with pytest.raises(fastspawn.ProcessRaisedException, match="no_such_module_for_ready"):
        fastspawn.start_processes(workers.total, args=(argument,), nprocs=1)


@pytest.mark.version_neutral
def test_a_multiprocessing_process_from_a_ready_worker(no_background_refill):
    """A fastspawn context's Process taken from a ready worker: its parent
    is the caller, and a Process it starts comes from the same zygote."""
    ready = prefork(1)
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    ctx = fastspawn.get_context("fastspawn")
    process = ctx.Process(target=mp_targets.start_a_process, args=("fastspawn", queue))
    process.start()
    try:
        assert process.pid in ready
        said = sorted([queue.get(), queue.get()], key=len)  # ("started", pid) first
        (started, inner), report = said
        assert started == "started"
        assert report == (inner, client.zygote_pid(), process.pid, True)
        # The queue's reader may have the message before its writer let go
        # of the queue's lock: terminated then, it would keep it from the
        # inner process for ever.  Its sleep after it is the sign.
        wait_until_asleep(process.pid, DEADLINE)
    finally:
        process.terminate()
        process.join(DEADLINE)
        process.close()
    assert queue.get() == ("parent alive", False)
    deadline = time.monotonic() + DEADLINE
    while not gone(inner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(inner)
    queue.close()


def _sigint_pending(pid: int) -> bool:
    """Whether a SIGINT sent to ``pid`` waits to be delivered."""
    bit = 1 << (signal.SIGINT - 1)
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd", "ShdPnd"))]
    return any(mask & bit for mask in masks)


@pytest.mark.version_neutral
def test_a_sigint_sent_as_start_returns_reaches_a_process_from_a_ready_worker(
    no_background_refill,
):
    """The caller has a ready worker's pid before the worker wakes and takes
    on the caller's SIGINT handling: a SIGINT sent then (Python 3.14's
    Process.interrupt() the moment start() returns) is the process's, as
    for one forked at launch.  The worker is held stopped so that the signal
    surely comes while it still waits (it used to be ignored then)."""
    (pid,) = prefork(1)
    os.kill(pid, signal.SIGSTOP)
    try:
        process = fastspawn.get_context("fastspawn").Process(target=time.sleep, args=(60,))
        process.start()
        assert process.pid == pid
        os.kill(pid, signal.SIGINT)
    finally:
        os.kill(pid, signal.SIGCONT)
    process.join(DEADLINE)
    try:
        assert process.exitcode == 1  # KeyboardInterrupt, as the caller handles SIGINT
    finally:
        process.kill()
        process.join(DEADLINE)
        process.close()


@pytest.mark.version_neutral
def test_a_sigint_to_a_waiting_worker_is_not_its_ranks(no_background_refill):
    """A SIGINT that reached a ready worker before a launch took it (a Ctrl-C
    meant for the caller, say) does not interrupt its rank later."""
    (pid,) = prefork(1)
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + DEADLINE
    while _sigint_pending(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _sigint_pending(pid)
    time.sleep(0.1)  # its handler has run, long before the launch below
    ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=1)
    assert ctx.return_values[0][0] == pid


@pytest.mark.version_neutral
def test_elastic_function_ranks_take_ready_workers(no_background_refill, tmp_path):
    """fastspawn.elastic's function ranks, their streams redirected to log
    files, come from ready workers as start_processes' ranks do."""
    ready = prefork(2)
    ctx = elastic.start_processes(
        "t",
        workers.elastic_pid,
        {0: ("rank0",), 1: ("rank1",)},
        {0: {}, 1: {}},
        str(tmp_path),
        redirects=elastic.Std.ALL,
    )
    result = ctx.wait(timeout=DEADLINE)
    assert result is not None and not result.is_failed()
    pids = result.return_values
    assert set(pids.values()) <= ready and len(set(pids.values())) == 2
    for rank, pid in pids.items():
        for stream in ("stdout", "stderr"):
            said = (tmp_path / str(rank) / f"{stream}.log").read_text()
            assert said == f"rank{rank} {pid}\n"


RESTARTED = """
import os, sys, time
from fastspawn._zygote import client

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0:
    sys.exit(1)  # its end owes the zygote two ready workers
if attempt == 1:
    # This attempt's ranks were forked (none was ready yet); the zygote,
    # our parent, makes two ready while they run.
    deadline = time.monotonic() + 10
    while len(client.ready_workers(os.getppid())) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    print("ready", *client.ready_workers(os.getppid()), flush=True)
    sys.exit(1)
print("rank", os.environ["LOCAL_RANK"], os.getpid(), os.getppid(), flush=True)
"""


@pytest.mark.version_neutral
def test_fastspawn_run_restarts_python_ranks_from_ready_workers(tmp_path):
    """`fastspawn run`'s Python ranks: a restart takes the workers the
    zygote made ready while the attempt before ran."""
    program = tmp_path / "restarted.py"
    program.write_text(RESTARTED)
    env = {name: value for name, value in os.environ.items() if name != "FASTSPAWN_READY"}
    done = subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", "--nprocs-per-node", "2"]
        + ["--max-restarts", "2", str(program)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    ready = {int(pid) for words in lines if words[:1] == ["ready"] for pid in words[1:]}
    ranks = {
        int(words[1]): (int(words[2]), int(words[3])) for words in lines if words[:1] == ["rank"]
    }
    assert sorted(ranks) == [0, 1], done.stdout
    assert len(ready) >= 2, done.stdout
    assert {pid for pid, _zygote in ranks.values()} <= ready, done.stdout
    assert len({zygote for _pid, zygote in ranks.values()}) == 1


@pytest.mark.version_neutral
def test_a_process_never_gets_a_ready_worker_that_died(no_background_refill):
    """Ready workers that died (killed by pid, here; exited, whether or not
    the zygote reaped them yet) are not given a Process (its pid goes to
    the caller before the worker is woken): the Process is forked and runs."""
    ready = prefork(2)
    for pid in ready:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + DEADLINE
    while not all(gone(pid) for pid in ready):  # SIGKILL takes effect when they next run
        assert time.monotonic() < deadline, "the killed ready workers did not exit"
        time.sleep(0.005)
    process = fastspawn.get_context("fastspawn").Process(target=mp_targets.exit_with, args=(7,))
    process.start()
    try:
        assert process.pid not in ready
        process.join(DEADLINE)
        assert process.exitcode == 7
    finally:
        if process.exitcode is None:
            process.kill()
            process.join(DEADLINE)
        process.close()


@pytest.mark.version_neutral
def test_a_launch_preloading_what_the_zygote_lacks_forks_its_ranks(no_background_refill):
    """preload= of a module the zygote lacks: the zygote imports it once
    (which retires the ready workers: they lack it) and forks the ranks
    with it, rather than each ready worker importing it."""
    ready = prefork(2)
    ctx = fastspawn.start_processes(
        workers.module_loaded, args=("pyclbr",), nprocs=2, preload=["pyclbr"]
    )
    assert ctx.return_values == {0: True, 1: True}
    assert not set(ctx.pids()) & ready


@pytest.mark.version_neutral
def test_ranks_of_a_large_argument_are_forked_from_one_unpickling(no_background_refill):
    """Pickled fn and args over MAX_WAKE_WORK: a launch of several ranks
    forks them, sharing the zygote's one unpickled copy, where each ready
    worker would unpickle one of its own; one rank still takes a ready
    worker, and so do several with a small argument."""
    from fastspawn._zygote.ready import MAX_WAKE_WORK

    large, small = b"\x01" * (MAX_WAKE_WORK + 1), b"\x01" * 1024
    ready = prefork(3)
    forked = fastspawn.start_processes(workers.total, args=(large,), nprocs=2)
    assert forked.return_values == {0: len(large), 1: len(large) + 1}
    assert not set(forked.pids()) & ready
    one = fastspawn.start_processes(workers.total, args=(large,), nprocs=1)
    assert one.return_values == {0: len(large)}
    assert set(one.pids()) < ready
    two = fastspawn.start_processes(workers.total, args=(small,), nprocs=2)
    assert two.return_values == {0: len(small), 1: len(small) + 1}
    assert set(two.pids()) <= ready - set(one.pids())


@pytest.mark.version_neutral
def test_preload_retires_the_ready_workers(no_background_refill):
    ready = prefork(2)
    fastspawn.preload(["tabnanny"])
    deadline = time.monotonic() + DEADLINE
    while not all(gone(pid) for pid in ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(gone(pid) for pid in ready)
    ctx = fastspawn.start_processes(workers.module_loaded, args=("tabnanny",), nprocs=1)
    assert ctx.return_values == {0: True}


@pytest.mark.version_neutral
def test_prefork_zero_releases_them_and_the_background_stays(no_background_refill):
    ready = prefork(2)
    assert fastspawn.prefork(0) == 0
    deadline = time.monotonic() + DEADLINE
    while not all(gone(pid) for pid in ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(gone(pid) for pid in ready)
    fastspawn.start_processes(workers.succeed, nprocs=2)
    while len(ready_now()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(ready_now()) == 2


@pytest.mark.version_neutral
def test_workers_made_ready_again_after_a_launch_rehearse_on_its_state(monkeypatch):
    """What ready workers rehearse their wake on is made in the zygote once
    for a refill's steps, and again after each message (a launch takes on
    its caller's environment): workers made ready again after a launch that
    changed the environment wake with the next launch's, though they skip
    its header where the caller's state is theirs."""
    name = "FASTSPAWN_TEST_REHEARSED"
    fastspawn.stop_zygote()
    monkeypatch.setenv(name, "before")
    fastspawn.start_processes(workers.succeed, nprocs=1)
    try:
        assert fastspawn.prefork(3) == 3  # and kept so: made ready again
        monkeypatch.setenv(name, "after")
        first = fastspawn.start_processes(workers.pid_and_env, args=(name,), nprocs=3)
        taken = {pid for pid, _value in first.return_values.values()}
        deadline = time.monotonic() + DEADLINE
        while len(ready_now() - taken) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        ready = ready_now() - taken
        assert len(ready) >= 3
        second = fastspawn.start_processes(workers.pid_and_env, args=(name,), nprocs=3)
        assert {pid for pid, _value in second.return_values.values()} <= ready
        assert [value for _pid, value in second.return_values.values()] == ["after"] * 3
    finally:
        fastspawn.prefork(0)


@pytest.mark.version_neutral
def test_none_are_made_ready_in_a_directory_removed_since_and_nothing_is_printed(
    capfd, no_background_refill, tmp_path, monkeypatch
):
    """A launch from a directory removed after it leaves the zygote there
    (it takes on each launch's cwd) until the next: a worker cannot
    rehearse its wake on a cwd that is gone.  None is made, and none dies
    trying with a traceback on the caller's stderr (each did, once a
    refill step); a launch from a live directory brings them back."""
    gone_dir = tmp_path / "gone"
    gone_dir.mkdir()
    monkeypatch.chdir(gone_dir)
    fastspawn.start_processes(workers.succeed, nprocs=1)
    monkeypatch.chdir(tmp_path)
    gone_dir.rmdir()
    assert fastspawn.prefork(2, refill=False) == 0
    assert ready_now() == set()
    fastspawn.start_processes(workers.succeed, nprocs=1)
    prefork(2)
    assert "Traceback" not in capfd.readouterr().err


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None  # gone meanwhile


def test_ready_workers_bear_their_name_from_their_fork(no_background_refill):
    """What lists ready workers by name (leak checks, the stack walk, which
    signals the zygote's other children as ranks) never sees one without
    it, even just after its fork; the zygote keeps its own."""
    zygote = client.zygote_pid()
    assert zygote is not None
    zygote_name = _comm(zygote)
    made: list[int] = []
    thread = threading.Thread(target=lambda: made.append(fastspawn.prefork(48, refill=False)))
    first_seen: dict[int, str | None] = {}
    # Workers released before (prefork(0) does not wait for their exits).
    earlier = client.children_of(zygote)
    thread.start()
    try:
        while thread.is_alive():
            for pid in client.children_of(zygote):
                if pid not in first_seen:
                    first_seen[pid] = _comm(pid)
    finally:
        thread.join()
    # The last fork may come after the loop's last look and before
    # prefork() returns (CI saw 47 of 48 so): one more.
    for pid in client.children_of(zygote):
        first_seen.setdefault(pid, _comm(pid))
    assert made == [48]
    ready = client.ready_workers(zygote) - earlier
    assert len(ready) == 48
    assert {first_seen[pid] for pid in ready} == {"fastspawn-ready"}
    # The zygote's other children meanwhile: only its spare group's anchor
    # (made while workers are ready, and reaped to make room for a fork), a
    # zombie of a name of its own; seen just after its clone it may still
    # bear the zygote's.
    for pid in set(first_seen) - ready - earlier:
        assert first_seen[pid] in {oscall.ANCHOR_NAME, zygote_name, None}
        assert _comm(pid) in {oscall.ANCHOR_NAME, None}
    assert _comm(zygote) == zygote_name != "fastspawn-ready"


def test_prefork_checks_its_argument():
    with pytest.raises(TypeError, match="prefork"):
        fastspawn.prefork("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        fastspawn.prefork(-1)


def test_a_launchs_quiet_ends_with_its_last_rank_unless_another_holds_it():
    """No refill while a launch's ranks come up: for 10 ms and 2 ms a rank
    after it began, or until all its ranks ended, if that is sooner (a
    launch from ready workers whose ranks return at once had the refill of
    its workers wait for nothing); another launch's ranks still coming up,
    or the limits' back-off, hold it still."""
    from fastspawn._zygote import ready

    pool = ready.ReadyPool(os.getpid(), None, {})  # type: ignore[arg-type]  # (not forking)
    large, small = object(), object()
    began = time.monotonic()
    pool.launched(large, 256)
    assert pool.quiet_until >= began + ready.QUIET_AFTER_LAUNCH + 256 * ready.QUIET_PER_RANK
    pool.launched(small, 1)
    held_by_small = pool.coming_up[small]
    assert held_by_small < pool.quiet_until
    pool.ended(large)
    assert pool.quiet_until == held_by_small  # the small launch's ranks may still come up
    pool.ended(small)
    assert pool.quiet_until == 0.0 and not pool.coming_up
    pool.ended(small)  # ended twice (or never launched): nothing changes
    assert pool.quiet_until == 0.0
    pool.held_until = time.monotonic() + 1.0  # the limits stopped a refill
    pool.launched(small, 1)
    pool.ended(small)
    assert pool.quiet_until == pool.held_until


def test_none_are_made_ready_while_memory_is_short(monkeypatch):
    # The zygote reads only the head of /proc/meminfo: it must find there
    # what a reading of the whole file finds.  (No cgroup's limit counts
    # here: see test_cgroups.py.)
    monkeypatch.setattr(room, "_cgroup_limits", ([], []))
    with open("/proc/meminfo", "rb") as f:
        info = {line.split(b":")[0]: int(line.split()[1]) << 10 for line in f}
    short = info[b"MemAvailable"] < max(room.MIN_AVAILABLE, info[b"MemTotal"] // 10)
    assert (room.room_under_limits(0) == 0) == short
    monkeypatch.setattr(room, "MIN_AVAILABLE", info[b"MemTotal"] + (1 << 30))
    assert room.room_under_limits(0) == 0


DRIVER = """
import os, resource, sys, time
import fastspawn, workers
from fastspawn._zygote import client

def ready():
    return client.ready_workers(client.zygote_pid())

def settle(count):
    deadline = time.monotonic() + 10
    while len(ready()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # what more a refill would make, it has made
    return len(ready())

case = sys.argv[1]
if case == "background":
    fastspawn.start_processes(workers.succeed, nprocs=4)
    print(settle(4), flush=True)
    fastspawn.start_processes(workers.succeed, nprocs=3)
    print(settle(4), flush=True)
elif case == "mp-slots":
    # Multiprocessing processes are each rank 0 of a launch of one: the
    # workers made ready again after them wait named for rank 0.  Each
    # start owes one and may take one made after an earlier start, so
    # rounds of three go on until two or more wait.
    from fastspawn._launch import stacks
    ctx = fastspawn.get_context("fastspawn")
    for _ in range(5):
        processes = [ctx.Process(target=time.sleep, args=(0,)) for _ in range(3)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if settle(2) >= 2:
            break
    waiting = sorted(ready())
    names = {stacks.find_memfd(pid)[1] for pid in waiting}
    print(len(waiting) >= 2, *sorted(names), flush=True)
    process = ctx.Process(target=time.sleep, args=(0,))
    process.start()
    process.join()
    print(process.pid in waiting, process.exitcode, flush=True)
elif case == "nproc":
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[2]), hard))
    # workers imported in the zygote first (new modules retire ready ones)
    fastspawn.start_processes(workers.succeed, nprocs=1)
    print(fastspawn.prefork(int(sys.argv[3])), flush=True)
    # With workers ready, the next launch's group is anchored ahead.
    zygote = client.zygote_pid()
    deadline = time.monotonic() + 10
    while not (spare := client.spare_group(zygote)) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(len(spare), flush=True)
    # The caller's limit changed since the zygote started: its ranks are
    # forked under it, not taken from ready workers.
    before = ready()
    resource.setrlimit(resource.RLIMIT_NPROC, (int(sys.argv[2]) + 1, hard))
    ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=2)
    print(len({pid for pid, _ in ctx.return_values.values()} & before), flush=True)
    # They counted against its limit: killed, and not made ready again;
    # nor is the spare group's anchor kept, or made again.
    time.sleep(0.5)
    print(len(ready()), len(client.spare_group(zygote)), flush=True)
elif case == "nofile":
    # Soft and hard alike: the zygote cannot raise its own.
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[2])))
    fastspawn.start_processes(workers.succeed, nprocs=1)  # the zygote, under it
    print(fastspawn.prefork(int(sys.argv[2])), flush=True)
elif case == "nofile-raised":
    import tempfile
    import psutil
    from fastspawn import elastic
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    fastspawn.start_processes(workers.succeed, nprocs=1)  # the zygote, under it
    many = low // 4  # twice what a quarter of the caller's limit holds
    print(fastspawn.prefork(many, refill=False), flush=True)
    print(psutil.Process(client.zygote_pid()).rlimit(psutil.RLIMIT_NOFILE)[0], flush=True)
    # Ranks from ready workers and forked ones, of one launch.
    ctx = fastspawn.start_processes(workers.open_files_limit, nprocs=many + 2)
    print(*sorted(set(ctx.return_values.values())), flush=True)
    # Multiprocessing processes, from ready workers and forked.
    fastspawn.prefork(2, refill=False)
    with fastspawn.get_context("fastspawn").Pool(4) as pool:
        print(*sorted(set(pool.map(workers.open_files_limit, range(16), chunksize=1))), flush=True)
    # A binary, started by the zygote's C launcher.
    with tempfile.TemporaryDirectory() as logs:
        run = elastic.start_processes(
            "bin", "/bin/sh", {0: ("-c", "ulimit -Sn",)}, {0: {}}, logs,
            redirects=elastic.Std.ALL,
        )
        assert not run.wait(timeout=60).is_failed()
        with open(os.path.join(logs, "0", "stdout.log")) as f:
            print(f.read().strip(), flush=True)
    # A caller that raised its own since: its ranks get that.
    resource.setrlimit(resource.RLIMIT_NOFILE, (low + 8, hard))
    fastspawn.prefork(1, refill=False)
    ctx = fastspawn.start_processes(workers.open_files_limit, nprocs=2)
    print(*sorted(set(ctx.return_values.values())), flush=True)
elif case == "nice":
    # The caller's nice value raised after workers were made ready (a
    # process of its own: without privileges it cannot be lowered back).
    fastspawn.start_processes(workers.succeed, nprocs=1)
    print(fastspawn.prefork(2, refill=False), flush=True)
    waiting = ready()
    os.nice(3)
    ctx = fastspawn.start_processes(workers.pid_and_nice, nprocs=4)
    ranks = ctx.return_values.values()
    print(len({pid for pid, _nice in ranks} & waiting), flush=True)
    print(os.getpriority(os.PRIO_PROCESS, 0), *sorted({nice for _pid, nice in ranks}), flush=True)
elif case == "off":
    fastspawn.start_processes(workers.succeed, nprocs=2)
    print(settle(0), flush=True)
    print(fastspawn.prefork(2), len(ready()), flush=True)
    fastspawn.prefork(0, refill=False)
    fastspawn.start_processes(workers.succeed, nprocs=2)
    print(settle(0), flush=True)
elif case == "kill":
    fastspawn.prefork(4)
    print(os.getpid(), client.zygote_pid(), *sorted(ready()), flush=True)
    time.sleep(600)
"""


def run_driver(
    *args: str, env: dict[str, str] | None = None, script: str | None = None
) -> list[str]:
    """DRIVER's output for ``args`` (``script``: that file's instead)."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]), **(env or {}))
    main = [script] if script is not None else ["-c", textwrap.dedent(DRIVER)]
    done = subprocess.run(
        [sys.executable, *main, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.version_neutral
def test_a_launch_that_ended_is_made_ready_again_up_to_the_cap():
    assert run_driver("background") == ["4", "4"]
    assert run_driver("background", env={"FASTSPAWN_READY": "2"}) == ["2", "2"]


# A main module of its own (its processes' targets live there, and
# multiprocessing's starts from a file's main module come as fast as a
# program's: from `python -c` the refill kept up with them).
LEVEL_DRIVER = """
import sys, time
import fastspawn, workers
from fastspawn._zygote import client

def settle(count):
    deadline = time.monotonic() + 10
    while len(client.ready_workers(client.zygote_pid())) < count:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    time.sleep(0.5)  # what more a refill would make, it has made
    return len(client.ready_workers(client.zygote_pid()))

def idle():
    pass

if __name__ == "__main__":
    case, count = sys.argv[1], int(sys.argv[2])
    if case == "in-a-row":
        # Back to back, faster than the refill: each launch forks its
        # ranks while the last one's are still owed.
        for _ in range(count):
            fastspawn.start_processes(workers.succeed, nprocs=4)
        print(settle(4), flush=True)
        fastspawn.start_processes(workers.succeed, nprocs=6)
        print(settle(6), flush=True)
    elif case == "mp-one-at-a-time":
        ctx = fastspawn.get_context("fastspawn")
        for _ in range(count):
            process = ctx.Process(target=idle)
            process.start()
            process.join()
        print(settle(1), flush=True)
    elif case == "mp-at-once":
        # ``count`` running at once (each waits for the event), twice.
        ctx = fastspawn.get_context("fastspawn")
        for _ in range(2):
            go = ctx.Event()
            processes = [ctx.Process(target=go.wait) for _ in range(count)]
            for process in processes:
                process.start()
            go.set()
            for process in processes:
                process.join()
            print(settle(count), flush=True)
"""


def run_level_driver(tmp_path, case: str, count: int) -> list[str]:
    script = tmp_path / "level_driver.py"
    script.write_text(textwrap.dedent(LEVEL_DRIVER))
    return run_driver(case, str(count), script=str(script))


@pytest.mark.version_neutral
def test_launches_in_a_row_keep_as_many_ready_as_the_largest_had(tmp_path):
    """However many launches come faster than the refill (each then forks
    its ranks), the background makes ready as many as the largest of them
    had, not one worker for every rank of every launch (12 launches of 4
    in a row left 48 ready workers before)."""
    assert run_level_driver(tmp_path, "in-a-row", 12) == ["4", "6"]


@pytest.mark.version_neutral
def test_multiprocessing_processes_keep_as_many_ready_as_ran_at_once(tmp_path):
    """Processes started and joined one at a time leave one ready worker,
    however many there were (100 left 100 before); three running at once
    leave three, and the next three take them and leave three again."""
    assert run_level_driver(tmp_path, "mp-one-at-a-time", 100) == ["1"]
    assert run_level_driver(tmp_path, "mp-at-once", 3) == ["3", "3"]


@pytest.mark.version_neutral
def test_multiprocessing_processes_are_made_ready_again_for_rank_0():
    """Their refills wait with their stack files named for rank 0, the
    rank every one of them takes (see ReadyPool.owe), and the next
    process takes one."""
    assert run_driver("mp-slots") == ["True", "0", "True", "0"]


@pytest.mark.version_neutral
def test_ranks_from_ready_workers_take_a_nice_value_raised_since():
    """The caller's nice value as of the launch, as a rank forked then has
    it (what the caller changed since its zygote started travels with the
    launch): two ranks from workers made ready before the change, two
    forked after, in a process of the test's own."""
    made, taken, callers, *ranks = run_driver("nice")
    assert (made, taken) == ("2", "2")
    assert ranks == [callers]


@pytest.mark.version_neutral
def test_ready_workers_off():
    """FASTSPAWN_READY=0: none in the background, prefork() still makes
    them; prefork(0, refill=False) releases them and turns the background
    off."""
    assert run_driver("off", env={"FASTSPAWN_READY": "0"}) == ["0", "2", "2", "0"]
    assert run_driver("off")[1:] == ["2", "2", "0"]


@pytest.mark.version_neutral
def test_ready_workers_stay_within_a_quarter_of_rlimit_nproc():
    own = sum(1 for name in os.listdir("/proc") if name.isdigit())
    limit = own + 200  # room for the driver's own processes whatever the machine
    # Ready: a quarter; the spare group made; none of them taken by the
    # launch under the caller's own limit; none left or made after it.
    said = run_driver("nproc", str(limit), str(limit))
    assert said == [str(limit // 4), "1", "0", "0", "0"]


@pytest.mark.version_neutral
def test_ready_workers_stay_within_a_quarter_of_rlimit_nofile():
    """Each waiting worker holds two of the zygote's fds (both ends of its
    socketpair, see ReadyPool.spend): an eighth of the limit in workers,
    where the hard limit leaves the zygote no room to raise its own."""
    assert run_driver("nofile", "400") == ["50"]


@pytest.mark.version_neutral
def test_the_zygote_raises_its_own_open_files_limit_and_ranks_keep_the_callers():
    """Under a soft RLIMIT_NOFILE too low for the workers asked for (a
    desktop's 1024 held 128 of the default 256), the zygote raises its own
    as far as the hard limit; every rank it starts (from a ready worker or
    forked, a multiprocessing process, a binary) runs under the caller's,
    and under a higher one the caller set later."""
    low = 200
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * low:
        pytest.skip("the hard RLIMIT_NOFILE leaves no room to raise the soft one")
    said = run_driver("nofile-raised", str(low))
    assert said[0] == str(low // 4)  # 25 with the zygote's limit as the caller's
    assert int(said[1]) >= 2 * low
    assert said[2:] == [str(low), str(low), str(low), str(low + 8)]


def _zygote_sockets(zygote: int) -> set[str]:
    """The sockets the zygote holds ("socket:[inode]")."""
    fd_dir = f"/proc/{zygote}/fd"
    sockets = set()
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            sockets.add(target)
    return sockets


@pytest.mark.version_neutral
def test_the_zygote_lets_go_of_the_woken_workers_sockets_once_idle(no_background_refill):
    """The zygote keeps both ends of a woken worker's socketpair while the
    launch's ranks come up (ReadyPool.spend), and closes them at its next
    idle moment, with no launch or refill to come."""
    zygote = client.zygote_pid()
    assert zygote is not None
    before = _zygote_sockets(zygote)
    ready = prefork(4)
    # The channel prefork() asked on may still be open a moment after it
    # returned (seen: one socket more, gone soon after).
    deadline = time.monotonic() + DEADLINE
    pairs = _zygote_sockets(zygote) - before
    while len(pairs) != 2 * len(ready) and time.monotonic() < deadline:
        time.sleep(0.02)
        pairs = _zygote_sockets(zygote) - before
    assert len(pairs) == 2 * len(ready)  # both ends of each worker's
    ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=4)
    assert {pid for pid, _ in ctx.return_values.values()} == ready
    deadline = time.monotonic() + DEADLINE
    while _zygote_sockets(zygote) & pairs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _zygote_sockets(zygote) & pairs == set()


@pytest.mark.version_neutral
@pytest.mark.parametrize("victim", ["caller", "zygote", "guard"])
def test_ready_workers_die_with_the_caller_the_zygote_and_its_guard(victim):
    # The guard (the zygote's parent, see docs/zygote.md) stands where the
    # warden stands for fork and spawn launches: the watcher between the
    # caller and the workers.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), "kill"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert driver.stdout is not None
        caller, zygote, *ready = map(int, driver.stdout.readline().split())
        assert len(ready) == 4
        guard = psutil.Process(zygote).ppid()
        assert guard != caller
        os.kill({"caller": caller, "zygote": zygote, "guard": guard}[victim], signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while not all(gone(pid) for pid in ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [pid for pid in ready if not gone(pid)] == []
    finally:
        kill_driver(driver)


@pytest.mark.version_neutral
def test_a_thousand_launches_with_refills_leave_nothing(no_background_refill):
    """The leak fixture checks what is left; here, that ready workers took
    part: each tenth launch finds some made ready by prefork()."""
    from_ready = 0
    for launch in range(1000):
        ready = prefork(2) if launch % 10 == 0 else set()
        ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=1)
        from_ready += ctx.return_values[0][0] in ready
    assert from_ready == 100


def test_each_rank_from_a_ready_worker_gets_its_own_environment(no_background_refill):
    """envs= (per-rank variables, as elastic ranks have): each rank has its
    own and no other's, ready or forked."""
    ready = prefork(2)
    envs = {rank: {"FASTSPAWN_TEST_RANK_VAR": f"rank {rank}"} for rank in (0, 2)}
    ctx = fastspawn.start_processes(
        workers.report_env, args=(["FASTSPAWN_TEST_RANK_VAR"],), nprocs=3, envs=envs
    )
    assert ctx.return_values == {
        0: {"FASTSPAWN_TEST_RANK_VAR": "rank 0"},
        1: {"FASTSPAWN_TEST_RANK_VAR": None},
        2: {"FASTSPAWN_TEST_RANK_VAR": "rank 2"},
    }
    assert set(ctx.pids()[:2]) == ready


def test_omp_num_threads_sizes_torchs_pool_in_ranks_from_ready_workers(
    no_background_refill, monkeypatch
):
    """torch read OMP_NUM_THREADS when the zygote imported it; a rank from
    a ready worker runs with the value its launch gives it (the caller's,
    set after prefork, or the rank's own), as a rank forked at launch does."""
    pytest.importorskip("torch")
    fastspawn.start_processes(workers.succeed, nprocs=1, preload=["torch"])  # the zygote's import
    ready = prefork(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    envs = {0: {"OMP_NUM_THREADS": "1"}, 3: {"OMP_NUM_THREADS": "2"}}
    ctx = fastspawn.start_processes(workers.torch_threads, nprocs=4, envs=envs, preload=["torch"])
    assert ctx.return_values == {0: ("1", 1), 1: ("3", 3), 2: ("3", 3), 3: ("2", 2)}
    assert set(ctx.pids()[:3]) == ready
