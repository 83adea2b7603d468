"""Defects a review found, each kept as a test: fds that reached the wrong
process, workers nobody could stop, waits that outlived their timeout."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import workers
from helpers import alive_after, gone, run_script

import fastspawn
from fastspawn import elastic
from fastspawn._launch import exiting
from fastspawn._warden import client as _warden_client
from fastspawn._worker import forked
from fastspawn._zygote import client

TESTS = os.path.dirname(os.path.abspath(__file__))


def zygote_fd_targets() -> list[str]:
    client.get_server()
    zygote = client.zygote_pid()
    targets = []
    for name in os.listdir(f"/proc/{zygote}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{zygote}/fd/{name}"))
        except OSError:
            pass
    return targets


def test_binary_rank_holds_only_its_own_stdio(tmp_path):
    # Rank 0 lists its fds once rank 1 is up: neither rank 1's log nor the
    # report channel may be among them.
    code = (
        "import os, time; time.sleep(0.5); fds = sorted(os.listdir('/proc/self/fd')); "
        "print(fds, [os.path.realpath(f'/proc/self/fd/{fd}') for fd in fds])"
    )
    ctx = elastic.start_processes(
        "fds",
        sys.executable,
        args={0: ("-c", code), 1: ("-c", "import time; time.sleep(1)")},
        envs={0: {}, 1: {}},
        log_dir=str(tmp_path),
        redirects=elastic.Std.ALL,
    )
    result = ctx.wait(60)
    assert result is not None and not result.is_failed(), result
    with open(tmp_path / "0" / "stdout.log") as f:
        fds = f.read().split("\n")[0]
    assert fds.startswith("['0', '1', '2', '3'] "), fds  # 3: the listing's own


def test_function_rank_holds_no_other_ranks_stdio(tmp_path):
    ctx = elastic.start_processes(
        "fds",
        workers.fd_targets,
        args={0: (0,), 1: (1,), 2: (2,)},
        envs={0: {}, 1: {}, 2: {}},
        log_dir=str(tmp_path),
        redirects=elastic.Std.ALL,
    )
    result = ctx.wait(60)
    assert result is not None and not result.is_failed(), result
    for rank, targets in result.return_values.items():
        logs = [t for t in targets if t.endswith(".log")]
        assert logs and all(f"/{rank}/std" in t for t in logs), (rank, targets)


def test_zygote_death_kills_what_binary_ranks_started(tmp_path):
    # Binary ranks lead sessions of their own; their children must still go
    # when the zygote is SIGKILLed, and wait() must not outlive its timeout.
    pid_file = tmp_path / "child"
    ctx = elastic.start_processes(
        "orphans",
        "/bin/sh",
        args={0: ("-c", f"sleep 300 & echo $! > {pid_file}; wait")},
        envs={0: {}},
        log_dir=os.devnull,
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline, "the rank did not start its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    client.get_server()
    os.kill(client.zygote_pid(), signal.SIGKILL)
    assert alive_after([child]) == []
    started = time.monotonic()
    result = ctx.wait(30)
    assert time.monotonic() - started < 25  # not the 60 s fallback
    assert result is not None and result.is_failed()


def test_failed_launch_leaves_no_payload_in_the_zygote():
    # Three launches whose preload fails: their payload memfds must not stay
    # open in the zygote, where every later worker would inherit them.
    for _ in range(3):
        with pytest.raises((RuntimeError, fastspawn.ProcessRaisedException)):
            fastspawn.start_processes(
                workers.succeed, ("secret",), nprocs=1, preload=["fastspawn_no_such_module"]
            )
    assert not [t for t in zygote_fd_targets() if "fastspawn-payload" in t]


def test_resource_tracker_fd_is_not_kept_per_launch():
    from multiprocessing import resource_tracker

    queue = multiprocessing_queue()
    try:
        tracker_pipe = os.readlink(f"/proc/self/fd/{resource_tracker._resource_tracker._fd}")
        for _ in range(6):
            fastspawn.start_processes(workers.succeed, nprocs=1)
        # Each launch brings the zygote the tracker's pipe, which it closes
        # once that launch's workers are forked: none stays, though on a
        # loaded machine the last launch's may take a moment to go.  Counted
        # by the pipe itself, not by the zygote's whole fd table, which its
        # idle-time work changes meanwhile.
        deadline = time.monotonic() + 30
        while (copies := zygote_fd_targets().count(tracker_pipe)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert copies == 0, f"the zygote holds {copies} copies of the resource tracker's pipe"
    finally:
        queue.close()


def multiprocessing_queue():
    # A spawn-context SimpleQueue starts multiprocessing's resource tracker,
    # whose fd every launch then passes on.
    import multiprocessing

    return multiprocessing.get_context("spawn").SimpleQueue()


def test_fork_worker_does_not_hold_the_zygote_control_socket():
    zygote = client.get_server()
    control = f"socket:[{os.fstat(zygote.control.fileno()).st_ino}]"
    ctx = fastspawn.start_processes(workers.fd_targets, nprocs=1, start_method="fork")
    assert control not in ctx.return_values[0]


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_failed_launch_leaves_nothing_in_its_group(tmp_path, start_method, how):
    # The last rank running starts a child, then fails.  With "fork" and
    # "spawn" that child (in the launch's process group) was killed only if
    # some other rank still ran when the failure was seen (the group's
    # SIGTERM reached it then); here none did, and it ran on, reparented to
    # init, once the join had raised.  (Found by test_chaos.py.)
    with pytest.raises(fastspawn.ProcessException, match="rank 1 fails last|SIGKILL"):
        fastspawn.start_processes(
            workers.fail_last_leaving_a_child,
            (str(tmp_path), how),
            nprocs=2,
            start_method=start_method,
        )
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not gone(child):
        os.kill(child, signal.SIGKILL)  # reparented to init: the leak check cannot see it
        pytest.fail(f"the failed rank's child {child} outlived the launch")


@pytest.mark.parametrize("start_method", ["zygote", "fork", "spawn", "forkserver"])
def test_worker_that_left_the_group_is_still_stopped(start_method):
    ctx = fastspawn.start_processes(
        workers.leave_group_or_raise, nprocs=2, join=False, start_method=start_method
    )
    with pytest.raises(fastspawn.ProcessRaisedException, match="rank 0 fails"):
        while not ctx.join(timeout=60, grace_period=0):
            pass
    assert ctx.processes[1].exitcode in (-signal.SIGTERM, -signal.SIGKILL)
    assert gone(ctx.pids()[1])


@pytest.mark.parametrize("start_method", ["zygote", "fork", "spawn", "forkserver"])
def test_every_rank_may_start_a_session(start_method):
    # No rank leads the launch's process group (rank 0 did, and its setsid()
    # raised PermissionError, which a spawned worker's never does).
    ctx = fastspawn.start_processes(workers.lead_a_session, nprocs=3, start_method=start_method)
    assert ctx.return_values == {0: True, 1: True, 2: True}
    if start_method in ("zygote", "forkserver"):
        # The group's anchor is reaped: the zygote has no child left but
        # its ready workers.
        zygote = client.zygote_pid()
        deadline = time.monotonic() + 10
        while _workers_of(zygote) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _workers_of(zygote) == []


@pytest.mark.parametrize("start_method", ["zygote", "fork", "spawn"])
@pytest.mark.parametrize("from_thread", [False, True])
def test_workers_and_helpers_start_with_no_signal_blocked(start_method, from_thread):
    # Launches hold signals (a Ctrl-C must not come between a worker's start
    # and its record); what they start must not inherit that mask, or it
    # would never see a SIGTERM (and the zygote no PR_SET_PDEATHSIG).
    fastspawn.stop_zygote()  # its start is under test too
    result: list[fastspawn.ProcessContext] = []
    if from_thread:  # through fastspawn's launcher thread
        thread = threading.Thread(
            target=lambda: result.append(
                fastspawn.start_processes(
                    workers.blocked_signals, nprocs=2, start_method=start_method
                )
            )
        )
        thread.start()
        thread.join(60)
    else:
        result.append(
            fastspawn.start_processes(workers.blocked_signals, nprocs=2, start_method=start_method)
        )
    assert result[0].return_values == {0: 0, 1: 0}
    helpers = client.helper_processes()[0] | _warden_client.warden_process()[0]
    assert helpers or start_method != "zygote"
    assert {pid: workers.blocked_signals_of(pid) for pid in helpers} == dict.fromkeys(helpers, 0)


@pytest.mark.parametrize("start_method", ["zygote", "fork", "spawn"])
def test_a_workers_own_launch_passes_on_its_signal_mask(start_method):
    # A "fork" worker was forked inside the launch's held-signals block,
    # and its own launches gave their workers the caller's mask, not its.
    ctx = fastspawn.start_processes(
        workers.mask_seen_by_nested_spawn, nprocs=1, start_method=start_method
    )
    assert ctx.return_values == {0: 1 << (signal.SIGUSR1 - 1)}


def test_a_ctrl_c_during_fastspawns_first_use_comes_once_its_import_is_whole(tmp_path):
    # fastspawn's public names load on first use.  A signal raised just as
    # that import begins (the import system asked for the module) must
    # come as KeyboardInterrupt once the module is whole: from inside it,
    # Python 3.10 turned one into a RuntimeError where it landed in a
    # class's __set_name__ (platform's), and the module was left unimported.
    done = run_script(
        tmp_path / "main.py",
        """
        import signal, sys
        import fastspawn

        class Interrupter:
            def find_spec(self, name, path=None, target=None):
                if name == "fastspawn._launch.api":
                    signal.raise_signal(signal.SIGUSR1)
                return None

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGUSR1, interrupt)
        sys.meta_path.insert(0, Interrupter())
        try:
            fastspawn.start_processes
        except KeyboardInterrupt:
            print("interrupted", "fastspawn._launch.api" in sys.modules)
        print(fastspawn.start_processes.__module__)
        """,
    )
    assert done.stdout.split() == ["interrupted", "True", "fastspawn._launch.api"], done.stderr


def _children(pid: int) -> list[str]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return f.read().split()


def _workers_of(zygote: int) -> list[str]:
    """The zygote's children but its ready workers and spare group."""
    ahead = {str(pid) for pid in client.held_ahead(zygote)}
    return [pid for pid in _children(zygote) if pid not in ahead]


@pytest.mark.parametrize("start_method", ["zygote", "fork", "spawn"])
def test_interrupt_anywhere_in_a_launch_leaves_nothing(tmp_path, start_method):
    # KeyboardInterrupt (from an interval timer, at random points) raised
    # between a worker's start and its record used to leave it running,
    # unknown to every cleanup, with its pidfd open; and at the zygote's
    # start, a zygote no one held.
    done = run_script(
        tmp_path / "main.py",
        """
        import os, random, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        import fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client

        def ours():
            kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
            helpers = client.helper_processes()[0] | _warden_client.warden_process()[0]
            return sorted(int(k) for k in kids if int(k) not in helpers)

        if __name__ == "__main__":
            method = sys.argv[2]
            signal.signal(signal.SIGALRM, signal.default_int_handler)
            fds = len(os.listdir("/proc/self/fd"))
            interrupted = 0
            for i in range(30):
                if method == "zygote" and i % 3 == 0:
                    fastspawn.stop_zygote()  # interrupt its start too
                signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.03))
                try:
                    fastspawn.start_processes(
                        workers.sleep_for, (1.0,), nprocs=8, start_method=method)
                except KeyboardInterrupt:
                    interrupted += 1
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            fastspawn.stop_zygote()
            time.sleep(0.2)
            extra = len(os.listdir("/proc/self/fd")) - fds - len(_warden_client.warden_process()[1])
            print(interrupted > 0, ours(), extra)
        """,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, start_method],
    )
    assert done.stdout == "True [] 0\n", done.stderr[-3000:]


def test_forked_child_leaves_the_parents_workers_alone():
    # A child forked from the caller runs the atexit hooks when it exits:
    # they must not join, read or unwatch the parent's workers.
    ctx = fastspawn.start_processes(workers.sleep_for, (1.0,), nprocs=2, join=False)
    pid = os.fork()
    if pid == 0:
        try:
            mine = bool(exiting.live_contexts)  # the parent's must not be ours
            exiting.at_exit()
            os._exit(1 if mine else 0)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    while not ctx.join(timeout=60):
        pass
    assert ctx.return_values == {0: None, 1: None}


def test_ctrl_c_while_the_zygote_prepares_a_launch_leaves_nothing(tmp_path, monkeypatch):
    # The interrupt lands while the caller waits for the workers' pidfds
    # (the zygote imports a slow module first); the workers it forks after
    # that must not run on untracked.  The leak fixture checks.
    (tmp_path / "fastspawn_slow_preload.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fastspawn.start_processes(workers.succeed, nprocs=1)  # the zygote is up
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fastspawn.start_processes(
                workers.sleep_forever, nprocs=4, preload=["fastspawn_slow_preload"]
            )
    finally:
        timer.cancel()
    zygote = client.zygote_pid()
    deadline = time.monotonic() + 10
    while _workers_of(zygote):
        assert time.monotonic() < deadline, f"workers left: {_workers_of(zygote)}"
        time.sleep(0.05)


def test_out_of_fds_gives_a_clear_error_and_leaves_nothing():
    # Run apart: the fd limit is the driver's, and so its zygote's.
    code = textwrap.dedent(
        """
        import os, resource, sys, time
        import fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client
        fastspawn.start_processes(workers.succeed, nprocs=1)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(90)]
        try:
            fastspawn.start_processes(workers.sleep_forever, nprocs=60)
        except Exception as exc:
            print("error:", type(exc).__name__, exc)
        else:
            print("error: none")
        for fd in held:
            os.close(fd)
        zygote = client.zygote_pid()
        deadline = time.monotonic() + 10
        while True:
            with open(f"/proc/{zygote}/task/{zygote}/children") as f:
                left = set(map(int, f.read().split())) - client.held_ahead(zygote)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print("left:", len(left))
        """
    )

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, *sys.path]))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    error = done.stdout.split("error:", 1)[1].split("\nleft:")[0]
    assert "ulimit -n" in error or "Too many open files" in error, done.stdout + done.stderr
    assert "left: 0" in done.stdout, done.stdout + done.stderr


def test_deleted_cwd_is_named():
    here = os.getcwd()
    gone_dir = tempfile.mkdtemp()
    os.chdir(gone_dir)
    try:
        os.rmdir(gone_dir)
        for method in ("zygote", "spawn"):
            with pytest.raises(FileNotFoundError, match="current directory was deleted"):
                fastspawn.start_processes(workers.succeed, nprocs=1, start_method=method)
    finally:
        os.chdir(here)


def test_large_environment_reaches_the_workers(monkeypatch):
    # More than a control message holds (~200 KB): the caller's environment
    # and per-rank envs travel in the payload memfd.
    monkeypatch.setenv("FASTSPAWN_TEST_BIG", "c" * 150_000)
    envs = {0: {"BIG": "x" * 150_000}, 1: {"BIG": "y"}}
    ctx = fastspawn.start_processes(
        workers.report_env, (["BIG", "FASTSPAWN_TEST_BIG"],), nprocs=2, envs=envs
    )
    assert ctx.return_values[0] == {"BIG": "x" * 150_000, "FASTSPAWN_TEST_BIG": "c" * 150_000}
    assert ctx.return_values[1]["BIG"] == "y"


def test_each_worker_gets_one_sigterm(tmp_path):
    # After the group's killpg, only workers that left the group get the
    # signal one by one: a handler that takes its time must not be cut short
    # by a second SIGTERM.  (256 ranks: with few, both arrive before the
    # first handler runs and merge.)
    ctx = fastspawn.start_processes(
        workers.count_sigterms, (str(tmp_path),), nprocs=256, join=False
    )
    with pytest.raises(fastspawn.ProcessRaisedException, match="rank 0 fails"):
        while not ctx.join(timeout=60):
            pass
    counts = {p.name: p.read_text().count("SIGTERM") for p in tmp_path.iterdir()}
    assert counts and set(counts.values()) == {1}, counts


@pytest.mark.parametrize("start_method", ["zygote", "fork"])
def test_contexts_joined_through_their_processes_are_not_kept(start_method):
    before = len(exiting.live_contexts)
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        ctx = fastspawn.start_processes(
            workers.succeed, nprocs=2, join=False, start_method=start_method
        )
        for proc in ctx.processes:
            proc.join()
    del ctx, proc  # as a caller that moves on would: the fds go with them
    import gc

    gc.collect()
    assert len(exiting.live_contexts) == before
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


def test_a_handled_signal_does_not_stop_later_contexts(tmp_path):
    # The caller catches SignalException and closes that context; a context
    # started afterwards is left to finish at exit, not closed with it.
    marker = tmp_path / "finished"
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from fastspawn import elastic
        if __name__ == "__main__":
            first = elastic.start_processes(
                "a", "/bin/sleep", {{0: ("30",)}}, {{0: {{}}}}, os.devnull)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except elastic.SignalException as e:
                first.close(e.sigval)
            elastic.start_processes(
                "b", "/bin/sh", {{0: ("-c", "sleep 1.5; touch {marker}")}}, {{0: {{}}}},
                os.devnull)
        """
    )

    script = tmp_path / "driver.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.exists(), done.stderr


def test_more_fds_than_one_message_carries():
    # 260 connections: more than the 253 fds the kernel passes in one message
    # (a model shared with share_memory() carries one per tensor).
    import multiprocessing

    pipes = [multiprocessing.get_context("spawn").Pipe(duplex=False) for _ in range(260)]
    try:
        writers = [w for _, w in pipes]
        fastspawn.start_processes(workers.write_to_all, (writers,), nprocs=1)
        assert [r.recv() for r, _ in pipes] == [0] * 260
    finally:
        for r, w in pipes:
            r.close()
            w.close()


def test_argument_in_a_reference_cycle_does_not_keep_its_fd_open():
    import multiprocessing

    reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
    try:
        fastspawn.start_processes(workers.touch_arg, (workers.SelfReferring(writer),), nprocs=1)
        writer.close()
        assert reader.recv() == 0
        # No one else holds the writing end: not the zygote, nor its later workers.
        fastspawn.start_processes(workers.succeed, nprocs=1)
        assert reader.poll(10)
        with pytest.raises(EOFError):
            reader.recv()
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("start_method", ["zygote", "fork"])
def test_worker_waits_for_the_launches_it_left_unjoined(tmp_path, start_method):
    fastspawn.start_processes(
        workers.start_inner_and_return,
        (str(tmp_path), start_method),
        nprocs=1,
        start_method=start_method,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner0", "inner1"]


def test_return_values_are_not_kept_twice():
    ctx = fastspawn.start_processes(workers.big_result, (1 << 20,), nprocs=2)
    assert len(ctx.return_values[1]) == 1 << 20
    assert ctx._receiver.reports.results == {}


def test_join_from_two_threads_at_once():
    ctx = fastspawn.start_processes(workers.raise_on, (1, 30.0), nprocs=3, join=False)
    outcomes: list[BaseException] = []

    def joiner() -> None:
        try:
            while not ctx.join(timeout=20):
                pass
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            outcomes.append(exc)

    threads = [threading.Thread(target=joiner) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 2
    assert all(isinstance(exc, fastspawn.ProcessException) for exc in outcomes), outcomes
    assert any("legitimate exception from process 1" in str(exc) for exc in outcomes)


def test_worker_exit_waits_for_its_threads_before_its_launches(tmp_path):
    outcome = tmp_path / "outcome"
    fastspawn.start_processes(workers.join_inner_in_a_thread, (str(outcome),), nprocs=1)
    assert outcome.read_text() == "INNER OK [(0, 0), (1, 1)]"


@pytest.mark.version_neutral  # waits seconds by design, the same on every version
def test_join_timeout_holds_while_another_thread_joins():
    ctx = fastspawn.start_processes(workers.sleep_for, (3.0,), nprocs=2, join=False)
    other = threading.Thread(target=ctx.join)
    other.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        assert ctx.join(timeout=0.1) is False
        assert time.monotonic() - started < 2.0  # not the other join's 3 s
    finally:
        other.join(60)
    assert ctx.join() is True


def test_value_that_fails_to_unpickle_fails_when_read_not_in_join():
    # torch ignores return values, so its users' joins must not fail on one
    # (a class only the workers can import); reading it raises, every time.
    ctx = fastspawn.start_processes(workers.return_unrebuildable, nprocs=2)
    assert ctx.join() is True
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot be rebuilt here"):
            ctx.return_values  # noqa: B018 - the read is what raises
    assert ctx._values == {1: 1}  # the other rank's value is kept


def test_return_values_are_unpickled_only_when_read():
    ctx = fastspawn.start_processes(workers.big_result, (1 << 20,), nprocs=2)
    assert ctx._values == {} and len(ctx._pickled) == 2
    assert len(ctx.return_values[0]) == 1 << 20
    assert ctx._pickled == {}


@pytest.mark.parametrize("code, status", [(-1, 255), (-9, 247), (-100, 156), (256 + 3, 3)])
def test_negative_exit_codes_are_exit_codes(start_method, code, status):
    # sys.exit(-9) exits 247 (the status is taken modulo 256), as in any
    # Python process; never "killed by signal 9", and never a worker that
    # returns into the code that forked it.
    before = os.getpid()
    ctx = fastspawn.start_processes(
        workers.exit_with, (code,), nprocs=2, join=False, start_method=start_method
    )
    message = f"process [01] terminated with exit code {status}$"
    with pytest.raises(fastspawn.ProcessExitedException, match=message) as info:
        while not ctx.join(timeout=60):
            pass
    assert info.value.exit_code == status and info.value.signal_name is None
    assert os.getpid() == before


def test_worker_that_closed_its_report_channel_exits_by_its_own_code(start_method, capfd):
    ctx = fastspawn.start_processes(
        workers.close_inherited_fds_and_return, nprocs=2, join=False, start_method=start_method
    )
    while not ctx.join(timeout=60):
        pass
    assert ctx.return_values == {}
    if start_method == "spawn":  # else sys.stderr is the zygote's, or went with the fds
        assert "cannot report to its launcher" in capfd.readouterr().err


def test_workers_take_the_callers_settings_at_launch(start_method):
    # The zygote started before the caller changed its umask, affinity and
    # limits (an earlier launch); a spawn child would see the new ones, and
    # so must a zygote worker (a 0644 file where the caller asked for 0600
    # would be a leak).
    fastspawn.start_processes(workers.succeed, nprocs=1, start_method=start_method)
    import resource

    mask = os.umask(0o077)
    cpus = os.sched_getaffinity(0)
    core = resource.getrlimit(resource.RLIMIT_CORE)
    try:
        os.sched_setaffinity(0, {min(cpus)})
        resource.setrlimit(resource.RLIMIT_CORE, (0, core[1]))
        ctx = fastspawn.start_processes(
            workers.process_settings, nprocs=2, start_method=start_method
        )
    finally:
        os.umask(mask)
        os.sched_setaffinity(0, cpus)
        resource.setrlimit(resource.RLIMIT_CORE, core)
    for rank in (0, 1):
        assert ctx.return_values[rank] == (0o077, [min(cpus)], (0, core[1]), "")


def test_a_worker_reading_stdin_gets_eof(start_method):
    with pytest.raises(fastspawn.ProcessRaisedException, match="EOFError"):
        fastspawn.start_processes(workers.read_stdin, nprocs=1, start_method=start_method)


def test_workers_write_to_the_callers_current_stdout(start_method, capfd):
    # capfd points fds 1 and 2 elsewhere for this test only, long after the
    # zygote started: its workers must follow, as spawned ones do.
    fastspawn.start_processes(
        workers.print_marker, ("marker-7",), nprocs=2, start_method=start_method
    )
    captured = capfd.readouterr()

    def ours(text: str) -> list[str]:  # not what other threads printed meanwhile
        return sorted(line for line in text.splitlines() if line.startswith("marker-7"))

    assert ours(captured.out) == ["marker-7 0", "marker-7 1"], captured
    assert ours(captured.err) == ["marker-7 err 0", "marker-7 err 1"], captured


def test_child_forked_while_a_zygote_starts_can_start_its_own():
    # Another thread holds the lock across a zygote's start; a fork at that
    # moment must give the child a free lock, not one held for ever.
    with client._server_lock:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if client._server_lock.acquire(timeout=5) else 1)
            finally:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_workers_children_inherit_no_report_channel(start_method):
    # A grandchild holding the channel could write reports in a rank's name.
    ctx = fastspawn.start_processes(
        workers.inheritable_sockets, nprocs=1, start_method=start_method
    )
    assert ctx.return_values == {0: []}


def test_context_dropped_after_its_workers_were_joined_frees_its_fds():
    import gc

    gc.disable()  # what is freed must be freed without a cyclic collection
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            ctx = fastspawn.start_processes(workers.succeed, nprocs=2, join=False)
            for proc in ctx.processes:
                proc.join(60)
            del ctx, proc
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        gc.enable()


def test_signal_handlers_the_main_module_sets_reach_workers_not_the_zygote(tmp_path):
    # At import (in the zygote too, as __mp_main__) the script sets a SIGTERM
    # handler and ignores SIGCHLD. Workers must get the handler, as spawned
    # ones do, and the zygote must keep reaping and reporting its workers.
    script = tmp_path / "handlers.py"
    done = run_script(
        script,
        """
            import signal, sys, time
            import fastspawn

            def on_term(signum, frame):
                pass

            signal.signal(signal.SIGTERM, on_term)
            if __name__ != "__main__":
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)

            def report(rank):
                time.sleep(0.3)
                return signal.getsignal(signal.SIGTERM).__name__

            if __name__ == "__main__":
                ctx = fastspawn.start_processes(report, nprocs=2, start_method="zygote")
                print(sorted(ctx.return_values.values()))
                ctx = fastspawn.start_processes(report, nprocs=2, start_method="zygote")
                print(sorted(ctx.return_values.values()))
            """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['on_term', 'on_term']"] * 2


@pytest.mark.parametrize("start_method", ["zygote", "spawn", "forkserver"])
def test_atexit_handlers_a_worker_registers_run_at_its_exit(tmp_path, start_method):
    # As in a spawned interpreter: a metrics flusher or a temporary directory
    # left to exit-time cleanup must not be skipped by a zygote worker.
    ctx = fastspawn.start_processes(
        workers.register_atexit_and_tempdir,
        (str(tmp_path),),
        nprocs=2,
        start_method=start_method,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit0", "atexit1"]
    assert all(not os.path.exists(d) for d in ctx.return_values.values())


def test_a_fork_workers_atexit_handlers_are_multiprocessings(tmp_path):
    # multiprocessing's fork children run the handlers they register from
    # Python 3.13 on (CPython gh-83856), none before; never the caller's.
    caller_marker = tmp_path / "atexit-of-the-caller"
    handler = caller_marker.touch
    atexit.register(handler)
    try:
        fastspawn.start_processes(
            workers.register_atexit_and_tempdir, (str(tmp_path),), nprocs=2, start_method="fork"
        )
    finally:
        atexit.unregister(handler)
    expected = ["atexit0", "atexit1"] if sys.version_info >= (3, 13) else []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("atexit")) == expected


EXIT_WORK = {
    "mp_finalizer": "ran",
    "is_exiting": "True",  # the exit function ran first, as Process._bootstrap runs it
    "executor": "ran",
    "late_finalizer": "ran",
    "mp_logging": "process shutting down\n",
}


@pytest.fixture
def exit_hook_in_the_zygote():
    """A zygote with weakref's exit hook registered (as torch's has): a
    finalizer a worker makes reaches its exit only through the worker's
    own finalizers.  No ready workers but those a test asks for."""
    fastspawn.preload(["exit_finalizer_probe"])
    yield
    fastspawn.prefork(0)


@pytest.mark.parametrize("ranks_from", ["ready", "forked"])
@pytest.mark.parametrize("what", sorted(EXIT_WORK))
def test_what_a_worker_leaves_to_its_exit_is_done(
    tmp_path, what, ranks_from, exit_hook_in_the_zygote
):
    # A worker's exit runs multiprocessing's exit function and threading's
    # shutdown only where they have something to do: a finalizer, a thread
    # to join (one that makes a finalizer meanwhile included), a logger,
    # an atexit handler that sees their state.
    fastspawn.prefork(1 if ranks_from == "ready" else 0, refill=False)
    fastspawn.start_processes(workers.leave_work_for_the_exit, (str(tmp_path), what), nprocs=1)
    assert (tmp_path / what).read_text() == EXIT_WORK[what]


# Not late_finalizer: weakref.finalize's exit hook is an atexit handler,
# run in a fork worker (from 3.13) only if the caller had not registered it
# before the fork, as in multiprocessing's fork children.
@pytest.mark.parametrize("what", sorted(set(EXIT_WORK) - {"late_finalizer"}))
def test_what_a_fork_worker_leaves_to_its_exit_is_done(tmp_path, what):
    fastspawn.start_processes(
        workers.leave_work_for_the_exit, (str(tmp_path), what), nprocs=1, start_method="fork"
    )
    if what != "is_exiting":
        assert (tmp_path / what).read_text() == EXIT_WORK[what]
    elif sys.version_info < (3, 13):
        # As multiprocessing's fork children: no atexit handler before 3.13,
        assert not (tmp_path / what).exists()
    else:
        # and from 3.13 the worker's before multiprocessing's exit function.
        assert (tmp_path / what).read_text() == "False"


def test_the_zygotes_atexit_handlers_do_not_run_in_its_workers(tmp_path, monkeypatch):
    # A module the zygote imported registered a handler there; a worker must
    # not run it (it would, say, remove a directory the zygote made, once
    # per worker).
    marker = tmp_path / "ran-in-a-worker"
    (tmp_path / "zygote_atexit_probe.py").write_text(
        textwrap.dedent(
            f"""
            import atexit, os
            _me = os.getpid()
            atexit.register(lambda: os.getpid() != _me and open({str(marker)!r}, "w").close())
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fastspawn.start_processes(workers.succeed, nprocs=2, preload=["zygote_atexit_probe"])
    assert not marker.exists()


def test_the_zygotes_exit_finalizers_do_not_run_in_its_workers(tmp_path, monkeypatch):
    # A TemporaryDirectory the zygote made (at a module's import) is removed
    # at exit by a weakref.finalize: not by the first worker to exit.
    (tmp_path / "zygote_tempdir_probe.py").write_text(
        textwrap.dedent(
            f"""
            import tempfile
            kept = tempfile.TemporaryDirectory(dir={str(tmp_path)!r})
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ctx = fastspawn.start_processes(
        workers.module_attribute,
        ("zygote_tempdir_probe", "kept"),
        nprocs=2,
        preload=["zygote_tempdir_probe"],
    )
    made = ctx.return_values[0]
    assert os.path.isdir(made)


def test_workers_of_a_caller_without_stdin(tmp_path):
    # Started with fd 0 closed, the caller has sys.stdin None, and a Pipe it
    # makes can land on fd 0: workers must run, and a fork worker must keep
    # that Pipe end, not get /dev/null in its place.
    script = tmp_path / "nostdin.py"
    done = run_script(
        script,
        """
            import multiprocessing, sys
            import fastspawn

            def work(rank):
                return rank

            def send(rank, conn):
                conn.send(("hello", rank))

            if __name__ == "__main__":
                assert sys.stdin is None
                # Made first, while fd 0 is free: later, a helper's fd (the
                # zygote client's thread opens one when it gets to it) may
                # hold 0, and where the Pipe lands depends on the timing.
                theirs, ours = multiprocessing.Pipe()
                for method in ("zygote", "fork", "spawn"):
                    ctx = fastspawn.start_processes(work, nprocs=2, start_method=method)
                    print(method, ctx.return_values)
                print("pipe on fd", theirs.fileno())
                fastspawn.start_processes(send, (theirs,), nprocs=1, start_method="fork")
                print("got", ours.recv())
            """,
        command=["/bin/sh", "-c", f'exec "{sys.executable}" "{script}" <&-'],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "zygote {0: 0, 1: 1}",
        "fork {0: 0, 1: 1}",
        "spawn {0: 0, 1: 1}",
        "pipe on fd 0",
        "got ('hello', 0)",
    ]


def test_fork_worker_while_another_thread_reads_stdin(tmp_path):
    # The reading thread holds sys.stdin's lock at the fork; the worker must
    # not wait for it (closing the inherited sys.stdin would, for ever).
    script = tmp_path / "reader.py"
    reader, writer = os.pipe()
    try:
        done = run_script(
            script,
            """
                import sys, threading, time
                import fastspawn

                def work(rank):
                    return rank

                if __name__ == "__main__":
                    threading.Thread(target=sys.stdin.readline, daemon=True).start()
                    time.sleep(0.2)
                    ctx = fastspawn.start_processes(work, nprocs=1, start_method="fork", join=False)
                    print(ctx.join(timeout=30))
                """,
            stdin=reader,
        )
    finally:
        os.close(reader)
        os.close(writer)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True"]


def _exit_beside_a_daemon_launch(tmp_path, start_method: str, work: float, handover: float) -> None:
    """Run a script whose main thread exits once the two workers a daemon
    thread launched are running (each sleeps ``work`` seconds, then says it
    is done), that launch's context made ``handover`` seconds late; check
    the exit waited for both, with no traceback."""
    done = run_script(
        tmp_path / "daemon_launch.py",
        f"""
            import os, threading, time
            import fastspawn
            from fastspawn._launch import api

            def work(rank):
                open(os.path.join({str(tmp_path)!r}, f"started-{{rank}}"), "w").close()
                time.sleep({work!r})
                os.write(1, f"worker {{rank}} done\\n".encode())

            made = api.ProcessContext

            def made_late(*args, **kwargs):
                time.sleep({handover!r})  # the main thread may be exiting meanwhile
                return made(*args, **kwargs)

            if __name__ == "__main__":
                api.ProcessContext = made_late
                threading.Thread(
                    target=fastspawn.start_processes,
                    args=(work,),
                    kwargs={{"nprocs": 2, "start_method": {start_method!r}}},
                    daemon=True,
                ).start()
                # Exit once both workers run (a loaded machine may take
                # seconds to start spawn's).
                deadline = time.monotonic() + 60
                while not all(
                    os.path.exists(os.path.join({str(tmp_path)!r}, f"started-{{rank}}"))
                    for rank in (0, 1)
                ):
                    assert time.monotonic() < deadline, "the workers did not start"
                    time.sleep(0.05)
            """,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert sorted(done.stdout.splitlines()) == ["worker 0 done", "worker 1 done"]


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_exit_while_a_daemon_thread_joins_leaves_its_fds_alone(tmp_path, start_method):
    # The main thread exits while a daemon thread blocks in a join: the exit
    # hook waits for the (non-daemonic) workers without closing the fds
    # that join is using (it raised EBADF or ChildProcessError there).  The
    # workers outlast the exit hook's 1 s wait for the join.
    _exit_beside_a_daemon_launch(tmp_path, start_method, work=2.0, handover=0.0)


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_exit_waits_for_a_launch_another_thread_has_under_way(tmp_path, start_method):
    # The main thread exits after another thread's workers started but
    # before that launch made their context (slowed here to make it
    # certain; a loaded machine did it 3 times in 80): the exit hook waits
    # for the handover, then for the workers, as for any launch.  It found
    # no context and stopped the zygote, killing them.
    _exit_beside_a_daemon_launch(tmp_path, start_method, work=1.0, handover=1.5)


def test_a_signal_at_a_zygote_ranks_birth_ends_that_rank_alone(tmp_path):
    # A SIGINT sent as start() returns can land before the forked rank has
    # its own handling.  It ends that rank (exit code 1, KeyboardInterrupt;
    # or -2), as it would a process forked at the start.  It was let
    # through as the fork loop returned, and the KeyboardInterrupt unwound
    # the rank into the zygote's own code, which reported the launch
    # failed and shut down as the zygote: the rank killed itself and every
    # other worker of the zygote (exit -9; 37 of 80 starts here).  Ready
    # workers off: every start forks.
    script = tmp_path / "birth.py"
    done = run_script(
        script,
        """
            import os, signal, time
            import fastspawn

            def nap():
                # Short sleeps: a signal Python takes just before one starts
                # is handled when it ends (CPython checks only between calls).
                while True:
                    time.sleep(0.05)

            if __name__ == "__main__":
                ctx = fastspawn.get_context("fastspawn")
                other = ctx.Process(target=nap)
                other.start()
                codes = set()
                for _ in range(40):
                    process = ctx.Process(target=nap)
                    process.start()
                    os.kill(process.pid, signal.SIGINT)
                    process.join(60)
                    if process.exitcode is None:
                        process.kill()
                        process.join()
                    codes.add(process.exitcode)
                alive = other.is_alive()
                other.kill()
                other.join()
                print(alive, *codes)
            """,
        env={**os.environ, "FASTSPAWN_READY": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    alive, *codes = done.stdout.split()
    assert alive == "True", done.stdout
    assert {int(code) for code in codes} <= {1, -signal.SIGINT}, done.stdout


def test_a_fork_rank_never_returns_into_the_callers_code(monkeypatch):
    # A handler of the caller's that raises can run in a "fork" rank as it
    # lets its signals through, before the worker's own handling starts
    # (elastic's SignalException, for a stop sent right after another rank
    # failed).  The rank must end there, not unwind into the caller's code
    # and go on running it: here, the rest of the test session.
    def raise_early(*args, **kwargs):
        raise RuntimeError("raised before the worker took over")

    monkeypatch.setattr(forked, "forked_child", raise_early)
    me = os.getpid()
    try:
        ctx = fastspawn.start_processes(workers.succeed, start_method="fork", join=False)
    except BaseException:
        if os.getpid() != me:
            os._exit(99)  # a rank unwound into this test
        raise
    with pytest.raises(fastspawn.ProcessExitedException, match="exit code 1$"):
        while not ctx.join(timeout=60):
            pass


def test_a_ctrl_c_as_pidfds_arrive_loses_none(monkeypatch):
    # A signal landing as recvmsg() returns a launch's pidfds (the zygote
    # sends them over the channel) used to raise KeyboardInterrupt with the
    # fds in a discarded tuple: open, known to nobody.  The signal is raised
    # here at exactly that moment; the fds must reach the reports.
    from fastspawn._wire import channel as _channel

    real_recv_fds = _channel.recv_fds

    def recv_then_signal(*args):
        got = real_recv_fds(*args)
        signal.raise_signal(signal.SIGUSR1)  # as if it had come just then
        return got

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    rx_sock, tx = _channel.channel_pair()
    receiver = _channel.Receiver(rx_sock)
    pidfd = os.pidfd_open(os.getpid())
    try:
        header = _channel.HEADER.pack(0, _channel.PIDS, _channel.LAST)
        body = _channel.pack_statuses([os.getpid()])
        tx.sendmsg(
            [header + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", pidfd))]
        )
        monkeypatch.setattr(_channel, "recv_fds", recv_then_signal)
        with pytest.raises(KeyboardInterrupt):
            receiver.read_blocking(10)
        received = receiver.reports.pids[0]
        assert received[0] == os.getpid() and os.fstat(received[1])  # recorded, open
        os.close(received[1])
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(pidfd)
        tx.close()
        receiver.close()


def test_a_wait_on_the_report_channel_reads_everything_queued_by_then():
    # Ranks report while the caller waits for their pidfds: once woken, the
    # caller reads all that is queued in one step, not one message a wake.
    from fastspawn._wire import channel as _channel

    rx_sock, tx = _channel.channel_pair()
    receiver = _channel.Receiver(rx_sock)
    try:
        tx.send(_channel.HEADER.pack(-1, _channel.TAKEN, _channel.LAST))
        group = _channel.pack_statuses([4321])
        tx.send(_channel.HEADER.pack(-1, _channel.GROUP, _channel.LAST) + group)
        exits = _channel.pack_statuses([0, 0, 1, 3])
        tx.send(_channel.HEADER.pack(-1, _channel.EXIT, _channel.LAST) + exits)
        assert receiver.read_blocking(10)
        reports = receiver.reports
        assert reports.taken and reports.group == 4321 and reports.exits == {0: 0, 1: 3}
        assert not receiver.drain()  # nothing left
        tx.close()
        assert not receiver.read_blocking(10)  # the EOF: nothing read
        assert reports.eof
    finally:
        tx.close()
        receiver.close()
