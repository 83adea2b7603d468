"""How long a run takes and how far it is: each round's duration estimated
from the warm-up launches, and the progress shown while the rounds run (a
status line on a terminal, a log line every few seconds elsewhere)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence


def clock(seconds: float) -> str:
    """A duration for people: ``"8 s"``, ``"1 min 25 s"``, ``"14 min"``."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, rest = divmod(whole, 60)
    if minutes >= 10 or rest == 0:
        return f"{round(whole / 60)} min"
    return f"{minutes} min {rest} s"


class Estimate:
    """Seconds a round of a method takes at a number of ranks.

    Starting ranks costs CPU per rank, so a round's time is taken to grow
    linearly with nprocs, through two warm-up launches: one rank, and
    ``probe`` ranks.  The first launch of a method also pays its one-off
    costs (starting a server, filling caches); the line keeps the smaller
    of the two times at one rank.
    """

    def __init__(self) -> None:
        self._points: dict[str, dict[int, float]] = {}

    def add(self, method: str, nprocs: int, seconds: float) -> None:
        self._points.setdefault(method, {})[nprocs] = seconds

    def round_s(self, method: str, nprocs: int) -> float:
        points = self._points.get(method, {})
        if not points:
            return 0.0
        one = min(points.values())
        probe, at_probe = max(points.items())
        if probe <= 1:
            return one * nprocs
        slope = max(0.0, (at_probe - one) / (probe - 1))
        return one + slope * (nprocs - 1)


class Progress:
    """What the run says while it measures, on ``stream`` (stderr).

    On a terminal, one status line rewritten after every round; elsewhere
    (a log, CI, a pipe) a line every ``interval`` seconds.  Both give the
    rounds done, the time spent and an estimate of the time left: the
    warm-up's estimate of the rounds still to run, scaled by how far the
    rounds run so far came from theirs.
    """

    def __init__(self, stream: Any, interval: float = 10.0) -> None:
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())
        self.interval = interval
        self.shown = False
        self._planned: list[float] = []
        self._done = 0
        self._started = 0.0
        self._last_line = 0.0

    def say(self, text: str) -> None:
        """A line that stays (on a terminal, above the status line)."""
        self.clear()
        self.stream.write(f"fastspawn bench: {text}\n")
        self.stream.flush()

    def status(self, text: str) -> None:
        """A passing state (the warm-up): on a terminal only."""
        if self.tty:
            self.stream.write(f"\r\x1b[Kfastspawn bench: {text}")
            self.stream.flush()
            self.shown = True

    def begin(self, planned_s: Sequence[float]) -> None:
        """The measured rounds start; ``planned_s`` is each one's estimate."""
        self._planned = list(planned_s)
        self._done = 0
        self._started = self._last_line = time.monotonic()

    def left_s(self) -> float:
        """The estimated time to the last round's end."""
        elapsed = time.monotonic() - self._started
        done_estimate = sum(self._planned[: self._done])
        scale = elapsed / done_estimate if self._done and done_estimate > 0 else 1.0
        return sum(self._planned[self._done :]) * scale

    def _line(self) -> str:
        elapsed = time.monotonic() - self._started
        return (
            f"{self._done}/{len(self._planned)} rounds, {clock(elapsed)} spent, "
            f"about {clock(self.left_s())} left"
        )

    def round_starts(self, label: str) -> None:
        if self.tty:
            self.status(f"{self._line()}: {label}")

    def round_done(self) -> None:
        self._done += 1
        now = time.monotonic()
        if not self.tty and now - self._last_line >= self.interval:
            self._last_line = now
            self.say(self._line())

    def clear(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
