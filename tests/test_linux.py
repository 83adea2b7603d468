"""Linux edge cases, each in its own test: parent death (before prctl too),
launching threads that exit, EINTR, Ctrl-C, fd-carrying arguments."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory

import pytest
import workers
from helpers import KILL_BOUND_S, alive_after, gone, kill_driver, run_script

import fastspawn
import fastspawn._launch.methods.common
from fastspawn._warden import client as _warden_client

TESTS = os.path.dirname(os.path.abspath(__file__))
SPAWN_CTX = multiprocessing.get_context("spawn")


def start(fn, args=(), nprocs=1, start_method="spawn", **kwargs):
    return fastspawn.start_processes(fn, args, nprocs=nprocs, start_method=start_method, **kwargs)


def run_driver(code: str, *args: str) -> subprocess.Popen[str]:
    """A caller of its own, in a session of its own: no terminal, so that
    fork and spawn launches get a process group (and warden) as in a batch
    job, whether the tests run from a terminal or not."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def test_sigkill_of_parent_kills_every_worker(start_method):
    driver = run_driver(
        """
        import sys, time, fastspawn, workers
        ctx = fastspawn.start_processes(
            workers.sleep_forever, nprocs=8, join=False, start_method=sys.argv[1])
        print(" ".join(map(str, ctx.pids())), flush=True)
        time.sleep(600)
        """,
        start_method,
    )
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 8
        assert not any(gone(pid) for pid in pids)
    finally:
        kill_driver(driver)
    alive = alive_after(pids)
    assert alive == [], f"workers alive {KILL_BOUND_S:g} s after SIGKILL of their parent: {alive}"


WARDEN_DRIVER = """
import multiprocessing, sys, time, fastspawn, workers
from fastspawn._warden import client as _warden_client
from fastspawn._zygote import client
queue = multiprocessing.get_context("spawn").SimpleQueue()
ctx = fastspawn.start_processes(
    workers.start_sleeper_child, (queue,), nprocs=16, join=False, start_method=sys.argv[1])
pids = []
for _ in range(16):
    pids.extend(queue.get())
(warden,) = _warden_client.warden_process()[0]
print(warden, " ".join(map(str, pids)), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_sigkill_of_parent_kills_workers_children_too(start_method):
    # The workers die by PR_SET_PDEATHSIG; their children, in the launch's
    # process group, by the warden's killpg.
    driver = run_driver(WARDEN_DRIVER, start_method)
    try:
        assert driver.stdout is not None
        warden, *pids = (int(word) for word in driver.stdout.readline().split())
        assert len(pids) == 32
        assert not any(gone(pid) for pid in pids + [warden])
    finally:
        kill_driver(driver)
    alive = alive_after(pids + [warden])
    assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the caller: {alive}"


def test_replaced_warden_watches_earlier_launches_too():
    # The first launch's group was named to a warden that died since: its
    # successor must be told of it, or those children outlive the caller.
    driver = run_driver(
        """
        import multiprocessing, os, signal, sys, time, fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client
        queue = multiprocessing.get_context("spawn").SimpleQueue()
        pids = []
        contexts = []
        for launch in range(2):
            contexts.append(fastspawn.start_processes(
                workers.start_sleeper_child, (queue,), nprocs=3, join=False, start_method="fork"))
            for _ in range(3):
                pids.extend(queue.get())
            if launch == 0:
                (first,) = _warden_client.warden_process()[0]
                os.kill(first, signal.SIGKILL)
                os.waitid(os.P_PID, first, os.WEXITED | os.WNOWAIT)
        (warden,) = _warden_client.warden_process()[0]
        assert warden != first
        print(warden, " ".join(map(str, pids)), flush=True)
        time.sleep(600)
        """
    )
    try:
        assert driver.stdout is not None
        warden, *pids = (int(word) for word in driver.stdout.readline().split())
        assert len(pids) == 12
        assert not any(gone(pid) for pid in pids)
    finally:
        kill_driver(driver)
    alive = alive_after(pids + [warden])
    assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the caller: {alive}"


# Seconds of waiting by design, in fastspawn's own code and the kernel's: one
# CPython version in CI (.ci/run), for the 30-minute budget.
@pytest.mark.version_neutral
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_caller_that_execs_still_takes_its_workers_children(start_method):
    # exec closes the warden's (close-on-exec) socket while the pid lives
    # on: the warden took that EOF for a harmless close and left, and the
    # workers' children outlived the exec'd program.
    driver = run_driver(
        """
        import multiprocessing, os, sys, fastspawn, workers
        queue = multiprocessing.get_context("spawn").SimpleQueue()
        ctx = fastspawn.start_processes(
            workers.start_sleeper_child, (queue,), nprocs=2, join=False, start_method=sys.argv[1])
        pids = [pid for _ in range(2) for pid in queue.get()]
        print(" ".join(map(str, pids)), flush=True)
        os.execv("/bin/sleep", ["sleep", "3"])  # longer than the old 2 s patience
        """,
        start_method,
    )
    try:
        assert driver.stdout is not None
        pids = [int(word) for word in driver.stdout.readline().split()]
        assert len(pids) == 4
        assert driver.wait(timeout=60) == 0
    finally:
        kill_driver(driver)
    alive = alive_after(pids)
    assert alive == [], f"alive {KILL_BOUND_S:g} s after the exec'd caller exited: {alive}"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_warden_drops_groups_that_end_after_the_caller_execs(start_method):
    # After an exec nothing tells the warden that a launch ended: the
    # program the caller became reaps its workers (a shell does) and runs
    # on.  The group's id is then free for a stranger's group, which the
    # warden killed when that program exited.  It drops groups found gone
    # (and, with none left, leaves).
    driver = run_driver(
        """
        import os, sys, fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client
        ctx = fastspawn.start_processes(
            workers.succeed, nprocs=2, join=False, start_method=sys.argv[1])
        (warden,) = _warden_client.warden_process()[0]
        print(warden, flush=True)
        reap = "import os, sys, time; [os.waitpid(int(p), 0) for p in sys.argv[1:]]; "
        reap += "print('reaped', flush=True); time.sleep(60)"
        os.execv(sys.executable, [sys.executable, "-c", reap, *map(str, ctx.pids())])
        """,
        start_method,
    )
    try:
        assert driver.stdout is not None
        warden = int(driver.stdout.readline())
        assert driver.stdout.readline() == "reaped\n"
        deadline = time.monotonic() + 10
        while not gone(warden):
            assert time.monotonic() < deadline, "the warden still holds the freed group ids"
            time.sleep(0.05)
        assert driver.poll() is None
    finally:
        kill_driver(driver)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_foreground_job_on_a_terminal_keeps_its_workers_in_its_group(tmp_path, start_method):
    # On a terminal a group of the workers' own is a background job, which
    # `stty tostop` (or a worker changing the terminal's modes) stops with
    # SIGTTOU, hanging the join.  A foreground caller keeps them in its own
    # group, as multiprocessing does; elsewhere they get one of their own.
    done = run_script(
        tmp_path / "main.py",
        """
        import os, pty, sys
        sys.path.insert(0, sys.argv[1])
        import fastspawn, workers

        def groups():
            method = sys.argv[2]
            ctx = fastspawn.start_processes(workers.process_group, nprocs=2, start_method=method)
            mine = os.getpgrp()
            return sorted("caller's" if g == mine else "own" for g in ctx.return_values.values())

        if __name__ == "__main__":
            print("no terminal:", groups(), flush=True)
            pid, master = pty.fork()  # the child leads a session on a new terminal
            if pid == 0:
                os.system("stty tostop")
                print("foreground:", groups(), flush=True)
                os._exit(0)
            out = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the terminal's last user left
                    break
                if not chunk:
                    break
                out += chunk
            os.waitpid(pid, 0)
            os.close(master)
            print(out.decode().replace(chr(13), "").strip())
        """,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, start_method],
    )
    assert done.stdout.splitlines() == [
        "no terminal: ['own', 'own']",
        'foreground: ["caller\'s", "caller\'s"]',
    ], done.stderr


def test_warden_killed_is_replaced():
    if fastspawn._launch.methods.common.foreground_on_a_terminal():
        pytest.skip("a foreground job on a terminal starts no warden")
    ctx = start(workers.sleep_for, (0.2,), nprocs=2, start_method="fork")
    (first,) = _warden_client.warden_process()[0]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _warden_client.current().alive():  # reaps it once it is gone
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctx = start(workers.succeed, nprocs=2, start_method="spawn")
    assert ctx.return_values == {0: 0, 1: 1}
    (second,) = _warden_client.warden_process()[0]
    assert second != first
    assert not gone(second)


def test_warden_that_cannot_start_is_a_clear_error(monkeypatch):
    # A "fork" launch runs no program but the warden: without an interpreter
    # at sys.executable (an embedding application) it failed with a bare
    # "No such file or directory (from fs_launch): ''".
    from fastspawn._warden import client as _warden_client

    monkeypatch.setattr(sys, "executable", "")
    with pytest.raises(FileNotFoundError, match="could not start the warden.*sys.executable"):
        _warden_client.Warden()


def test_ignored_sigchld_is_a_clear_error_for_fork_and_spawn(tmp_path):
    # With SIGCHLD ignored the kernel reaps our children itself: their exit
    # statuses are gone (waitid said ECHILD, deep in join).  The zygote's
    # workers are the zygote's children, so that method works.
    done = run_script(
        tmp_path / "main.py",
        """
        import signal, sys
        sys.path.insert(0, sys.argv[1])
        import fastspawn, workers
        if __name__ == "__main__":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
            for method in ("fork", "spawn"):
                try:
                    fastspawn.start_processes(workers.succeed, nprocs=2, start_method=method)
                except RuntimeError as exc:
                    print(method, "SIG_IGN" in str(exc), "SIG_DFL" in str(exc))
            print(fastspawn.start_processes(workers.succeed, nprocs=2).return_values)
        """,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS],
    )
    assert done.stdout == "fork True True\nspawn True True\n{0: 0, 1: 1}\n", done.stderr
    assert "Traceback" not in done.stderr  # nothing left to shut down at exit


def test_warden_leaves_with_its_caller_and_kills_nothing_live(tmp_path):
    # A caller that ends normally: its warden exits, and a process group it
    # was told is done (here one whose child lives on) is left alone.
    driver = run_driver(
        """
        import subprocess, sys, fastspawn, workers
        from fastspawn._warden import client as _warden_client
        from fastspawn._zygote import client
        ctx = fastspawn.start_processes(workers.leave_sleeper_child, nprocs=1, start_method="fork")
        (warden,) = _warden_client.warden_process()[0]
        print(warden, ctx.return_values[0], flush=True)
        """
    )
    assert driver.stdout is not None
    warden, orphan = (int(word) for word in driver.stdout.readline().split())
    try:
        assert driver.wait(timeout=60) == 0
        driver.stdout.close()
        deadline = time.monotonic() + 10
        while not gone(warden):
            assert time.monotonic() < deadline, "the warden outlived its caller"
            time.sleep(0.02)
        assert not gone(orphan)
    finally:
        try:
            os.kill(orphan, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_exit_lets_go_of_the_warden_socket_but_keeps_its_fd_open():
    # After fastspawn's exit hook the control socket is no object of ours (no
    # ResourceWarning when the interpreter's shutdown finalizes it), yet its
    # fd stays open until the process ends: the warden learns of our end
    # then, as at a death.  atexit is LIFO: registered before fastspawn is
    # imported, the check runs after fastspawn's hook.
    driver = run_driver(
        """
        import atexit, os

        def check():
            from fastspawn._warden import client as _warden_client
            warden = _warden_client.current()
            os.fstat(fd)  # still open
            print(warden.control.fileno(), flush=True)

        atexit.register(check)
        import fastspawn, workers
        from fastspawn._warden import client as _warden_client
        fastspawn.start_processes(workers.succeed, nprocs=1, start_method="fork")
        fd = _warden_client.current().control.fileno()
        (warden,) = _warden_client.warden_process()[0]
        print(warden, flush=True)
        """
    )
    assert driver.stdout is not None
    try:
        warden = int(driver.stdout.readline())
        assert driver.stdout.read() == "-1\n"
        assert driver.wait(timeout=60) == 0
    finally:
        driver.stdout.close()
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    deadline = time.monotonic() + 10
    while not gone(warden):
        assert time.monotonic() < deadline, "the warden outlived its caller"
        time.sleep(0.02)


def test_parent_dead_before_prctl_is_detected():
    """The worker's prctl runs after its parent died: the re-check catches it."""
    reader, writer = os.pipe()
    try:
        driver = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    """
                    import os, select, sys
                    from fastspawn._os import oscall
                    out = int(sys.argv[1])
                    parent = os.getpid()
                    ready_r, ready_w = os.pipe()
                    if os.fork() == 0:
                        # The parent's pidfd polls readable once it has exited
                        # and its children were reparented (an fd EOF comes
                        # earlier, while the parent is still mid-exit).
                        watch = select.poll()
                        watch.register(os.pidfd_open(parent), select.POLLIN)
                        os.write(ready_w, b"x")
                        watch.poll()
                        try:
                            oscall.set_pdeathsig(9, parent)
                        except ProcessLookupError:
                            os.write(out, b"detected")
                            os._exit(0)
                        os.write(out, b"missed")
                        os._exit(1)
                    os.read(ready_r, 1)           # the child watches us now
                    os._exit(0)                   # die before the child's prctl
                    """
                ),
                str(writer),
            ],
            pass_fds=[writer],
        )
        driver.wait(timeout=30)
        os.close(writer)
        writer = -1
        chunks = []
        while chunk := os.read(reader, 64):  # EOF once the grandchild exited
            chunks.append(chunk)
        assert b"".join(chunks) == b"detected"
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)


def test_pdeathsig_with_live_parent_is_armed():
    from fastspawn._os import oscall

    # From a child of ours, with the right parent: no error.
    pid = os.fork()
    if pid == 0:
        try:
            oscall.set_pdeathsig(signal.SIGKILL, os.getppid())
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.version_neutral  # waits seconds by design, the same on every version
def test_workers_survive_launching_thread_exit(start_method):
    box = {}

    def launch() -> None:
        box["ctx"] = start(
            workers.sleep_for, (3.0,), nprocs=2, join=False, start_method=start_method
        )

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    ctx = box["ctx"]
    time.sleep(1.0)
    assert all(p.is_alive() for p in ctx.processes), "workers died with their thread"
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline
    assert [p.exitcode for p in ctx.processes] == [0, 0]


def test_checkpoint_client_pattern():
    """A daemon helper spawned from a pool thread, driven over a Pipe
    (torch's checkpoint_process.py), then killed."""
    parent_end, child_end = SPAWN_CTX.Pipe()
    with ThreadPoolExecutor(max_workers=1) as pool:
        ctx = pool.submit(fastspawn.spawn, workers.echo_pipe, (child_end,), 1, False, True).result()
    child_end.close()
    parent_end.send("ping")
    assert parent_end.poll(60)
    assert parent_end.recv() == "pingping"
    ctx.processes[0].join(timeout=30)
    assert ctx.processes[0].exitcode == 0
    assert ctx.join() is True
    parent_end.close()


class Alarm(Exception):
    pass


def test_eintr_during_join_runs_raising_handler(start_method):
    ctx = start(workers.sleep_forever, nprocs=2, join=False, start_method=start_method)

    def handler(signum, frame):
        raise Alarm

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        began = time.monotonic()
        with pytest.raises(Alarm):
            ctx.join()
        assert time.monotonic() - began < 10
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for proc in ctx.processes:
            proc.kill()
    with pytest.raises(fastspawn.ProcessExitedException, match="SIGKILL"):
        while not ctx.join():
            pass


def test_eintr_during_join_with_quiet_handler_keeps_waiting(start_method):
    ctx = start(workers.sleep_for, (1.0,), nprocs=2, join=False, start_method=start_method)
    calls = []
    old = signal.signal(signal.SIGALRM, lambda signum, frame: calls.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        deadline = time.monotonic() + 60
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert calls == [signal.SIGALRM]
    assert [p.exitcode for p in ctx.processes] == [0, 0]


def test_ctrl_c_during_blocking_start_leaves_nothing(start_method):
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            start(workers.sleep_forever, nprocs=3, start_method=start_method)
    finally:
        timer.cancel()
    # the leak fixture checks that no worker and no fd is left


def test_no_temp_files_left(start_method):
    tmp = tempfile.gettempdir()
    before = set(os.listdir(tmp))
    with pytest.raises(fastspawn.ProcessRaisedException):
        start(workers.raise_on, (0, 0.0), nprocs=2, start_method=start_method)
    start(workers.succeed, nprocs=2, start_method=start_method)
    new = {
        name for name in set(os.listdir(tmp)) - before if "fastspawn" in name or "pytorch" in name
    }
    assert new == set()


# ------------------------------------------------------- fd-carrying arguments


def test_pipe_argument(start_method):
    parent_end, child_end = SPAWN_CTX.Pipe()
    ctx = start(workers.echo_pipe, (child_end,), join=False, start_method=start_method)
    child_end.close()
    parent_end.send(21)
    assert parent_end.poll(60)
    assert parent_end.recv() == 42
    assert ctx.join(timeout=60)
    parent_end.close()


def test_queue_arguments(start_method):
    inbox, outbox = SPAWN_CTX.Queue(), SPAWN_CTX.Queue()
    try:
        ctx = start(
            workers.queue_roundtrip,
            (inbox, outbox),
            nprocs=2,
            join=False,
            start_method=start_method,
        )
        inbox.put("a")
        inbox.put("b")
        got = [outbox.get(timeout=60), outbox.get(timeout=60)]
        assert sorted(item for _rank, item in got) == ["a", "b"]
        assert {rank for rank, _item in got} == {0, 1}
        deadline = time.monotonic() + 60
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline
    finally:
        for q in (inbox, outbox):
            q.close()
            q.join_thread()


@pytest.fixture(scope="module")
def sync_objects():
    # Module scope: Value and Barrier live in multiprocessing's shared heap,
    # whose arena fds stay open for the life of the process by design.  They
    # are made before the leak fixture takes its baseline.
    return (
        SPAWN_CTX.Event(),
        SPAWN_CTX.Value("i", 0),
        SPAWN_CTX.Lock(),
        SPAWN_CTX.Barrier(3),
        SPAWN_CTX.Array("i", 3),
    )


def test_sync_primitive_arguments(start_method, sync_objects):
    event, value, lock, barrier, array = sync_objects
    event.clear()
    value.value = 0
    array[:] = [0, 0, 0]
    ctx = start(
        workers.set_event_and_value,
        (event, value, lock, barrier, array),
        nprocs=3,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline
    assert event.is_set()
    assert value.value == 1 + 2 + 3
    assert array[:] == [10, 20, 30]


def test_shared_memory_argument(start_method):
    shm = shared_memory.SharedMemory(create=True, size=8)
    try:
        start(workers.shm_write, (shm.name,), nprocs=4, start_method=start_method)
        assert bytes(shm.buf[:4]) == b"\1\2\3\4"
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("method", ["spawn", "zygote"])
def test_workers_ignore_a_fastspawn_folder_in_the_cwd(tmp_path, method):
    """A checkout's fastspawn/ (no built extension) in the cwd must not shadow
    the fastspawn the caller imported: `python -c` children put the cwd first."""
    decoy = tmp_path / "decoy" / "fastspawn"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import fastspawn

            def work(rank):
                return rank

            if __name__ == "__main__":
                ctx = fastspawn.start_processes(work, nprocs=2, start_method={method!r})
                print(sorted(ctx.return_values.items()))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path / "decoy",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0, 0), (1, 1)]"
