"""Collects the launch benchmark's results and prints their table at the end.

Loaded only when pytest is pointed at benchmarks/ (testpaths is tests/).
"""

from __future__ import annotations

import pytest
from launch_timing import Result, describe_machine, table

_RESULTS = pytest.StashKey[list[Result]]()


@pytest.fixture
def launch_results(request: pytest.FixtureRequest) -> list[Result]:
    """Where each case appends its :class:`launch_timing.Result`."""
    return request.config.stash.setdefault(_RESULTS, [])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.write_sep("=", "launch latency medians (ms)")
    terminalreporter.write_line(describe_machine())
    terminalreporter.write_line(table(results))
