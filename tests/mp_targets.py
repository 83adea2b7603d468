"""Targets for the multiprocessing-context tests (test_mp_context): module
level, so every start method can pickle them by reference."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from typing import Any

# A lambda at module level: importable module, but pickle cannot find it by
# its qualified name ("<lambda>"), as with any lambda under spawn.
UNPICKLABLE = lambda: None  # noqa: E731


def noop(*args: Any) -> None:
    pass


def exit_with(code: int) -> None:
    sys.exit(code)


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def signal_then_sleep(event: Any, seconds: float = 60.0) -> None:
    """Set ``event`` (the process is running its target), then sleep."""
    event.set()
    time.sleep(seconds)


def report_self(queue: Any) -> None:
    """Put what the process knows of itself: its pid, its parent's pid (as
    multiprocessing.parent_process() says), its name, its daemon flag, and
    multiprocessing's start method."""
    me = multiprocessing.current_process()
    parent = multiprocessing.parent_process()
    queue.put(
        (
            os.getpid(),
            None if parent is None else parent.pid,
            me.name,
            me.daemon,
            multiprocessing.get_start_method(allow_none=True),
        )
    )


def start_a_process(context: str, queue: Any) -> None:
    """Start a process of ``context`` that reports on its parent (this
    process), put its pid, then wait to be terminated: asleep (in
    nanosleep, see helpers.wait_until_asleep) only once done with the queue,
    so that a SIGTERM then cannot leave the queue's lock held (a Queue's
    feeder thread holds it while it writes: the reader may have the message
    before it lets go)."""
    process = multiprocessing.get_context(context).Process(target=report_parent, args=(queue,))
    process.start()
    queue.put(("started", process.pid))
    if hasattr(queue, "join_thread"):  # a Queue, not a SimpleQueue
        queue.close()
        queue.join_thread()
    time.sleep(120)


def half_a_launch() -> None:
    """Send the zygote, through this process's link, a launch whose LAUNCH
    message promises fds that never follow, then die: the zygote must drop
    it and serve on."""
    import pickle
    import socket

    from fastspawn._wire import payload as wire_payload
    from fastspawn._zygote import client, protocol

    header = protocol.LaunchHeader(
        nprocs=1,
        daemon=False,
        preload=[],
        sys_path=sys.path,
        env=os.environ,
        cwd=os.getcwd(),
        envs={},
        process_group=True,
        process_state={},
        tracker_index=None,
        user_fds=5,  # none of which is sent
        stdio_slots=[],
        default_stdio=0,
    )
    payload = wire_payload.new_memfd()
    os.write(payload, pickle.dumps((noop, ())))
    wire_payload.append_trailer(payload, header.encode())
    channel, _peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    launch = protocol.ControlMessage(protocol.LAUNCH)
    client.get_server().send(launch, [channel.fileno(), payload])
    os._exit(0)


def report_parent(queue: Any) -> None:
    """Put this process's pid, its os.getppid(), and parent_process()'s pid
    and liveness; once that parent is gone (60 s at most), its liveness
    again."""
    parent = multiprocessing.parent_process()
    assert parent is not None
    queue.put((os.getpid(), os.getppid(), parent.pid, parent.is_alive()))
    parent.join(60)
    queue.put(("parent alive", parent.is_alive()))


def use_shared_state(
    queue: Any,
    conn: Any,
    lock: Any,
    event: Any,
    value: Any,
    array: Any,
    barrier: Any,
) -> None:
    """Touch each of the shared objects so the parent can see it: a Queue
    item, a Pipe message (and the parent's reply echoed), a Value and an
    Array changed under the Lock, an Event set, the Barrier passed."""
    queue.put("from child")
    conn.send(("hello", os.getpid()))
    conn.send(("echo", conn.recv()))
    conn.close()
    with lock:
        value.value += 41
        for i in range(len(array)):
            array[i] = array[i] * 2
    barrier.wait(timeout=60)
    event.set()


def square(x: int) -> int:
    return x * x


def fail_on(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"task {x} failed on purpose")
    return x


def getpid(_: Any = None) -> int:
    return os.getpid()


def exit_abruptly(_: Any = None) -> None:
    os._exit(7)


def kill_self(_: Any = None) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fill_manager(shared: dict, items: list, lock: Any) -> None:
    """Change a Manager's dict and list proxies under its Lock proxy."""
    with lock:
        shared["child"] = os.getpid()
        shared["count"] += 1
        items.append("child")


def add_to_tensor(tensor: Any, amount: float) -> None:
    """Hogwild style: change a shared tensor in place."""
    tensor.add_(amount)


def record_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: note the worker id in the environment,
    where the dataset reads it back."""
    os.environ["MP_TARGETS_WORKER"] = str(worker_id)


class SquaresDataset:
    """A map-style dataset of ``size`` items: (i, i*i, the worker_init_fn's
    worker id seen by the worker); torch's Dataset protocol without
    importing torch here."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        return index, index * index, int(os.environ.get("MP_TARGETS_WORKER", "-1"))


class FailingDataset(SquaresDataset):
    """Raises on item ``bad``."""

    def __init__(self, size: int, bad: int) -> None:
        super().__init__(size)
        self.bad = bad

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        if index == self.bad:
            raise ValueError(f"item {index} is broken on purpose")
        return super().__getitem__(index)
