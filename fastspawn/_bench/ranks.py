"""What every rank of every method runs (rank_main): the ranks' ``fn``
module, which spawn-like ranks import to unpickle it, and whose source the
floors' helpers run (floor._FLOOR_PROGRAM).  It imports only what a rank
needs (not even typing): a spawned rank must not pay for the bench's own
imports, nor a floor's helper grow (see the package's docstring for the
records a rank writes)."""

from __future__ import annotations

import errno
import os
import signal
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    # (report FIFO path, bench pid, round id, modules to import, payload, failing rank or -1)
    RankSpec = tuple[str, int, int, tuple[str, ...], bytes, int]
    Record = dict[str, Any]


_RECORD = struct.Struct("<iiid")  # round id, rank, kind, time.monotonic() of the event
ENTERED, EXITED, FAILED = 1, 2, 3
# A floor's helper sets its pid here (floor._FLOOR_PROGRAM): its ranks,
# whose release it alone can ask for, end once it is gone.
floor_helper: int | None = None


def rank_main(rank: int, spec: RankSpec) -> None:
    """The bench's ``fn``: report entry, wait for release, report exit or fail.

    ``spec`` is (report FIFO path, bench pid, round id, modules to import,
    payload, the rank that must fail or -1); the payload is only carried.
    """
    fifo, bench_pid, round_id, modules, _payload, fail_rank = spec
    # Blocked from the start, the release signal stays pending until
    # sigtimedwait takes it: it can never kill us by its default action.  It
    # comes to this (the main) thread alone (Launched.release): threads
    # started before this block, which do not block it, never see it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    # A forked rank inherits the bench's SIGTERM handler; a teardown's SIGTERM
    # must simply kill.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in modules:
        __import__(name)  # the user's heavy imports, paid as a real fn's module pays them
    entered = time.monotonic()
    try:
        bench = os.pidfd_open(bench_pid)
    except ProcessLookupError:
        os._exit(1)  # the bench is gone: nobody will release or reap us
    try:
        # Not blocking: with the bench gone (its read end closed, the FIFO
        # maybe removed), a blocking open would wait for a reader for ever,
        # before the pidfd above is ever polled.  The bench holds the read
        # end from before any launch, so ENXIO means it is gone.
        out = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):
            os._exit(1)
        raise
    os.set_blocking(out, True)
    try:
        os.write(out, _RECORD.pack(round_id, rank, ENTERED, entered))
        _wait_for_release(bench)
        if rank == fail_rank:
            os.write(out, _RECORD.pack(round_id, rank, FAILED, time.monotonic()))
            # multiprocessing prints a failing target's traceback; a planned
            # failure's is noise on the bench's terminal.
            sys.stderr = open(os.devnull, "w")  # lives as long as the rank
            raise RuntimeError("the failure this fastspawn bench round asked for")
        os.write(out, _RECORD.pack(round_id, rank, EXITED, time.monotonic()))
    finally:
        os.close(out)
        os.close(bench)


def _wait_for_release(bench_pidfd: int) -> None:
    """Sleep until SIGUSR1 comes; exit if the bench (or a floor's helper)
    dies first."""
    import select

    poller = select.poll()
    poller.register(bench_pidfd, select.POLLIN)
    while signal.sigtimedwait([signal.SIGUSR1], 1.0) is None:
        if poller.poll(0):  # the bench's pidfd polls readable once it has exited
            os._exit(1)
        if floor_helper is not None and os.getppid() != floor_helper:
            os._exit(1)
