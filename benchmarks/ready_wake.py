"""What waking a ready, pre-forked worker costs beyond the bare pre-forked
floor: a prototype's measurement for issue 31 (ready workers), not a
fastspawn code path.

From this process (gc.freeze()d, torch imported with ``--torch``), per
round, each timed from t0 to the last child's byte on a pipe:

- fork loop: N bare ``os.fork()`` children, each writes a byte and exits;
- pre-forked: N children forked ahead (untimed, 0.2 s to settle), each
  woken by one write on a socketpair of its own;
- wake with payload: the same, woken instead by one message carrying two
  fds (a socket, as a launch's channel, and a memfd payload), each child
  reading the payload, unpickling a launch header (this process's
  environment, cwd and sys.path) and a trivial fn, taking the header's
  state on (environment cleared and refilled), running fn;
- warmed: the same, but each child ran that wake path once on this
  process's own state before waiting (paying its copy-on-write faults
  then), and keeps its environment when the header's equals it.

    python benchmarks/ready_wake.py --nprocs 64 --rounds 9 [--torch]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import socket
import statistics
import sys
import time
from collections.abc import Callable


def _noop(rank: int) -> None:
    pass


def _collect(fd: int, count: int) -> float:
    got = 0
    while got < count:
        got += len(os.read(fd, 65536))
    return time.perf_counter()


def _reap(count: int) -> None:
    for _ in range(count):
        os.wait()


def _take_on(payload: bytes, header_size: int, keep_equal_env: bool) -> None:
    env, cwd, path = pickle.loads(payload[:header_size])
    if not keep_equal_env or env != os.environ:
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    fn, args = pickle.loads(payload[header_size:])
    fn(*args)


def fork_loop(nprocs: int) -> float:
    done_r, done_w = os.pipe()
    t0 = time.perf_counter()
    for _ in range(nprocs):
        if os.fork() == 0:
            os.write(done_w, b"x")
            os._exit(0)
    elapsed = _collect(done_r, nprocs) - t0
    _reap(nprocs)
    os.close(done_r)
    os.close(done_w)
    return elapsed


def preforked(nprocs: int, payload: bool, warmed: bool) -> float:
    done_r, done_w = os.pipe()
    header = pickle.dumps((dict(os.environ), os.getcwd(), list(sys.path)))
    work = pickle.dumps((_noop, (1,)))
    ours: list[socket.socket] = []
    for _ in range(nprocs):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            for other in ours:
                other.close()
            mine.close()
            if warmed:
                _take_on(header + work, len(header), keep_equal_env=True)
            if payload:
                _msg, fds, _flags, _addr = socket.recv_fds(theirs, 64, 4)
                _take_on(os.pread(fds[1], 1 << 20, 0), len(header), keep_equal_env=warmed)
            else:
                theirs.recv(1)
            os.write(done_w, b"x")
            os._exit(0)
        theirs.close()
        ours.append(mine)
    time.sleep(0.2)  # every child at its wait
    memfd = os.memfd_create("payload", os.MFD_CLOEXEC)
    os.write(memfd, header + work)
    channel, channel_peer = socket.socketpair()
    t0 = time.perf_counter()
    for mine in ours:
        if payload:
            socket.send_fds(mine, [b"go"], [channel.fileno(), memfd])
        else:
            mine.send(b"g")
    elapsed = _collect(done_r, nprocs) - t0
    _reap(nprocs)
    for mine in ours:
        mine.close()
    for end in (memfd, done_r, done_w):
        os.close(end)
    channel.close()
    channel_peer.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--torch", action="store_true", help="import torch first")
    args = parser.parse_args()
    if args.torch:
        import torch  # noqa: F401
    gc.freeze()
    rows: dict[str, Callable[[], float]] = {
        "fork loop": lambda: fork_loop(args.nprocs),
        "pre-forked": lambda: preforked(args.nprocs, payload=False, warmed=False),
        "wake with payload": lambda: preforked(args.nprocs, payload=True, warmed=False),
        "warmed": lambda: preforked(args.nprocs, payload=True, warmed=True),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            times[name].append(run())
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")
    print(f"{args.nprocs} children, {args.rounds} rounds, torch {args.torch}, CPU {cpu!r}")
    floor = statistics.median(times["pre-forked"])
    loop = statistics.median(times["fork loop"])
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:18s} median {median * 1e3:7.2f} ms ({min(values) * 1e3:.2f}-"
            f"{max(values) * 1e3:.2f})  {median / floor:5.2f}x pre-forked  "
            f"{median / loop:5.2f}x fork loop"
        )


if __name__ == "__main__":
    main()
