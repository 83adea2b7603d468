"""The caller of one round of tests/test_chaos.py, run as a script.

``python chaos_driver.py <config json>`` launches ``nprocs`` ranks of
:func:`rank_main` with the round's start method, joins them, and writes what
it saw as JSON lines to ``<folder>/events``: ``ready`` just before the
launch (the test times its kill from there), then ``result``, then
``after``: how one more launch went (a helper killed is replaced).  The test may
SIGKILL this process, its zygote, guard or warden, or a rank, at any moment.

Each rank records itself, and each process it starts records itself
(``<folder>/pids/<role>-<pid>-<start time>``, written by that process
before it does anything else), so the test knows every pid a round made, whoever died.  A
rank writes ``<folder>/done-<rank>`` as its last step before returning, and
``<folder>/fail-<rank>`` just before it raises or exits non-zero: a rank with
neither marker, or a fail marker, certainly failed, whatever the caller says.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import fastspawn

SLEEP = "/bin/sleep"
EXIT_CODE = 3  # the exit code of a rank whose fate is "exit"


def record(folder: str, role: str) -> None:
    """Name this process in ``folder``/pids, with its start time (clock
    ticks after boot, /proc/self/stat field 22), so the test tells it from
    a later process given the same pid: it checks it is gone."""
    with open("/proc/self/stat") as f:
        ticks = f.read().rsplit(")", 1)[1].split()[19]
    with open(os.path.join(folder, "pids", f"{role}-{os.getpid()}-{ticks}"), "w"):
        pass


def mark(folder: str, name: str) -> None:
    with open(os.path.join(folder, name), "w"):
        pass


def _become_sleeper(folder: str, role: str) -> None:
    """In a freshly forked child: record, drop the inherited stdio (the
    driver's log), exec a long sleep.  Never returns."""
    try:
        record(folder, role)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv(SLEEP, [SLEEP, "600"])
    finally:
        os._exit(127)


def start_grandchild(folder: str, rank: int) -> int:
    """A child of this rank (in its process group): a pidfd of it."""
    pid = os.fork()
    if pid == 0:
        _become_sleeper(folder, f"grandchild{rank}")
    return os.pidfd_open(pid)


def start_daemon(folder: str, rank: int) -> int:
    """A daemon: double fork and setsid, so it is nobody's child here and in
    a session of its own.  A pidfd of it, or -1 if it is gone already: the
    zygote, a subreaper, adopts it at once, and kills the orphans it holds
    whenever a worker exits."""
    reader, writer = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(reader)
            os.setsid()
            daemon = os.fork()
            if daemon == 0:
                _become_sleeper(folder, f"daemon{rank}")
            os.write(writer, str(daemon).encode())
        finally:
            os._exit(0)
    os.close(writer)
    try:
        with os.fdopen(reader, "rb") as f:
            daemon = int(f.read() or b"0")
    finally:
        os.waitpid(middle, 0)
    try:
        return os.pidfd_open(daemon) if daemon else -1
    except ProcessLookupError:
        return -1


def rank_main(rank: int, folder: str, plans: list[dict[str, Any]]) -> int:
    """One rank: record, maybe start a grandchild and a daemon, sleep, then
    return its rank, raise or exit non-zero as its plan says.  With
    ``tidy``, it stops its own children before it ends (fork and spawn
    leave a rank's children to it while the caller lives, as
    multiprocessing does; the zygote kills them itself)."""
    import signal

    plan = plans[rank]
    record(folder, f"rank{rank}")
    children = []
    try:
        if plan["grandchild"]:
            children.append(start_grandchild(folder, rank))
        if plan["daemon"]:
            children.append(start_daemon(folder, rank))
        time.sleep(plan["sleep"])
        if plan["fate"] == "raise":
            mark(folder, f"fail-{rank}")
            raise ValueError(f"chaos: rank {rank} raises")
        if plan["fate"] == "exit":
            mark(folder, f"fail-{rank}")
            sys.exit(EXIT_CODE)
    finally:
        for pidfd in children:
            if pidfd < 0:
                continue
            if plan["tidy"]:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                except ChildProcessError:
                    pass  # the daemon: not ours to reap
            os.close(pidfd)
    mark(folder, f"done-{rank}")
    return rank


def warm_up(rank: int) -> int:
    return rank


def _say(folder: str, event: dict[str, Any]) -> None:
    with open(os.path.join(folder, "events"), "a") as f:
        f.write(json.dumps(event) + "\n")


def _helpers() -> list[int]:
    from fastspawn._warden import client as _warden_client
    from fastspawn._zygote import client

    return sorted(client.helper_processes()[0] | _warden_client.warden_process()[0])


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc)[-600:],
        "error_index": getattr(exc, "error_index", None),
        "exit_code": getattr(exc, "exit_code", None),
        "signal_name": getattr(exc, "signal_name", None),
        "traceback": "" if isinstance(exc, fastspawn.ProcessException) else traceback.format_exc(),
    }


def _later_joins(ctx: fastspawn.ProcessContext, nprocs: int) -> dict[str, Any]:
    """After a failure, join on as torch callers do: each call raises for
    one more rank that ended badly, then True.  What those said."""
    later = []
    for _ in range(nprocs + 1):
        try:
            if ctx.join(timeout=60):
                return {"later": later, "final": True}
        except fastspawn.ProcessException as exc:
            later.append([type(exc).__name__, exc.error_index])
    return {"later": later, "final": False}


def launch(config: dict[str, Any]) -> dict[str, Any]:
    """The launch and its join; what it returned or raised."""
    method, nprocs, folder = config["method"], config["nprocs"], config["folder"]
    args = (folder, config["plans"])
    ctx = None
    try:
        if config["join"] == "blocking":
            ctx = fastspawn.start_processes(rank_main, args, nprocs=nprocs, start_method=method)
        else:
            ctx = fastspawn.start_processes(
                rank_main, args, nprocs=nprocs, join=False, start_method=method
            )
            while not ctx.join(timeout=config["poll"]):
                pass
    except Exception as exc:
        outcome = {"outcome": "raised", **_describe(exc)}
        if ctx is not None and isinstance(exc, fastspawn.ProcessException):
            outcome.update(_later_joins(ctx, nprocs))
        return outcome
    return {
        "outcome": "returned",
        "return_values": {str(k): v for k, v in ctx.return_values.items()},
        "exitcodes": [p.exitcode for p in ctx.processes],
    }


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's, should we hang
    config = json.loads(sys.argv[1])
    folder = config["folder"]
    if config["warm"]:  # the helpers run before the launch under test
        fastspawn.start_processes(warm_up, nprocs=1, start_method=config["method"])
    _say(folder, {"event": "ready", "helpers": _helpers(), "time": time.monotonic()})
    outcome = launch(config)
    _say(folder, {"event": "result", "helpers": _helpers(), "time": time.monotonic(), **outcome})
    # Whatever was killed, the next launch works (a new zygote or warden).
    try:
        ctx = fastspawn.start_processes(warm_up, nprocs=2, start_method=config["method"])
        after: dict[str, Any] = {"outcome": "returned", "return_values": ctx.return_values}
    except Exception as exc:
        after = {"outcome": "raised", **_describe(exc)}
    _say(folder, {"event": "after", "time": time.monotonic(), **after})


if __name__ == "__main__":
    main()
