"""Ctrl-C at any moment, with other threads alive: a held step is never cut
in two, an interrupted join() is finished by the next one with every value
and every traceback, and no fd is closed twice.

Each test runs its program in a child interpreter: the interrupts need the
main thread's own SIGINT handling, and a program that got them wrong must
not take the test process with it.
"""

from __future__ import annotations

import os
import sys

import pytest
from helpers import run_script

TESTS = os.path.dirname(os.path.abspath(__file__))
METHODS = ["zygote", "fork", "spawn"]
# The storms' spawn rounds start an interpreter a rank and take 10-12 s:
# on CI's other CPython versions the zygote and fork rounds stand for them.
STORM_METHODS = ["zygote", "fork", pytest.param("spawn", marks=pytest.mark.version_neutral)]


def test_a_held_step_defers_a_signal_another_thread_took(tmp_path):
    done = run_script(
        tmp_path / "main.py",
        """
        import os, signal, sys, threading, time
        from fastspawn._os import oscall

        # A thread that blocks nothing: the kernel may give it a signal sent
        # to the process, and Python then runs the handler in the main
        # thread, whose mask does not matter.
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append("term"))
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                with oscall.held_signals():
                    os.kill(os.getpid(), sig)
                    time.sleep(0.2)  # handlers run on the way out of sleep, if at all
                    inside = "ran to its end"
            except KeyboardInterrupt:
                inside += ", then KeyboardInterrupt"
            print(signal.Signals(sig).name, inside, got)
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)

        # A child forked inside a held step has the handlers, not the recorder.
        with oscall.held_signals():
            pid = os.fork()
            if pid == 0:
                ok = signal.getsignal(signal.SIGINT) is signal.default_int_handler
                os._exit(0 if ok else 1)
        print(os.waitpid(pid, 0)[1] == 0)
        """,
        env={**os.environ, "PYTHONPATH": TESTS},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "SIGINT ran to its end, then KeyboardInterrupt []",
        "SIGTERM ran to its end ['term']",
        "True",
        "True",
    ]


_LAUNCH_STORM = """
import os, random, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fastspawn, workers
from fastspawn._launch import exiting
from fastspawn._warden import client as _warden_client
from fastspawn._zygote import client

def ours():
    kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
    helpers = client.helper_processes()[0] | _warden_client.warden_process()[0]
    return sorted(int(k) for k in kids if int(k) not in helpers)

def stop_timer():
    while True:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        except KeyboardInterrupt:
            continue

if __name__ == "__main__":
    method, rounds, threaded = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    if threaded:  # as a notebook kernel, or a program that imported torch, has
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    signal.signal(signal.SIGALRM, signal.default_int_handler)
    start_processes = fastspawn.start_processes  # the program's import, before the storm
    fds = len(os.listdir("/proc/self/fd"))
    interrupted = 0
    for i in range(rounds):
        if method == "zygote" and i % 5 == 0:
            fastspawn.stop_zygote()  # interrupt its start too
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.03))
                start_processes(workers.sleep_for, (0.3,), nprocs=8, start_method=method)
            finally:
                stop_timer()
        except KeyboardInterrupt:
            interrupted += 1
    fastspawn.stop_zygote()
    time.sleep(0.2)
    extra = len(os.listdir("/proc/self/fd")) - fds - len(_warden_client.warden_process()[1])
    print(interrupted > 0, ours(), extra, len(exiting.live_contexts))
"""


@pytest.mark.parametrize("threaded", [False, True], ids=["one-thread", "two-threads"])
@pytest.mark.parametrize("start_method", METHODS)
def test_ctrl_c_anywhere_in_a_launch_leaves_nothing(tmp_path, start_method, threaded):
    # A Ctrl-C at a random moment of each launch.  With a second thread
    # the signal lands in it, and Python raises in the main thread wherever
    # it is: held steps used to be cut in two (workers left running, known
    # to no one; 5 rounds in 80 with spawn).
    rounds = os.environ.get("FASTSPAWN_INTERRUPT_ROUNDS", "40")
    done = run_script(
        tmp_path / "main.py",
        _LAUNCH_STORM,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, start_method, rounds,
                 "1" if threaded else "0"],
    )  # fmt: skip
    assert done.stdout == "True [] 0 0\n", done.stderr[-3000:]
    assert "Bad file descriptor" not in done.stderr
    # A Ctrl-C that came just before a held step had its handler run inside
    # it, for the fork method in logging's at-fork hook around os.fork():
    # "Exception ignored in ... _releaseLock".
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


_JOIN_STORM = """
import os, random, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fastspawn, workers
from fastspawn._launch import exiting
from fastspawn._warden import client as _warden_client

def quiet(signum, frame):
    pass  # the driver's own steps are not what is tested

def storm(go, stop):
    go.wait()
    while not stop.is_set():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(random.uniform(0.0005, 0.01))

def settle(ctx, failures):
    # Join until it returns True, as a notebook user would after each
    # Ctrl-C (Ctrl-C raises only inside join); a failure raised, or
    # chained to the Ctrl-C that cut its raise short, is counted.
    while True:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                if ctx.join():
                    return
            finally:
                signal.signal(signal.SIGINT, quiet)
        except fastspawn.ProcessException as exc:
            failures.append(exc)
        except KeyboardInterrupt as exc:
            if isinstance(exc.__context__, fastspawn.ProcessException):
                failures.append(exc.__context__)

def open_fds():
    return len(os.listdir("/proc/self/fd")) - len(_warden_client.warden_process()[1])

if __name__ == "__main__":
    method, rounds = sys.argv[2], int(sys.argv[3])
    signal.signal(signal.SIGINT, quiet)
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    # Before any launch: the zygote's client (its watch thread waits on an
    # epoll fd of its own) is stopped below, the warden's fds left out.
    fds = open_fds()
    fastspawn.start_processes(workers.square, nprocs=1, start_method=method)
    problems = []
    for i in range(rounds):
        fail = i % 2 == 1
        nprocs = 4
        ctx = fastspawn.start_processes(
            workers.square_or_raise, args=(2 if fail else -1, f"boom-{i}"),
            nprocs=nprocs, start_method=method, join=False)
        go, stop = threading.Event(), threading.Event()
        thread = threading.Thread(target=storm, args=(go, stop))
        failures = []
        thread.start()
        go.set()
        settle(ctx, failures)
        stop.set()
        thread.join()
        if fail:
            # Rank 2's failure raised once, its traceback whole; the other
            # ranks, stopped because of it if they still ran, each after.
            Raised = fastspawn.ProcessRaisedException
            raised = [str(f) for f in failures if isinstance(f, Raised)]
            stopped = [f.error_index for f in failures if not isinstance(f, Raised)]
            if len(raised) != 1 or f"ValueError: boom-{i}" not in raised[0] or 2 in stopped:
                problems.append((i, "failures", [str(f) for f in failures]))
        else:
            values = ctx.return_values
            if values != {r: r * r for r in range(nprocs)} or failures:
                problems.append((i, "values", values, [str(f) for f in failures]))
    fastspawn.stop_zygote()
    time.sleep(0.2)
    print(problems, open_fds() - fds, len(exiting.live_contexts))
"""


@pytest.mark.parametrize("start_method", STORM_METHODS)
def test_ctrl_c_storms_during_join_lose_nothing(tmp_path, start_method):
    # SIGINT every 0.5-10 ms from a thread while join() runs, join() called
    # again after each: every round ends with every value, or with its one
    # failure raised once, traceback whole; fds and contexts flat.
    rounds = os.environ.get("FASTSPAWN_INTERRUPT_ROUNDS", "24")
    done = run_script(
        tmp_path / "main.py",
        _JOIN_STORM,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, start_method, rounds],
    )
    assert done.stdout == "[] 0 0\n", done.stderr[-3000:]


_INJECTOR = """
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fastspawn, workers
from fastspawn._launch import exiting
from fastspawn._os import oscall
from fastspawn._warden import client as _warden_client

PACKAGE = os.path.dirname(fastspawn.__file__)
ATOMIC = {"__enter__", "__exit__", "_record", "restore", "replay", "__init__"}

class Injector:
    # Raises KeyboardInterrupt at the n-th line fastspawn runs in this
    # thread where a signal handler could raise one: not inside a held
    # step, nor in the code that holds and lets go.
    def __init__(self, n):
        self.n, self.count, self.fired = n, 0, False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return None
        if code.co_filename.endswith("held.py") and code.co_name in ATOMIC:
            return None
        return self.line

    def line(self, frame, event, arg):
        if event == "line" and getattr(oscall._outside, "mask", None) is None:
            self.count += 1
            if self.count == self.n and not self.fired:
                self.fired = True
                raise KeyboardInterrupt
        return self.line

def open_fds():
    return len(os.listdir("/proc/self/fd")) - len(_warden_client.warden_process()[1])

def exited(ctx):
    # Every rank gone (not reaped): the join below never waits for one.
    import select
    for proc in ctx.processes:
        select.select([proc.sentinel], [], [], 30)

def joined(ctx, injector):
    # The first join with the injector; then joins until done, as a user
    # would.  Returns (values or failure text, interrupted?).
    failure = None
    sys.settrace(injector)
    try:
        try:
            ctx.join()
        finally:
            sys.settrace(None)
    except KeyboardInterrupt as exc:
        if isinstance(exc.__context__, fastspawn.ProcessRaisedException):
            failure = str(exc.__context__)
    except fastspawn.ProcessRaisedException as exc:
        failure = str(exc)
    # A file opened now takes the lowest free number: a pidfd or epoll set
    # closed but still recorded as open would be this file's number.
    user = os.open(os.devnull, os.O_RDONLY)
    try:
        while True:
            try:
                if ctx.join():
                    break
            except fastspawn.ProcessRaisedException as exc:
                if failure is not None:
                    return ("raised twice", failure, str(exc)), injector.fired
                failure = str(exc)
        os.fstat(user)  # still ours
    finally:
        os.close(user)
    return (failure if failure is not None else ctx.return_values), injector.fired

if __name__ == "__main__":
    method, stride = sys.argv[2], int(sys.argv[3])
    fds = open_fds()  # before any launch: see the join storm's driver
    fastspawn.start_processes(workers.square, nprocs=1, start_method=method)
    problems, points = [], 0
    for fail in (False, True):
        n = 1
        while True:
            ctx = fastspawn.start_processes(
                workers.square_or_raise, args=(1 if fail else -1, "boom"),
                nprocs=3, start_method=method, join=False)
            exited(ctx)
            got, fired = joined(ctx, Injector(n))
            if fail:
                ok = isinstance(got, str) and "ValueError: boom" in got
            else:
                ok = got == {0: 0, 1: 1, 2: 4}
            if not ok:
                problems.append((fail, n, got))
            if not fired:
                break  # past the last line a join runs
            points += 1
            n += stride
    fastspawn.stop_zygote()
    time.sleep(0.2)
    print(problems, points > 10, open_fds() - fds, len(exiting.live_contexts))
"""


@pytest.mark.parametrize("start_method", STORM_METHODS)
def test_a_join_cut_at_any_line_is_finished_by_the_next(tmp_path, start_method):
    # A KeyboardInterrupt raised at one line of join (the waiter, the
    # channel read, the reap, the bookkeeping), for line after line: the
    # next joins finish with every value, or the failure raised exactly
    # once with its traceback; no fd closed twice (a file opened meanwhile
    # on a freed number stays open); fds and contexts flat.
    # Every line (stride 1) takes minutes with spawn's fresh interpreters:
    # every third, every tenth for spawn, unless told.
    stride = os.environ.get("FASTSPAWN_INJECTOR_STRIDE", "10" if start_method == "spawn" else "3")
    done = run_script(
        tmp_path / "main.py",
        _INJECTOR,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, start_method, stride],
    )
    assert done.stdout == "[] True 0 0\n", done.stderr[-3000:]


_FIRST_LAUNCH = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import fastspawn, workers
from fastspawn._os import held

# The program's own imports (fastspawn's names are imported at first use).
start_processes, get_context = fastspawn.start_processes, fastspawn.get_context
parent = os.getpid()
cut = []

def hook(event, args):
    # An import that ends on the main thread outside a held step: CPython
    # drops the module's lock in a weakref callback there, and a Ctrl-C whose
    # handler runs in that callback is printed ("Exception ignored") and lost.
    if (event == "import" and os.getpid() == parent
            and threading.current_thread() is threading.main_thread()
            and getattr(held._outside, "mask", None) is None):
        cut.append(args[0])

if __name__ == "__main__":
    kind, method = sys.argv[2], sys.argv[3]
    sys.addaudithook(hook)
    if kind == "launch":
        start_processes(workers.succeed, nprocs=1, start_method=method)
    else:
        process = get_context(method).Process(target=workers.succeed, args=(0,))
        process.start()
        process.join()
        assert process.exitcode == 0, process.exitcode
    fastspawn.stop_zygote()
    print(sorted(set(cut)))
"""


@pytest.mark.parametrize(
    ("kind", "method"),
    [*(("launch", m) for m in [*METHODS, "forkserver"]), ("process", "fastspawn"),
     ("process", "fastspawn-spawn")],
)  # fmt: skip
def test_a_first_launch_imports_nothing_a_ctrl_c_could_cut(tmp_path, kind, method):
    # Each module a launch imports at first use ends in a weakref callback;
    # a Ctrl-C there was lost and the launch went on (the launch storm,
    # Python 3.13 on a loaded machine).  Imported at the top of their
    # module, or with signals held, they cannot be cut.
    done = run_script(
        tmp_path / "main.py",
        _FIRST_LAUNCH,
        command=[sys.executable, str(tmp_path / "main.py"), TESTS, kind, method],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[]\n", done.stdout
