"""The exception family of torch.multiprocessing, field for field."""

from __future__ import annotations

import signal
from typing import Any


class ProcessException(Exception):
    """A worker process failed.

    Attributes:
        msg: the message.
        error_index: the rank that failed.
        error_pid: its pid (also available as ``pid``).
        rank_stacks: ``{rank: text}``, the Python stacks of the other ranks
            that still ran when this one failed, taken before they were
            stopped (fastspawn's addition: empty with ``stacks=False``).
    """

    __slots__ = ["error_index", "error_pid", "msg", "rank_stacks"]

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.rank_stacks: dict[int, str] = {}

    @property
    def pid(self) -> int:
        """The failed process's pid (upstream versions name it either way)."""
        return self.error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid), self._state()

    def _state(self) -> dict[str, Any] | None:
        """What pickling keeps beside the constructor's arguments."""
        return {"rank_stacks": self.rank_stacks} if self.rank_stacks else None

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        if state:
            self.rank_stacks = dict(state.get("rank_stacks", {}))


class ProcessRaisedException(ProcessException):
    """A worker raised an exception; the message carries its traceback."""


class ProcessExitedException(ProcessException):
    """A worker exited with a non-zero code or was killed by a signal."""

    __slots__ = ["exit_code", "signal_name"]

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name),
            self._state(),
        )


def signal_name(signum: int) -> str:
    """``SIGABRT`` for 6; ``<Unknown signal N>`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


def raised_exception(rank: int, pid: int, traceback: str) -> ProcessRaisedException:
    """What join raises for a rank that raised: torch's heading, then the
    rank's formatted traceback."""
    msg = f"\n\n-- Process {rank:d} terminated with the following error:\n" + traceback
    return ProcessRaisedException(msg, rank, pid)


def exited_exception(rank: int, pid: int, exit_code: int) -> ProcessExitedException:
    """What join raises for a rank that exited non-zero (``exit_code`` > 0)
    or was killed (``exit_code``: minus the signal number)."""
    if exit_code < 0:
        name = signal_name(-exit_code)
        return ProcessExitedException(
            f"process {rank:d} terminated with signal {name}",
            error_index=rank,
            error_pid=pid,
            exit_code=exit_code,
            signal_name=name,
        )
    return ProcessExitedException(
        f"process {rank:d} terminated with exit code {exit_code:d}",
        error_index=rank,
        error_pid=pid,
        exit_code=exit_code,
    )
