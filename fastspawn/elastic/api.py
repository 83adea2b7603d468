"""The public types of ``fastspawn.elastic``, as torch names them: ``Std``,
``ProcessFailure``, ``RunProcsResult``, ``SignalException``."""

from __future__ import annotations

import datetime
import enum
import json
import logging
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


_NOT_AVAILABLE = "<N/A>"
_EMPTY_ERROR_DATA = {"message": "<NONE>"}
# torch's ProcessFailure.message for a rank that exited (not signalled)
# without an error file; users and tests match it byte for byte.
_NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
# ... and what torch adds to its error_file_data then.
_NO_ERROR_FILE_TRAITS = {"category": "system_terminated_error", "retryability": "False"}


class SignalException(Exception):
    """The launcher got a termination signal; ``sigval`` says which, so the
    caller can ``close(e.sigval)``."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


class Std(enum.IntFlag):
    """Which standard streams to redirect or tee."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, value: str) -> Std | dict[int, Std]:
        """``"0"``..``"3"`` for every rank, or ``"rank:value,..."`` per rank
        (``"0:1,1:2"``).

        Raises:
            ValueError: anything else (``"11"``, ``"0:1,"``, ``"1,0:1"``).
        """
        if re.fullmatch(r"[0-3]", value):
            return cls(int(value))
        if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", value):
            result: dict[int, Std] = {}
            for item in value.split(","):
                rank, std = item.split(":")
                result[int(rank)] = cls(int(std))
            return result
        raise ValueError(
            f"{value!r} is not a Std spec: give one of 0 (none), 1 (stdout), 2 (stderr), "
            "3 (both), or rank:value pairs such as '0:1,1:2'"
        )


def to_map(value: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand ``value`` to every rank in ``range(local_world_size)``; ranks a
    mapping leaves out get ``Std.NONE``."""
    if isinstance(value, Std):
        return dict.fromkeys(range(local_world_size), value)
    return {rank: Std(value.get(rank, Std.NONE)) for rank in range(local_world_size)}


@dataclass
class ProcessFailure:
    """A failed rank: its exit code and what its error file says.

    ``rank_stacks`` (fastspawn's addition): ``{local rank: text}``, the
    Python stacks of the ranks that still ran when this one failed, taken
    before they were stopped (empty with ``stacks=False``).
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)
    message: str = field(init=False)
    timestamp: int = field(init=False)
    rank_stacks: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.error_file_data = dict(_EMPTY_ERROR_DATA)
        self.message = ""
        self.timestamp = int(time.time())
        if os.path.islink(self.error_file):
            # Not the rank's (it never writes through a link): what it
            # points to may be anything.
            log.warning(
                "rank %d: its error file %s is a symbolic link, which fastspawn does not "
                "follow; reporting its exit code instead",
                self.local_rank,
                self.error_file,
            )
            self.error_file = _NOT_AVAILABLE
        elif os.path.isfile(self.error_file):
            try:
                self._read_error_file()
            except (OSError, ValueError, LookupError, TypeError) as exc:
                # Cut short (the rank was killed while writing it), or not
                # ours: the exit code says what is known.
                log.warning(
                    "rank %d: its error file %s could not be read (%s: %s); reporting "
                    "its exit code instead",
                    self.local_rank,
                    self.error_file,
                    type(exc).__name__,
                    exc,
                )
                self.error_file_data = dict(_EMPTY_ERROR_DATA)
                self.message = ""
        else:
            self.error_file = _NOT_AVAILABLE
        if not self.message:
            if self.exitcode < 0:
                self.message = (
                    f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                )
            else:
                # torch's words: sys.exit(), os._exit() or a binary that
                # records nothing; exitcode says the rest.
                self.error_file_data["errorTraits"] = dict(_NO_ERROR_FILE_TRAITS)
                self.message = _NO_ERROR_FILE_MESSAGE

    def _read_error_file(self) -> None:
        # O_NOFOLLOW: a link put there since the check above is not followed.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        with open(os.open(self.error_file, flags)) as f:
            owner = os.fstat(f.fileno()).st_uid
            if owner != os.geteuid():
                # Not the rank's (it writes only a file of its own): what
                # another user put there says nothing of the rank.
                raise ValueError(f"it belongs to uid {owner}, not to the run's user")
            data = json.load(f)
        message = data["message"]
        if isinstance(message, str):
            self.message = message
            self.timestamp = int(data.get("timestamp", 0))
        else:
            self.message = str(message["message"])
            self.timestamp = int(message["extraInfo"]["timestamp"])
        self.error_file_data = data

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local time, ``YYYY-MM-DD_HH:MM:SS`` (what torch's
        ``ChildFailedError`` shows)."""
        return datetime.datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def signal_name(self) -> str:
        """``SIGSEGV`` for a rank killed by signal 11; ``<N/A>`` for one
        that exited, or died by a signal without a name (as in torch)."""
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                pass
        return _NOT_AVAILABLE


@dataclass
class RunProcsResult:
    """What ``wait`` returns: all succeeded, or the failure(s) that ended the
    run; after a failure, ``rank_stacks`` (fastspawn's addition) holds the
    Python stacks of the ranks that still ran then, by local rank."""

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    rank_stacks: dict[int, str] = field(default_factory=dict, repr=False)

    def is_failed(self) -> bool:
        return len(self.failures) > 0
