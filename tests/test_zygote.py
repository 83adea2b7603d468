"""The zygote start method: orphan safety to the last grandchild, preload,
one message per launch, and a clean, thread-free worker state."""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import workers
from helpers import KILL_BOUND_S, alive_after, gone, kill_driver, run_script

import fastspawn
from fastspawn._os import hugepages, oscall
from fastspawn._wire import payload as wire_payload
from fastspawn._wire import pickling
from fastspawn._zygote import client, protocol
from fastspawn._zygote import server as zygote_server
from fastspawn._zygote.launch import environ_is

TESTS = os.path.dirname(os.path.abspath(__file__))

DRIVER = """
import multiprocessing, sys, time, fastspawn, workers
from fastspawn._warden import client as _warden_client
from fastspawn._zygote import client
queue = multiprocessing.get_context("spawn").SimpleQueue()
ctx = fastspawn.start_processes(
    workers.start_sleeper_child, (queue, sys.argv[1] == "daemons"), nprocs=16, join=False,
    start_method="zygote")
pids = []
for _ in range(16):
    pids.extend(queue.get())
(guard,) = client.helper_processes()[0] - {client.zygote_pid()}
print(guard, client.zygote_pid(), " ".join(map(str, pids)), flush=True)
try:
    while not ctx.join():
        pass
except Exception as exc:
    print("raised", type(exc).__name__, exc, flush=True)
else:
    print("returned", flush=True)
time.sleep(600)
"""


def start_driver(daemons: bool = False) -> tuple[subprocess.Popen[str], int, int, list[int]]:
    """A caller whose 16 zygote workers each have a sleeping child (and with
    ``daemons``, one more in a session of its own): (driver, the zygote's
    guard, the zygote, every worker's and child's pid)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(DRIVER), "daemons" if daemons else "plain"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert driver.stdout is not None
    guard, zygote, *pids = (int(word) for word in driver.stdout.readline().split())
    assert len(pids) == (48 if daemons else 32)
    assert not any(gone(pid) for pid in pids)
    return driver, guard, zygote, pids


@pytest.mark.parametrize("daemons", [False, True])
def test_sigkill_of_caller_kills_workers_and_their_children(daemons):
    driver, guard, zygote, pids = start_driver(daemons)
    kill_driver(driver)
    alive = alive_after(pids + [guard, zygote])
    assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the caller: {alive}"


# The zygote proper (the workers' parent), and the process the caller
# started, which stays behind as its guard: SIGKILL of either leaves nothing,
# daemons (a worker's child in a session of its own) included.
@pytest.mark.parametrize("victim", ["zygote", "guard"])
@pytest.mark.parametrize("daemons", [False, True])
def test_sigkill_of_zygote_kills_workers_and_their_children(victim, daemons):
    driver, guard, zygote, pids = start_driver(daemons)
    try:
        os.kill(zygote if victim == "zygote" else guard, signal.SIGKILL)
        alive = alive_after(pids + [guard, zygote])
        assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the {victim}: {alive}"
        assert driver.stdout is not None
        line = driver.stdout.readline()  # the caller raised rather than hung
        assert line.startswith("raised ProcessExitedException"), line
    finally:
        kill_driver(driver)


def _launch_importing(module: str, outcome: list[BaseException]) -> threading.Thread:
    """A thread, not started, that launches two ranks with an argument that
    imports ``module`` where it is unpickled; what the launch raises goes to
    ``outcome``."""

    def launch() -> None:
        try:
            fastspawn.start_processes(
                workers.module_name, (workers.ImportedWhereUnpickled(module),), nprocs=2
            )
        except BaseException as exc:
            outcome.append(exc)

    return threading.Thread(target=launch)


@pytest.mark.parametrize("ready", [False, True], ids=["forked", "ready_workers"])
def test_sigkill_of_guard_while_the_zygote_prepares_a_launch(tmp_path, monkeypatch, ready):
    # The guard's death reaches the zygote as SIGTERM, raised as SystemExit
    # wherever it runs.  Landing in a launch's unpickling (an import), it
    # passed for the payload's error: the zygote served on, the launch's
    # workers reported that SystemExit as theirs, and the caller's watcher
    # SIGKILLed the zygote 5 s later, leaving the workers' daemons to init.
    # Forked ranks wait for that unpickling: the launch fails.  Ready
    # workers take their ranks first (each unpickles, importing the module
    # too): the zygote's own unpickling comes after, and the ranks die with
    # the zygote, the launch failed or its ranks reported killed.
    folder = tmp_path / "pids"
    folder.mkdir()
    importing = tmp_path / "importing"
    (tmp_path / "slow_in_the_zygote.py").write_text(
        f"import pathlib, time\npathlib.Path({str(importing)!r}).touch()\ntime.sleep(60)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ctx = fastspawn.start_processes(
        workers.start_daemon_and_sleep, (str(folder),), nprocs=2, join=False
    )
    pids: list[int] = []
    outcome: list[BaseException] = []
    thread = _launch_importing("slow_in_the_zygote", outcome)
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(folder)) < 2:
            assert time.monotonic() < deadline, "the workers did not start their daemons"
            time.sleep(0.05)
        for name in os.listdir(folder):
            pids += map(int, (folder / name).read_text().split())
        zygote = client.zygote_pid()
        assert zygote is not None
        assert fastspawn.prefork(2 if ready else 0, refill=False) == (2 if ready else 0)
        taking = client.ready_workers(zygote)
        (guard,) = client.helper_processes()[0] - {zygote} - taking
        thread.start()
        while not importing.exists():
            assert time.monotonic() < deadline + 30, "the zygote did not start the import"
            time.sleep(0.05)
        os.kill(guard, signal.SIGKILL)
        alive = alive_after(pids + [zygote, *taking])
        assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the guard: {alive}"
        thread.join(30)
        assert not thread.is_alive()
        assert len(outcome) == 1, outcome
        if not ready or not isinstance(outcome[0], fastspawn.ProcessExitedException):
            assert isinstance(outcome[0], RuntimeError), outcome
            assert "the zygote died during the launch" in str(outcome[0])
            assert f"its guard, pid {guard}, was killed by SIGKILL" in str(outcome[0])
        with pytest.raises(fastspawn.ProcessExitedException):
            while not ctx.join(timeout=30):
                pass
    finally:
        for pid in pids:  # daemons left to init, not ours to reap
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        thread.join(60)
        sys.modules.pop("slow_in_the_zygote", None)
    assert fastspawn.start_processes(workers.succeed, nprocs=2).return_values == {0: 0, 1: 1}


def test_a_launch_whose_zygote_is_sigkilled_says_so(tmp_path, monkeypatch):
    # The OOM killer, say, in the middle of a launch (here: its unpickling):
    # the error names the signal, not code of __main__'s as the cause.
    importing = tmp_path / "importing"
    (tmp_path / "slow_before_a_kill.py").write_text(
        f"import pathlib, time\npathlib.Path({str(importing)!r}).touch()\ntime.sleep(60)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    client.get_server()
    assert fastspawn.prefork(0, refill=False) == 0  # the zygote unpickles: no ready worker
    zygote = client.zygote_pid()
    outcome: list[BaseException] = []
    thread = _launch_importing("slow_before_a_kill", outcome)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not importing.exists():
            assert time.monotonic() < deadline, "the zygote did not start the import"
            time.sleep(0.05)
        os.kill(zygote, signal.SIGKILL)
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    message = str(outcome[0])
    assert f"the launch: it, pid {zygote}, was killed by SIGKILL, by the kernel's OOM" in message
    assert "move it under that guard" not in message
    assert fastspawn.start_processes(workers.succeed, nprocs=2).return_values == {0: 0, 1: 1}


def test_guard_killed_before_it_forks_the_zygote_is_seen_at_once(monkeypatch):
    # The caller's watcher first waits for the guard to fork the zygote
    # proper; a guard SIGKILLed before that (here: one that never forks)
    # held it there for its 10 s deadline, and every launch meanwhile
    # (alive() waits for the watcher) with it.
    fastspawn.stop_zygote()
    monkeypatch.setattr(client, "_ENTRY", "import time; time.sleep(60)")
    server = client.get_server()
    monkeypatch.undo()
    os.kill(server.pid, signal.SIGKILL)
    assert server.dead.wait(5), "the watcher did not see the guard die"
    assert fastspawn.start_processes(workers.succeed, nprocs=2).return_values == {0: 0, 1: 1}


def test_caller_that_is_a_subreaper_reaps_the_zygote_its_guard_left(tmp_path):
    # A child subreaper (or a container's init, pid 1) adopts the zygote
    # when its guard dies; the zygote then shut down and stayed a zombie
    # of the caller's for good.
    done = run_script(
        tmp_path / "main.py",
        """
        import ctypes, os, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        import psutil
        import fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client

        if __name__ == "__main__":
            PR_SET_CHILD_SUBREAPER = 36
            assert ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            ctx = fastspawn.start_processes(workers.sleep_forever, nprocs=2, join=False)
            zygote = client.zygote_pid()
            os.kill(client._server.pid, signal.SIGKILL)  # the guard
            try:
                while not ctx.join(timeout=30):
                    pass
            except fastspawn.ProcessExitedException:
                print("raised")
            assert client._server.dead.wait(30)
            deadline = time.monotonic() + 5
            while psutil.pid_exists(zygote) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("zygote left:", psutil.pid_exists(zygote))
        """,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS],
    )
    assert done.stdout.splitlines() == [
        "raised",
        "zygote left: False",
    ], done.stdout + done.stderr


def test_stop_zygote_while_another_thread_launches():
    # stop_zygote() closed the control socket under a launch's send (a raw
    # EBADF), and the pidfd under its retry.  A launch it interrupts may
    # fail as its workers' zygote went away; nothing else.
    failures: list[str] = []
    launched = 0
    stop = threading.Event()

    def launcher() -> None:
        nonlocal launched
        while not stop.is_set():
            try:
                fastspawn.start_processes(workers.succeed, nprocs=1)
                launched += 1
            except fastspawn.ProcessExitedException:
                pass  # its worker went with the stopped zygote
            except RuntimeError as exc:
                if "the zygote died during the launch" not in str(exc):
                    failures.append(repr(exc))
            except Exception as exc:
                failures.append(repr(exc))

    thread = threading.Thread(target=launcher)
    thread.start()
    try:
        rng = random.Random(7)
        for _ in range(30):
            time.sleep(rng.uniform(0, 0.05))
            fastspawn.stop_zygote()
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert failures == []
    assert fastspawn.start_processes(workers.succeed, nprocs=2).return_values == {0: 0, 1: 1}


def test_zygote_closes_what_it_opened_under_dev_mode(tmp_path):
    # -X dev reports every socket left to the garbage collector: the
    # zygote (which inherits the flag) left its control socket so.
    done = run_script(
        tmp_path / "main.py",
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import fastspawn, workers
        if __name__ == "__main__":
            print(fastspawn.start_processes(workers.succeed, nprocs=2).return_values)
        """,
        command=[sys.executable, "-X", "dev", str(tmp_path / "main.py"), TESTS],
    )
    assert done.stdout == "{0: 0, 1: 1}\n", done.stderr
    assert "ResourceWarning" not in done.stderr, done.stderr


def test_caller_sees_zygote_death_and_recovers(caplog):
    ctx = fastspawn.start_processes(workers.sleep_forever, nprocs=4, join=False)
    zygote = client.zygote_pid()
    os.kill(zygote, signal.SIGKILL)
    began = time.monotonic()
    with pytest.raises(fastspawn.ProcessExitedException, match="SIGKILL"):
        while not ctx.join(timeout=30):
            pass
    assert time.monotonic() - began < 30
    caplog.set_level(logging.WARNING, logger="fastspawn")
    again = fastspawn.start_processes(workers.succeed, nprocs=2)
    assert again.return_values == {0: 0, 1: 1}
    assert f"the zygote (pid {zygote}) died" in caplog.text


def test_worker_children_die_with_their_worker():
    ctx = fastspawn.start_processes(workers.leave_sleeper_child, nprocs=3)
    orphans = list(ctx.return_values.values())
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in orphans):
        assert time.monotonic() < deadline, "a worker's child outlived the worker"
        time.sleep(0.05)


def test_one_message_per_launch(monkeypatch):
    client.get_server()  # started, so its hello message is not counted
    sent = []
    original = client.ZygoteClient.send

    def counting(self, message, fds=(), locked=False):
        sent.append(message.op)
        return original(self, message, fds, locked)

    monkeypatch.setattr(client.ZygoteClient, "send", counting)
    ctx = fastspawn.start_processes(workers.succeed, nprocs=32)
    assert ctx.return_values == {rank: rank for rank in range(32)}
    assert sent == [protocol.LAUNCH]


@pytest.mark.parametrize("size", [10, 200_000])
def test_a_payload_is_read_from_its_start_and_its_trailer_alone(size):
    # fn and args from the memfd's start, the header as their trailer: read
    # whole up to 64 KiB, as unpickled above that, never moving the offset
    # the memfd's other holders share.
    fd = wire_payload.new_memfd()
    try:
        work = (len, (b"w" * size,))
        wire_payload.write_work(fd, [work], pickling.FdCollector())
        wire_payload.append_trailer(fd, pickle.dumps({"header": size}))
        end = os.lseek(fd, 0, os.SEEK_CUR)
        with wire_payload.read_payload(fd, keep_open=True) as payload:
            assert wire_payload.read_trailer(payload)[0] == {"header": size}
            assert pickle.load(payload) == work
            work_size = payload.tell()
        with wire_payload.read_payload(fd, keep_open=True) as payload:
            assert wire_payload.read_trailer(payload)[1] == work_size
        assert os.lseek(fd, 0, os.SEEK_CUR) == end
    finally:
        os.close(fd)  # keep_open: still open here, or this raises


def test_workers_are_children_of_the_zygote_and_thread_free():
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:
        ctx = fastspawn.start_processes(workers.pid_and_ppid, nprocs=2)
        threads = fastspawn.start_processes(workers.thread_count, nprocs=2)
    finally:
        stop.set()
        busy.join()
    assert {ppid for _pid, ppid in ctx.return_values.values()} == {client.zygote_pid()}
    assert threads.return_values == {0: 1, 1: 1}


def test_random_is_reseeded_per_worker():
    ctx = fastspawn.start_processes(workers.random_draw, nprocs=4)
    assert len(set(ctx.return_values.values())) == 4


@pytest.mark.parametrize("preload", ["numpy", "numpy.random"])
def test_numpy_is_reseeded_per_worker(preload):
    # numpy.random preloaded: the workers inherit one RNG state and must be
    # reseeded.  numpy alone: each worker imports numpy.random itself.
    pytest.importorskip("numpy")
    ctx = fastspawn.start_processes(workers.numpy_draw, nprocs=4, preload=[preload])
    assert len(set(ctx.return_values.values())) == 4


def test_reseeding_does_not_import_numpy_random():
    # Importing it in every worker cost about 18 ms per worker of a torch job.
    pytest.importorskip("numpy")
    fastspawn.stop_zygote()  # a fresh one, without numpy.random
    ctx = fastspawn.start_processes(
        workers.module_loaded, ("numpy.random",), nprocs=2, preload=["numpy"]
    )
    assert ctx.return_values == {0: False, 1: False}


def test_preload_keyword():
    fastspawn.stop_zygote()
    probe = fastspawn.start_processes(workers.module_loaded, ("preload_probe",), nprocs=1)
    assert probe.return_values == {0: False}
    probe = fastspawn.start_processes(
        workers.module_loaded, ("preload_probe",), nprocs=1, preload=["preload_probe"]
    )
    assert probe.return_values == {0: True}
    fastspawn.stop_zygote()


def test_preload_function_and_env_var(monkeypatch):
    fastspawn.stop_zygote()
    fastspawn.preload(["preload_probe"])
    probe = fastspawn.start_processes(workers.module_loaded, ("preload_probe",), nprocs=1)
    assert probe.return_values == {0: True}
    fastspawn.stop_zygote()
    monkeypatch.setenv("FASTSPAWN_PRELOAD", "json, preload_probe")
    probe = fastspawn.start_processes(workers.module_loaded, ("preload_probe",), nprocs=1)
    assert probe.return_values == {0: True}
    fastspawn.stop_zygote()


def test_preload_failure_is_reported():
    with pytest.raises(fastspawn.ProcessRaisedException, match="No module named 'no_such_mod"):
        fastspawn.start_processes(workers.succeed, nprocs=2, preload=["no_such_mod_fs"])


def test_preload_bad_arguments():
    with pytest.raises(TypeError, match="preload must be a list of module names"):
        fastspawn.start_processes(workers.succeed, preload="numpy")
    with pytest.raises(ValueError, match="preload applies to start_method"):
        fastspawn.start_processes(workers.succeed, start_method="spawn", preload=["json"])
    with pytest.raises(TypeError, match="preload takes module names"):
        fastspawn.preload([3])


def test_caller_sys_path_change_reaches_zygote(tmp_path, monkeypatch):
    (tmp_path / "fs_late_module.py").write_text("def work(rank):\n    return rank + 100\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fs_late_module

    try:
        ctx = fastspawn.start_processes(fs_late_module.work, nprocs=2)
    finally:
        del sys.modules["fs_late_module"]
    assert ctx.return_values == {0: 100, 1: 101}


def test_caller_cwd_reaches_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = fastspawn.start_processes(workers.cwd, nprocs=1)
    assert ctx.return_values == {0: str(tmp_path)}


def test_environ_is_compares_the_environment_as_os_environ_holds_it(monkeypatch):
    """What tells the zygote and ready workers whether a launch's
    environment is theirs already: the bytes os.environ holds (a byte no
    encoding decodes included), as a launch's header carries them."""
    monkeypatch.setenv("FASTSPAWN_TEST_ENV", "caf\udcc3")
    env = protocol.environ_bytes(os.environ)
    assert env[b"FASTSPAWN_TEST_ENV"] == b"caf\xc3"
    assert environ_is(env)
    assert environ_is(protocol.environ_bytes(dict(os.environ)))  # from str, encoded alike
    assert not environ_is({**env, b"FASTSPAWN_TEST_OTHER": b"1"})
    assert not environ_is({**env, b"FASTSPAWN_TEST_ENV": b"cafe"})
    del env[b"FASTSPAWN_TEST_ENV"]
    assert not environ_is(env)


def test_a_launch_header_carries_the_environment_as_bytes_and_reads_back_the_same(monkeypatch):
    """The header's environment, made from os.environ or from a mapping of
    strings, is the bytes os.environ holds, and decodes as it was encoded."""
    import io
    import pickle

    from fastspawn._wire import payload as wire_payload

    monkeypatch.setenv("FASTSPAWN_TEST_ENV", "caf\udcc3")
    fields = dict(
        nprocs=2,
        daemon=False,
        preload=["json"],
        sys_path=sys.path,
        cwd=os.getcwd(),
        envs={1: {"RANK_ONLY": "1"}},
        process_group=True,
        process_state={},
        tracker_index=None,
        user_fds=0,
        stdio_slots=[(1, 2)],
        default_stdio=2,
    )
    header = protocol.LaunchHeader(env=os.environ, **fields)
    assert header.env == protocol.LaunchHeader(env=dict(os.environ), **fields).env
    assert header.env[b"FASTSPAWN_TEST_ENV"] == b"caf\xc3"
    file = io.BytesIO(pickle.dumps(("fn", ())))
    work_size = len(file.getvalue())
    file.seek(0, io.SEEK_END)
    trailer = header.encode()
    file.write(trailer + wire_payload._LENGTH.pack(len(trailer)))
    decoded, size = protocol.LaunchHeader.decode(file)
    assert size == work_size
    assert {name: getattr(decoded, name) for name in protocol.LaunchHeader.__slots__} == {
        name: getattr(header, name) for name in protocol.LaunchHeader.__slots__
    }


def test_zygote_ignores_terminal_interrupt():
    client.get_server()
    zygote = client.zygote_pid()
    os.kill(zygote, signal.SIGINT)
    time.sleep(0.2)
    assert not gone(zygote)
    ctx = fastspawn.start_processes(workers.succeed, nprocs=1)
    assert ctx.return_values == {0: 0}


def test_unguarded_main_is_an_error_not_a_process_storm(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import fastspawn\n"
        "def work(rank):\n"
        "    return rank\n"
        "fastspawn.start_processes(work, nprocs=2)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "bootstrapping phase" in done.stderr
    # Each rank fails as a spawned one would, with the traceback.
    assert "fastspawn._launch.errors.ProcessRaisedException" in done.stderr
    assert "the main module could not be imported in the zygote" in done.stderr


def test_main_module_that_exits_at_import_exits_every_rank_so(tmp_path):
    # argparse at module level (outside the guard) exits 2 where the zygote
    # imports the script: each rank exits 2, as a spawned one would, and the
    # zygote stays up for the caller's next launch.
    script = tmp_path / "exits.py"
    done = run_script(
        script,
        """
            import sys
            import fastspawn

            if __name__ != "__main__":
                sys.exit(2)

            def work(rank):
                return rank

            if __name__ == "__main__":
                for _ in range(2):
                    try:
                        fastspawn.start_processes(work, nprocs=2)
                    except fastspawn.ProcessExitedException as exc:
                        print(exc)
            """,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(
        line.endswith("terminated with exit code 2") for line in lines
    ), lines


def test_launch_retries_when_the_zygote_dies_after_the_liveness_check(monkeypatch):
    client.get_server()
    zygote = client.zygote_pid()
    server = client._server
    os.kill(zygote, signal.SIGKILL)
    server.dead.wait(30)  # the zygote is gone: its control socket is closed
    calls = []
    original = client.ZygoteClient.alive

    def stale_once(self):
        calls.append(self.pid)
        return True if len(calls) == 1 else original(self)

    monkeypatch.setattr(client.ZygoteClient, "alive", stale_once)
    ctx = fastspawn.start_processes(workers.succeed, nprocs=2)
    assert ctx.return_values == {0: 0, 1: 1}
    assert calls[0] == server.pid and len(calls) >= 2


def test_a_launch_the_zygote_died_before_taking_goes_to_a_new_one(monkeypatch):
    # Its guard SIGKILLed a moment before, the zygote looks alive as the
    # launch is sent, and dies before it reads it (a chaos round saw it):
    # none of the launch's ranks started, so a new zygote takes it.
    client.get_server()
    zygote = client.zygote_pid()
    os.kill(zygote, signal.SIGSTOP)  # it reads nothing more
    original = client.ZygoteClient.send_launch
    sent = []

    def then_die(self, *args):
        original(self, *args)
        sent.append(self.zygote_pid())
        if len(sent) == 1:
            os.kill(zygote, signal.SIGKILL)

    monkeypatch.setattr(client.ZygoteClient, "send_launch", then_die)
    ctx = fastspawn.start_processes(workers.succeed, nprocs=2)
    assert ctx.return_values == {0: 0, 1: 1}
    assert sent[0] == zygote and len(sent) == 2 and sent[1] != zygote


def _anon_huge_kib(pid: int) -> int:
    return hugepages.smaps_rollup(pid)["AnonHugePages"]


def test_workers_skip_the_zygotes_objects_in_gc_but_collect_their_own():
    ctx = fastspawn.start_processes(workers.gc_state, nprocs=2)
    for frozen, collected in ctx.return_values.values():
        assert frozen > 1000  # the zygote froze its modules before forking
        assert collected >= 1  # the worker's own cycle


@pytest.mark.skipif(not hugepages.wanted(), reason="no huge pages to collapse into here")
def test_idle_zygote_collapses_its_heap_into_huge_pages():
    fastspawn.stop_zygote()
    # A huge page may be unavailable for a moment (memory fragmented): a
    # second launch that imports a module queues the heap again.
    for module in ("big_heap", "preload_probe"):
        fastspawn.start_processes(workers.succeed, nprocs=1, preload=[module])
        zygote = client.zygote_pid()
        deadline = time.monotonic() + 10
        while _anon_huge_kib(zygote) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        if _anon_huge_kib(zygote):
            break
    with open(f"/proc/{zygote}/smaps_rollup") as f:
        assert _anon_huge_kib(zygote) > 0, "the idle zygote collapsed nothing:\n" + f.read()
    # Still serves launches, from the collapsed memory.
    ctx = fastspawn.start_processes(workers.module_loaded, ("big_heap",), nprocs=4)
    assert ctx.return_values == {rank: True for rank in range(4)}


@pytest.mark.skipif(not hugepages.wanted(), reason="no huge pages to collapse into here")
@pytest.mark.skipif(not hugepages.pymalloc_in_use(), reason="pymalloc (its arenas) is off")
def test_zygote_places_its_arenas_in_one_aligned_region_before_its_imports():
    fastspawn.stop_zygote()
    ctx = fastspawn.start_processes(workers.arena_region, nprocs=2, preload=["big_heap"])
    zygote = client.zygote_pid()
    regions = set(ctx.return_values.values())
    assert len(regions) == 1  # inherited by every worker
    ((base, size, used),) = regions
    assert base % (2 << 20) == 0 and size == hugepages.ARENA_REGION
    # The zygote's own imports (fastspawn._server and what it pulls in) came
    # after the region: several arenas of objects, not just the preload's.
    assert used >= 2 << 20
    with open(f"/proc/{zygote}/maps") as f:
        starts = {int(line.split("-")[0], 16): line.split()[1] for line in f}
    assert starts.get(base) == "rw-p"  # in use from its start on


@pytest.mark.skipif(not hugepages.wanted(), reason="no huge pages to collapse into here")
def test_a_large_launch_collapses_the_zygote_before_forking():
    # big_heap's ~20 MiB arrive with the launch: with no idle time before
    # the fork, only collapsing first can hand them to workers as huge pages
    # (the zygote's own collapsible memory is under 8 MiB).
    fastspawn.stop_zygote()
    nprocs = zygote_server.COLLAPSE_BEFORE_FORKING
    ctx = fastspawn.start_processes(workers.own_huge_kib, nprocs=nprocs, preload=["big_heap"])
    assert ctx.return_values[0] >= 8 << 10, ctx.return_values[0]


def test_hugepages_opt_out(monkeypatch):
    monkeypatch.setenv("FASTSPAWN_HUGEPAGES", "0")
    fastspawn.stop_zygote()
    try:
        fastspawn.start_processes(workers.succeed, nprocs=1, preload=["big_heap"])
        zygote = client.zygote_pid()
        time.sleep(1.0)  # idle time in which it would have collapsed
        assert _anon_huge_kib(zygote) == 0
        ctx = fastspawn.start_processes(workers.arena_region, nprocs=1)
        assert ctx.return_values[0] == (0, 0, 0)  # arenas left where they were
    finally:
        fastspawn.stop_zygote()  # the next test's zygote gets the default


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_preload_at_top_level_of_the_main_script(tmp_path, start_method):
    # fastspawn.preload() (or patch_torch()) written above the __main__
    # guard runs again where the main module is imported (the zygote, a
    # spawned worker): there it must do nothing, not start another zygote.
    script = tmp_path / "main_script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import fastspawn
            fastspawn.preload(["json"])

            def work(rank):
                return rank

            if __name__ == "__main__":
                ctx = fastspawn.start_processes(work, nprocs=2, start_method={start_method!r})
                print(sorted(ctx.return_values.values()))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"


def test_preload_failure_names_the_module_and_the_argument():
    with pytest.raises(fastspawn.ProcessRaisedException) as info:
        fastspawn.start_processes(workers.succeed, nprocs=1, preload=["no_such_mod_fs"])
    last = str(info.value).rstrip().splitlines()[-1]
    assert "preload=['no_such_mod_fs']" in last and "could not import 'no_such_mod_fs'" in last


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_workers_have_pythons_signal_handling_not_the_zygotes(start_method):
    # The zygote lends its workers their handlers for the length of its fork
    # loop: each is born with Python's defaults, nothing blocked, no wakeup
    # fd, as a spawned worker is, launch after launch.
    for _ in range(2):
        ctx = fastspawn.start_processes(workers.signal_state, nprocs=3, start_method=start_method)
        assert (
            list(ctx.return_values.values())
            == [
                {
                    "handlers": {
                        "SIGCHLD": "SIG_DFL",
                        "SIGTERM": "SIG_DFL",
                        "SIGINT": "default_int_handler",
                    },
                    "blocked": [],
                    "wakeup_fd": -1,
                }
            ]
            * 3
        )


def test_signals_the_main_module_ignores_are_ignored_in_workers_and_the_zygote_still_ends(
    tmp_path,
):
    # SIG_IGN is the one handler the zygote does not lend (it would drop a
    # SIGTERM pending for the zygote itself): each worker sets it. The zygote
    # must still reap its workers and end with the caller.
    script = tmp_path / "ignoring.py"
    done = run_script(
        script,
        """
            import os, signal, sys
            import fastspawn
            sys.path.insert(0, sys.argv[1])
            import workers

            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if __name__ != "__main__":
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)

            if __name__ == "__main__":
                for _ in range(2):
                    state = workers.signal_state
                    ctx = fastspawn.start_processes(state, nprocs=2, start_method="zygote")
                    print(sorted(str(state) for state in ctx.return_values.values()))
            """,
        command=[sys.executable, str(script), os.path.dirname(workers.__file__)],
    )
    assert done.returncode == 0, done.stderr
    state = {
        "handlers": {"SIGCHLD": "SIG_IGN", "SIGTERM": "SIG_IGN", "SIGINT": "default_int_handler"},
        "blocked": [],
        "wakeup_fd": -1,
    }
    assert done.stdout.splitlines() == [str([str(state)] * 2)] * 2


def test_a_group_with_only_a_zombie_left_has_no_live_members():
    # What the zygote's watcher waits on when its guard died before it
    # learned the zygote's pid: the guard's group, empty but for the guard's
    # zombie once the zygote has shut down.
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert client._group_has_live_members(leader.pid)
        leader.kill()
        assert _zombie_within_10_s(leader.pid)  # unreaped
        assert not client._group_has_live_members(leader.pid)
    finally:
        leader.kill()
        leader.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _zombie_within_10_s(pid: int) -> bool:
    """Whether ``pid`` is a zombie, waiting up to 10 s for its exit."""
    deadline = time.monotonic() + 10
    while _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) == "Z"


def test_the_next_launch_takes_a_process_group_anchored_ahead():
    # Once idle after a launch with a group of its own, the zygote anchors
    # the next one's ahead (Forker.make_spare_group): a zombie child named
    # for what it is (client.spare_group finds it so); the next launch's
    # ranks are in its group, and it goes with the zygote.
    first = fastspawn.start_processes(workers.process_group, nprocs=2).return_values
    zygote = client.zygote_pid()
    assert zygote is not None
    deadline = time.monotonic() + 10
    spare: set[int] = set()
    while not spare and time.monotonic() < deadline:
        time.sleep(0.01)
        spare = client.spare_group(zygote)
    assert len(spare) == 1, "no spare group was anchored in 10 s"
    (anchor,) = spare
    # The zygote goes on (and the anchor has its name) once the anchor's
    # exit has let go of the memory they share (CLONE_VFORK): a moment
    # before the exit has made it a zombie.
    assert _zombie_within_10_s(anchor) and os.getpgid(anchor) == anchor
    assert oscall.ANCHOR_NAME == "fastspawn-group"  # csrc/group.c names it so
    second = fastspawn.start_processes(workers.process_group, nprocs=2).return_values
    assert second == {0: anchor, 1: anchor} and anchor not in first.values()
    fastspawn.stop_zygote()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{anchor}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{anchor}")  # reaped as the zygote shut down
