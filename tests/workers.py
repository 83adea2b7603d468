"""Worker functions for the tests: module level, so every start method can
pickle them by reference."""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import time
from typing import Any

import fastspawn


def succeed(rank: int) -> int:
    return rank


def put_rank(rank: int, queue: Any) -> None:
    queue.put(rank)


def tracker_pipe(rank: int = 0, queue: Any = None) -> int | None:
    """The inode of the pipe this process reaches multiprocessing's resource
    tracker through, None without one; put on ``queue`` too if given."""
    from multiprocessing import resource_tracker

    fd = resource_tracker._resource_tracker._fd
    inode = None if fd is None else os.fstat(fd).st_ino
    if queue is not None:
        queue.put(inode)
    return inode


def raise_on(rank: int, bad_rank: int, sleep: float = 1.0) -> None:
    if rank == bad_rank:
        raise ValueError(f"legitimate exception from process {rank}")
    time.sleep(sleep)


def raise_after_random_sleep(rank: int) -> None:
    time.sleep(random.random() / 10)
    raise ValueError(f"legitimate exception from process {rank}")


def abort_rank0(rank: int) -> None:
    if rank == 0:
        faulthandler.disable()  # pytest's, inherited by fork: keep the log quiet
        os.kill(os.getpid(), signal.SIGABRT)
    time.sleep(1)


def exit_rank0(rank: int, code: int, sleep: float) -> None:
    if rank == 0:
        sys.exit(code)
    time.sleep(sleep)


def return_or_raise(rank: int) -> None:
    if rank == 0:
        return
    time.sleep(0.1)
    raise ValueError("legitimate exception")


def return_then_raise(rank: int, marker: str) -> None:
    """Rank 0 writes its pid to ``marker`` and returns; rank 1 raises once
    rank 0 has exited (a zombie or gone: its return value reported)."""
    if rank == 0:
        with open(marker + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        return
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(marker) as found:
        pid = int(found.read())
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    raise ValueError("legitimate exception")


def raise_on_rank0_others_ignore_sigterm(rank: int, seconds: float) -> None:
    """Rank 0 raises at once; the others ignore SIGTERM and return after
    ``seconds``."""
    if rank == 0:
        raise ValueError("legitimate exception from process 0")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def fork_a_child_that(rank: int, outcome: str, rank_exit: int, folder: str) -> str:
    """Fork a child that leaves this function by ``outcome`` ("raise" or
    "return"), its stderr going to ``folder``/stderr; wait for it and write
    its exit status to ``folder``/status.  Then end as the rank: return
    "the rank's value", or exit with ``rank_exit`` when it is not 0."""
    path = os.path.join(folder, "stderr")
    pid = os.fork()
    if pid == 0:  # the child, on its way out of fn as a rank would be
        sys.stderr = open(path, "w")  # noqa: SIM115 - flushed at the child's exit
        if outcome == "raise":
            raise ValueError("raised in the rank's forked child")
        return "the child's value"
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(folder, "status"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
    if rank_exit:
        sys.exit(rank_exit)
    return "the rank's value"


def no_args() -> None:  # called as fn(rank): TypeError in the child
    pass


def sigterm_self(rank: int) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)


def kill_self_with(rank: int, signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(5)


def total(rank: int, values: Any) -> int:
    return rank + sum(values)


def sleep_for(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def sleep_forever(rank: int) -> None:
    while True:
        time.sleep(60)


def nested(rank: int, start_method: str, queue: Any) -> None:
    """Start two grandchildren, report their pids, then die by SIGTERM."""
    ctx = fastspawn.start_processes(sleep_forever, nprocs=2, join=False, start_method=start_method)
    queue.put(ctx.pids())
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


def report_env(rank: int, names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def big_result(rank: int, size: int) -> bytes:
    return bytes([rank % 256]) * size


def exit_zero(rank: int) -> None:
    sys.exit(0)


def interrupt_self(rank: int) -> None:
    raise KeyboardInterrupt


def return_unpicklable(rank: int) -> Any:
    return lambda: rank


def wait_on_pipe(rank: int, conn: Any) -> str:
    """Report in, then wait for the word to finish."""
    conn.send(("ready", rank, os.getpid()))
    return str(conn.recv())


def echo_pipe(rank: int, conn: Any) -> None:
    conn.send(conn.recv() * 2)
    conn.close()


def queue_roundtrip(rank: int, inbox: Any, outbox: Any) -> None:
    outbox.put((rank, inbox.get(timeout=30)))


def set_event_and_value(
    rank: int, event: Any, value: Any, lock: Any, barrier: Any, array: Any
) -> None:
    barrier.wait(timeout=30)
    with lock:
        value.value += rank + 1
    array[rank] = 10 * (rank + 1)
    event.set()


def shm_write(rank: int, name: str) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    try:
        shm.buf[rank] = rank + 1
    finally:
        shm.close()


def pid_and_ppid(rank: int) -> tuple[int, int]:
    return os.getpid(), os.getppid()


def start_sleeper_child(rank: int, queue: Any, daemon: bool = False) -> None:
    """Start a child of our own (a grandchild of the caller), and with
    ``daemon`` one more in a session of its own; report, sleep."""
    import subprocess

    pids = [os.getpid(), subprocess.Popen(["sleep", "600"]).pid]
    if daemon:
        pids.append(subprocess.Popen(["sleep", "600"], start_new_session=True).pid)
    queue.put(tuple(pids))
    time.sleep(600)


def fail_last_leaving_a_child(rank: int, folder: str, how: str) -> None:
    """Rank 0 returns at once.  Rank 1 starts a child (in the launch's
    process group), writes its pid to ``folder``/child, waits until rank 0
    is reaped (so it is the last rank running), then fails: ``how`` is
    "raise" or "sigkill" (it kills itself)."""
    import subprocess

    if rank == 0:
        with open(os.path.join(folder, "rank0"), "w") as f:
            f.write(str(os.getpid()))
        return
    child = subprocess.Popen(["sleep", "600"]).pid
    with open(os.path.join(folder, "child.part"), "w") as f:
        f.write(str(child))
    os.replace(os.path.join(folder, "child.part"), os.path.join(folder, "child"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(folder, "rank0")) as f:
                os.kill(int(f.read()), 0)
        except (FileNotFoundError, ValueError):
            pass  # not written yet
        except ProcessLookupError:
            break  # reaped
        time.sleep(0.01)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("rank 1 fails last")


def start_daemon_and_sleep(rank: int, folder: str) -> None:
    """Start a child in a session of its own (a daemon), write our pid and
    its pid to ``folder``/``rank``, sleep."""
    import subprocess

    daemon = subprocess.Popen(["sleep", "600"], start_new_session=True).pid
    path = os.path.join(folder, str(rank))
    with open(path + ".part", "w") as f:
        f.write(f"{os.getpid()} {daemon}")
    os.replace(path + ".part", path)
    time.sleep(600)


class ImportedWhereUnpickled:
    """An argument that imports module ``name`` where it is unpickled (in
    the zygote, for a zygote launch), not where it is pickled."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        import importlib

        return (importlib.import_module, (self.name,))


def module_name(rank: int, module: Any) -> str:
    return str(module.__name__)


def leave_sleeper_child(rank: int) -> int:
    """Start a child and return without waiting for it."""
    import subprocess

    return subprocess.Popen(["sleep", "600"]).pid


def module_loaded(rank: int, name: str) -> bool:
    return name in sys.modules


def thread_count(rank: int) -> int:
    import threading

    return threading.active_count()


def random_draw(rank: int) -> float:
    return random.random()


def numpy_draw(rank: int) -> float:
    import numpy

    return float(numpy.random.random())


def cwd(rank: int) -> str:
    return os.getcwd()


def torch_sum(rank: int) -> float:
    import torch

    return float(torch.tensor([1.0, 2.0, 3.0]).sum() + rank)


def add_one_at_rank(rank: int, tensor: Any) -> bool:
    tensor[rank] += 1  # in place: the caller sees it if the storage is shared
    return bool(tensor.is_shared())


def elastic_add(a: int, b: int) -> int:
    print(f"out {a} {b}")
    print(f"err {a} {b}", file=sys.stderr)
    return a + b


def elastic_raise(message: str) -> None:
    raise ValueError(message)


def elastic_link_error_file_and_raise(target: str) -> None:
    """Plant a symbolic link to ``target`` where this rank's error file goes
    (as someone with access to the log directory could), then raise."""
    os.symlink(target, os.environ["TORCHELASTIC_ERROR_FILE"])
    raise ValueError("boom")


def elastic_exit_zero() -> None:
    sys.exit(0)


def elastic_big(size: int) -> bytes:
    return b"x" * size


def elastic_env() -> str | None:
    return os.environ.get("TORCHELASTIC_ERROR_FILE")


def elastic_pid(tag: str) -> int:
    """This rank's pid, also printed with ``tag`` to its stdout and stderr."""
    print(f"{tag} {os.getpid()}")
    print(f"{tag} {os.getpid()}", file=sys.stderr)
    return os.getpid()


def open_files_limit(_rank: int = 0) -> int:
    """This process's soft RLIMIT_NOFILE."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def elastic_stdio() -> tuple[str, str]:
    """What this rank's stdout and stderr are (after printing a line to each)."""
    print("out")
    print("err", file=sys.stderr)
    sys.stdout.flush()
    return os.readlink("/proc/self/fd/1"), os.readlink("/proc/self/fd/2")


def gc_state(rank: int) -> tuple[int, int]:
    """(objects frozen by the zygote, cyclic garbage this worker collects)."""
    import gc

    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    return gc.get_freeze_count(), gc.collect()


def arena_region(rank: int) -> tuple[int, int, int]:
    """The object-arena region this worker inherited from the zygote."""
    from fastspawn._os import hugepages

    return hugepages.arena_region()


def own_huge_kib(rank: int) -> int:
    """This worker's memory still mapped as huge pages (shared with the
    zygote as it was when this worker was forked)."""
    from fastspawn._os import hugepages

    return hugepages.smaps_rollup()["AnonHugePages"]


def fd_targets(rank: int) -> list[str]:
    """What each of this worker's fds points at."""
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the listing's own fd
    return targets


def leave_group_or_raise(rank: int) -> None:
    """Rank 1 leaves the launch's process group (setsid) and sleeps; rank 0
    fails once it has."""
    if rank == 1:
        os.setsid()
        time.sleep(60)
    time.sleep(0.5)
    raise ValueError("rank 0 fails")


def blocked_signals(rank: int) -> int:
    """This process's blocked-signal mask, as the kernel has it."""
    return blocked_signals_of(os.getpid())


def blocked_signals_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigBlk line")


def mask_seen_by_nested_spawn(rank: int) -> int:
    """Block SIGUSR1, then launch a "spawn" worker: the mask it starts with."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    ctx = fastspawn.start_processes(blocked_signals, nprocs=1, start_method="spawn")
    return int(ctx.return_values[0])


def process_group(rank: int) -> int:
    return os.getpgrp()


def lead_a_session(rank: int) -> bool:
    """Start a session of its own, as a daemonizing worker does: whether
    it now leads it."""
    os.setsid()
    return os.getsid(0) == os.getpid()


def count_sigterms(rank: int, folder: str) -> None:
    """Rank 0 fails after 0.5 s; the others note each SIGTERM they get in a
    file of their own, and take 0.3 s to shut down after the first."""

    def on_sigterm(signum: int, frame: Any) -> None:
        with open(os.path.join(folder, str(rank)), "a") as f:
            f.write("SIGTERM\n")
        time.sleep(0.3)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    time.sleep(0.5)
    if rank == 0:
        raise ValueError("rank 0 fails")
    time.sleep(60)


def write_to_all(rank: int, conns: list[Any]) -> None:
    for conn in conns:
        conn.send(rank)


class SelfReferring:
    """An argument in a reference cycle, carrying a connection."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.me = self


def touch_arg(rank: int, holder: Any) -> None:
    holder.conn.send(rank)


def start_inner_and_return(rank: int, folder: str, start_method: str) -> None:
    """Start two inner ranks, unjoined, and return at once."""
    fastspawn.start_processes(
        touch_after, (folder,), nprocs=2, join=False, start_method=start_method
    )


def touch_after(rank: int, folder: str) -> None:
    time.sleep(1.0)
    with open(os.path.join(folder, f"inner{rank}"), "w"):
        pass


def join_inner_in_a_thread(rank: int, path: str) -> None:
    """Start a launch from a non-daemon thread that joins it, and return
    while it does: the worker's exit must let that thread finish first.
    The thread writes what it saw to ``path``."""
    import threading

    def run() -> None:
        try:
            ctx = fastspawn.start_processes(sleep_then_square, nprocs=2, join=False)
            while not ctx.join():
                pass
            outcome = f"INNER OK {sorted(ctx.return_values.items())}"
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome = f"INNER FAILED {exc!r}"
        with open(path, "w") as f:
            f.write(outcome)

    threading.Thread(target=run).start()
    time.sleep(0.2)


def sleep_then_square(rank: int) -> int:
    time.sleep(1.0)
    return rank * rank


class FailsToUnpickle:
    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> None:
    raise ValueError("cannot be rebuilt here")


def return_unrebuildable(rank: int) -> Any:
    if rank == 0:
        return FailsToUnpickle()
    return rank


def exit_with(rank: int, code: int) -> None:
    sys.exit(code)


def close_inherited_fds_and_return(rank: int) -> int:
    """Close every fd from 3 on (what some daemonizing code does), open a
    socket that may get the report channel's number back, then return."""
    os.closerange(3, 65536)
    import socket

    a, b = socket.socketpair()
    b.setblocking(False)
    globals()["_kept"] = (a, b)
    return rank


def process_settings(rank: int) -> tuple[int, list[int], tuple[int, int], str]:
    """(umask, CPU affinity, RLIMIT_CORE, what sys.stdin reads) of this worker."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    return (
        mask,
        sorted(os.sched_getaffinity(0)),
        resource.getrlimit(resource.RLIMIT_CORE),
        sys.stdin.read(),
    )


def read_stdin(rank: int) -> str:
    return input()


def print_marker(rank: int, marker: str) -> None:
    # One write per line: print() makes two (text, then newline) when
    # PYTHONUNBUFFERED is set, and two ranks' lines would interleave.
    os.write(1, f"{marker} {rank}\n".encode())
    os.write(2, f"{marker} err {rank}\n".encode())


def inheritable_sockets(rank: int) -> list[int]:
    """The unnamed socket fds this worker's children would inherit: a
    report channel would be one (fastspawn's channels are socketpairs).  A
    socket connected to a named one is another library's (torch's
    shared-memory manager client, in a process that shared a tensor with
    the file_system strategy, inheritable as torch opens it)."""
    import socket

    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") and os.get_inheritable(fd):
                with socket.socket(fileno=os.dup(fd)) as sock:
                    named = sock.family == socket.AF_UNIX and sock.getpeername() not in ("", b"")
                if not named:
                    found.append(fd)
        except OSError:
            pass
    return found


def register_atexit_and_tempdir(rank: int, marker_dir: str) -> str:
    """Register an atexit handler that leaves a marker file, and make a
    TemporaryDirectory left to its exit-time cleanup."""
    import atexit
    import tempfile

    atexit.register(lambda: open(os.path.join(marker_dir, f"atexit{rank}"), "w").close())
    globals()["_tmp"] = tempfile.TemporaryDirectory(dir=marker_dir)
    return globals()["_tmp"].name


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def leave_work_for_the_exit(rank: int, marker_dir: str, what: str) -> None:
    """Leave the worker's exit something of the kind ``what`` to do, which
    writes the file ``marker_dir/what`` when done: a multiprocessing
    ``Finalize`` (its exit function runs it), an atexit handler that writes
    ``util.is_exiting()``, a thread of an executor never shut down (joined
    at the exit, its task done first), a thread that makes a
    weakref.finalize while the exit waits for it, multiprocessing's logger
    (its exit line)."""
    import atexit
    import threading
    from multiprocessing import util

    path = os.path.join(marker_dir, what)
    keep = globals().setdefault("_kept_for_the_exit", [])
    if what == "mp_finalizer":
        keep.append(util.Finalize(None, _write, args=(path, "ran"), exitpriority=0))
    elif what == "is_exiting":
        atexit.register(lambda: _write(path, str(util.is_exiting())))
    elif what == "executor":
        from concurrent.futures import ThreadPoolExecutor

        executor = ThreadPoolExecutor(1)
        executor.submit(lambda: (time.sleep(0.3), _write(path, "ran")))
        keep.append(executor)
    elif what == "late_finalizer":
        import weakref

        class Held:
            pass

        def later() -> None:
            time.sleep(0.3)
            held = Held()
            keep.append(held)
            weakref.finalize(held, _write, path, "ran")

        threading.Thread(target=later).start()
    elif what == "mp_logging":
        import logging

        handler = logging.FileHandler(path)
        util.get_logger().addHandler(handler)
        util.get_logger().setLevel(logging.INFO)
    else:
        raise ValueError(what)


def torch_threads(rank: int) -> tuple[str, int]:
    import torch

    return os.environ.get("OMP_NUM_THREADS", ""), torch.get_num_threads()


def parent_info(rank: int) -> tuple[int | None, bool]:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return (None, False) if parent is None else (parent.pid, parent.is_alive())


def modules_loaded(rank: int, names: list[str]) -> list[bool]:
    """Whether each of these modules is loaded in this worker."""
    return [name in sys.modules for name in names]


def module_attribute(rank: int, module: str, name: str) -> str:
    """str() of the name attribute of an imported module's object, or of
    its .name when it has one (a TemporaryDirectory's path)."""
    value = getattr(sys.modules[module], name)
    return str(getattr(value, "name", value))


def echo_rank_or_exit(message: str, exitcode: int = 0) -> str:
    """torch's elastic test function ``echo1``: print ``message`` (each
    comma-separated part) on stdout and stderr and return it tagged with the
    ``RANK`` variable, or say so on stderr and ``sys.exit(exitcode)``."""
    rank = int(os.environ["RANK"])
    if exitcode:
        print(f"exit {exitcode} from {rank}", file=sys.stderr)
        sys.exit(exitcode)
    for part in message.split(","):
        print(f"{part} stdout from {rank}")
        print(f"{part} stderr from {rank}", file=sys.stderr)
    return f"{message}_{rank}"


def elastic_os_exit(code: int) -> None:
    os._exit(code)


def elastic_exit_or_sleep(code: int, seconds: float) -> None:
    """Exit with ``code`` at once, or (``code`` 0) sleep ``seconds``."""
    if code:
        sys.exit(code)
    time.sleep(seconds)


def torch_style_wrap(fn: Any, rank: int, args: tuple[Any, ...], error_file: str) -> None:
    """What torch's spawn runs in each process it starts: ``fn(rank, *args)``,
    and on an exception its traceback pickled to ``error_file``, exit 1."""
    try:
        fn(rank, *args)
    except Exception:
        import pickle
        import traceback

        with open(error_file, "wb") as f:
            pickle.dump(traceback.format_exc(), f)
        sys.exit(1)


class RunsCode:
    """Unpickling this runs ``os.getpid()``: a stand-in for a planted pickle."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getpid, ())


def elastic_affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def torch_style_wrap_queue(fn: Any, rank: int, args: tuple[Any, ...], error_queue: Any) -> None:
    """torch's wrapper before 1.12: the traceback goes on ``error_queue``."""
    try:
        fn(rank, *args)
    except Exception:
        import traceback

        error_queue.put(traceback.format_exc())
        sys.exit(1)


# ------------------------------------------------- stacks (test_stacks.py)


def barrier_or_raise(rank: int, barrier: Any) -> None:
    """Rank 1 raises once every other rank waits in the barrier, where they
    stay: it takes all four."""
    if rank == 1:
        deadline = time.monotonic() + 60
        while barrier.n_waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("rank 1 fails while the others wait")
    barrier.wait()  # the waiting line


def elastic_barrier_or_raise(rank: int, barrier: Any) -> None:
    barrier_or_raise(rank, barrier)


def wait_in_sleep() -> None:
    while True:
        time.sleep(60)  # the waiting line


def ready_then_wait(rank: int, queue: Any) -> None:
    queue.put(rank)
    wait_in_sleep()


def close_stack_memfd_then_wait(rank: int, queue: Any) -> None:
    """Close the stack memfd and give its number to another file, as code
    that closes fds it does not know of might: the signal must not reach
    this rank now (its handler would write into that file)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("/memfd:fastspawn-stacks:"):
            os.close(int(name))
            globals()["_taken"] = os.open(os.devnull, os.O_WRONLY)
    queue.put(rank)
    wait_in_sleep()


_gloo_keep: list[Any] = []


def gloo_all_reduce_or_raise(rank: int, store_path: str, ready: Any) -> None:
    """Ranks 0, 2 and 3 wait in a gloo all_reduce for a fourth member that
    never contributes (it lives in a thread of rank 0); rank 1 raises once
    they are in it.  Rank 1 is no member: its end closes no connection of
    theirs, so they stay in the all_reduce until stopped."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if rank == 1:
        deadline = time.monotonic() + 60
        while ready.value < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("rank 1 fails while the others wait")
    store = dist.FileStore(store_path, 3)
    timeout = timedelta(seconds=300)
    if rank == 0:
        threading.Thread(
            target=lambda: _gloo_keep.append(dist.ProcessGroupGloo(store, 3, 4, timeout)),
            daemon=True,
        ).start()
    group = dist.ProcessGroupGloo(store, {0: 0, 2: 1, 3: 2}[rank], 4, timeout)
    # Counted on the waiting line itself: a dump taken once all three are
    # counted finds each on that line, however slowly it goes on.
    group.allreduce(_counted(ready, [torch.ones(1)])).wait()  # the waiting line


def _counted(ready: Any, value: Any) -> Any:
    with ready.get_lock():
        ready.value += 1
    return value


def stack_memfds_then_wait(rank: int, queue: Any) -> None:
    """Report the stack memfds this worker holds, and whether it catches
    the stack signal, then wait."""
    from fastspawn._worker import stacks as worker_stacks

    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("/memfd:fastspawn-stacks:"):
            links.append(link)
    with open("/proc/self/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    catches = bool(int(caught.split()[1], 16) >> (worker_stacks.STACKS_SIGNAL - 1) & 1)
    queue.put((rank, links, catches))
    wait_in_sleep()


def nested_fork_launch(rank: int, stacks: bool) -> tuple[Any, dict[int, str], Any, Any]:
    """From inside a rank (armed), a "fork" launch of two ranks: what they
    hold and catch, their stacks, and this rank's own memfd before and
    after."""
    import multiprocessing

    from fastspawn._launch import stacks as _stacks

    before = _stacks.find_memfd(os.getpid())
    queue = multiprocessing.get_context("fork").SimpleQueue()
    ctx = fastspawn.start_processes(
        stack_memfds_then_wait, (queue,), nprocs=2, join=False, start_method="fork", stacks=stacks
    )
    try:
        reports = sorted(queue.get() for _ in range(2))
        deadline = time.monotonic() + 30
        while True:
            found = ctx.dump_stacks()
            shown = all("in wait_in_sleep" in text for text in found.values())
            if not stacks or shown or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for proc in ctx.processes:
            proc.kill()
        try:
            ctx.join(30)
        except fastspawn.ProcessException:
            pass
        queue.close()
    return reports, found, before, _stacks.find_memfd(os.getpid())


def signal_state(rank: int) -> dict[str, Any]:
    """How this worker handles the signals a zygote lives by: each handler
    (its name, or SIG_DFL / SIG_IGN), those blocked, and the wakeup fd."""

    def name(handler: Any) -> str:
        return getattr(handler, "__name__", None) or signal.Handlers(handler).name

    wakeup = signal.set_wakeup_fd(-1)
    if wakeup != -1:
        signal.set_wakeup_fd(wakeup)
    watched = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)
    return {
        "handlers": {sig.name: name(signal.getsignal(sig)) for sig in watched},
        "blocked": sorted(sig.name for sig in signal.pthread_sigmask(signal.SIG_BLOCK, ())),
        "wakeup_fd": wakeup,
    }


def square(rank: int) -> int:
    return rank * rank


def square_or_raise(rank: int, bad_rank: int, message: str) -> int:
    """rank * rank, but rank ``bad_rank`` raises ValueError(message)."""
    if rank == bad_rank:
        raise ValueError(message)
    return rank * rank


def rank_state(rank: int) -> dict[str, Any]:
    """Everything a rank inherits or is given that a ready, pre-forked
    worker must have as a rank forked at launch time has it (issue 31):
    the same across ranks but for ``pid`` and ``random``, and for the
    rank's own number in its stack file's name (normalised here)."""
    import gc
    import multiprocessing
    import resource
    import threading

    def fd_kind(target: str) -> str:
        target = target.replace(f"fastspawn-stacks:{rank} ", "fastspawn-stacks:RANK ")
        return target.split(":[")[0] if ":[" in target else target.split(" (deleted)")[0]

    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt"):
                status[key] = value.strip()
    handlers = {}
    for number in range(1, signal.NSIG):
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(number)
        except ValueError:
            continue
        handlers[number] = getattr(handler, "__qualname__", repr(handler))
    mask = os.umask(0)
    os.umask(mask)
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            limits[name] = resource.getrlimit(getattr(resource, name))
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    parent = multiprocessing.parent_process()
    current = multiprocessing.current_process()
    return {
        "pid": os.getpid(),
        "random": random.random(),
        "ppid": os.getppid(),
        "group": os.getpgrp(),
        "session": os.getsid(0),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": mask,
        "sys.path": list(sys.path),
        "main": getattr(sys.modules.get("__mp_main__"), "__file__", None),
        "modules": sorted(sys.modules),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "limits": limits,
        "signals": status,
        "handlers": handlers,
        "fds": sorted(fd_kind(t) for t in fd_targets(rank)),
        "comm": comm,
        "name": current.name.replace(str(rank), "RANK"),
        "daemon": current.daemon,
        "parent": None if parent is None else parent.pid,
        "threads": threading.active_count(),
        "gc": (gc.isenabled(), gc.get_threshold()),
        "stdout": (sys.stdout.line_buffering, getattr(sys.stdout, "write_through", None)),
    }


def pid_and_nice(rank: int) -> tuple[int, int]:
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)


def pid_and_env(rank: int, name: str) -> tuple[int, str | None]:
    return os.getpid(), os.environ.get(name)


def pid_and_random(rank: int) -> tuple[int, float]:
    return os.getpid(), random.random()


def _only_in(pid: int) -> str:
    if os.getpid() != pid:
        raise ImportError("no_such_module_for_ready: unpickled outside the zygote")
    return "unpickled in the zygote"


class UnpicklableByWorkers:
    """Unpickles in the process whose pid it was given (the zygote) and
    nowhere else: a ready worker's own unpickling fails."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _only_in, (self.pid,)


class CountsPickling:
    """Counts in a class attribute, in the process that pickles it, how
    often it was pickled."""

    pickled = 0

    def __reduce__(self) -> tuple[type, tuple[()]]:
        type(self).pickled += 1
        return CountsPickling, ()


def is_counts_pickling(rank: int, obj: Any) -> bool:
    return isinstance(obj, CountsPickling)


def stack_file_name(rank: int) -> tuple[int, str | None]:
    """This rank's pid, and the rank its stack dump's memfd is named for."""
    from fastspawn._launch import stacks as _stacks

    found = _stacks.find_memfd(os.getpid())
    return os.getpid(), None if found is None else found[1]
