"""One bench run's session: the ranks' report FIFO (Reports) and the
launches live in it (Session), for a teardown that leaves nothing."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from fastspawn._bench.common import BenchError
from fastspawn._bench.ranks import _RECORD
from fastspawn._os import oscall

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from fastspawn._bench.ranks import RankSpec


class Launched:
    """The processes of one launch, whatever started them."""

    def pids(self) -> list[int]:
        raise NotImplementedError

    def problem(self) -> str | None:
        """What went wrong if some process already ended, else None."""
        raise NotImplementedError

    def release(self, ranks: Iterable[int]) -> None:
        """Let these ranks go on (they are alive, blocked in sigtimedwait).

        The signal goes to each rank's main thread, where rank_main blocks
        it and waits for it, and to no other: sent to the process, it could
        land in a thread started before the block (``import torch`` starts
        some), whose default action for it would kill the rank."""
        pids = self.pids()
        for rank in ranks:
            oscall.signal_thread(pids[rank], pids[rank], signal.SIGUSR1)

    def join(self) -> None:
        """Wait for every process to end successfully, and reap it."""
        raise NotImplementedError

    def join_failure(self) -> None:
        """Wait for one rank's failure and the teardown of the others."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL and reap whatever still runs; safe to call in any state."""
        raise NotImplementedError


class Reports:
    """The FIFO the ranks write their records to, and the records read so far."""

    STALL_S = 300.0  # no record and no rank exit for this long: give up

    def __init__(self, directory: str) -> None:
        import fcntl

        self.path = os.path.join(directory, "reports")
        os.mkfifo(self.path, 0o600)
        # Read-write: we count as a writer, so the FIFO never reads as EOF
        # between ranks and a rank's open(O_WRONLY) never blocks.
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass  # over /proc/sys/fs/pipe-max-size or the user's pipe quota
        self.capacity = fcntl.fcntl(self.fd, fcntl.F_GETPIPE_SZ)
        self._partial = b""
        self._seen: dict[tuple[int, int], dict[int, float]] = {}

    @property
    def max_ranks(self) -> int:
        """Ranks whose records fit at once: one more would block writing."""
        return self.capacity // _RECORD.size

    def _read(self) -> bool:
        """Take in what the FIFO holds; True when something came."""
        got = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return got
            got = True
            data = self._partial + data
            whole = len(data) - len(data) % _RECORD.size
            for round_id, rank, kind, when in _RECORD.iter_unpack(data[:whole]):
                self._seen.setdefault((round_id, kind), {})[rank] = when
            self._partial = data[whole:]

    def wait(
        self, round_id: int, kind: int, count: int, launched: Launched | None
    ) -> dict[int, float]:
        """``{rank: time}`` once ``count`` ranks sent a ``kind`` record.

        With ``launched``, wait as long as its processes live and report;
        without, the records must be there already (their writers exited).
        """
        import select

        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        news = time.monotonic()
        while True:
            if self._read():
                news = time.monotonic()
            if len(self._seen.get((round_id, kind), {})) >= count:
                return self._seen.pop((round_id, kind))
            if launched is None:
                if time.monotonic() - news > 2.0:
                    raise BenchError(
                        f"{count - len(self._seen.get((round_id, kind), {}))} rank(s) "
                        "exited without their report"
                    )
            elif time.monotonic() - news > self.STALL_S:
                raise BenchError(f"no rank reported for {self.STALL_S:.0f} s; giving up")
            if not poller.poll(500) and launched is not None:
                # Checked only when nothing comes: polling hundreds of ranks
                # while they start would slow the start that is measured.
                problem = launched.problem()
                if problem is not None:
                    raise BenchError(problem)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Session:
    """What every round shares: the report FIFO, the options, live launches."""

    def __init__(
        self,
        reports: Reports,
        imports: Sequence[str],
        payload_bytes: int,
        binary: str,
        live: list[Launched],
        pause: float = 0.0,
        cpu: bool = False,
    ) -> None:
        self.reports = reports
        self.imports = tuple(imports)
        self.payload = bytes(payload_bytes)
        self.pause = pause  # seconds slept before each timed launch (--pause)
        self.cpu = cpu  # each launch's CPU time measured (fastspawn._bench.cputime)
        self.binary = binary
        # Launches not yet reaped: what an interruption must kill.
        self.live = live
        self._round_id = 0

    def spec(self, fail_rank: int) -> RankSpec:
        """The ranks' argument for a new round (its own id: stale records never count)."""
        self._round_id += 1
        return (
            self.reports.path,
            os.getpid(),
            self._round_id,
            self.imports,
            self.payload,
            fail_rank,
        )
