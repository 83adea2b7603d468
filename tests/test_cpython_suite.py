"""CPython's multiprocessing conformance suite, run unchanged with each of
fastspawn's contexts as its start method (see cpython_mp_suite.py): it must
pass as it does with "spawn"."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fastspawn

SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpython_mp_suite.py")


def _suite_installed() -> bool:
    try:
        import test._test_multiprocessing  # noqa: F401
    except ImportError:
        return False
    return True


# CI runs them on one Python version (by hand, the zygote's passes on 3.10,
# 3.12 and 3.13 too): the 30-minute budget.  Spawn's run, the longest (49 s
# against 26 s for each other, Intel Xeon, 2 cores), starts first, and the
# others run in turn beside it: 2 runs at a time on 2 cores.
METHODS = fastspawn.get_all_start_methods()
FIRST = "fastspawn-spawn"
TIMEOUT = 540  # for all four together


class _Run:
    """One run of the suite with ``method`` as its start method, its output
    in a file (a pipe left unread would stop it)."""

    def __init__(self, method: str, folder: Path) -> None:
        self.method = method
        (folder / method).mkdir()
        self.output = folder / method / "stderr"
        with open(self.output, "wb") as output:
            self.process = subprocess.Popen(
                [sys.executable, SUITE],
                stdout=subprocess.DEVNULL,
                stderr=output,
                cwd=folder / method,
                env=dict(os.environ, FASTSPAWN_SUITE_METHOD=method),
            )

    def wait(self, deadline: float) -> str | None:
        """None if it passed, else what went wrong and its output's tail;
        a run past ``deadline`` is killed."""
        try:
            self.process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return f"{self.method!r}: still running after {TIMEOUT} s, killed"
        stderr = self.output.read_text(errors="replace")
        lines = stderr.rstrip().splitlines()
        ran = [int(line.split()[1]) for line in lines if line.startswith("Ran ")]
        passed = self.process.returncode == 0 and lines and lines[-1].startswith("OK")
        if passed and ran and ran[-1] > 100:
            return None
        return f"{self.method!r} (exit code {self.process.returncode}):\n{stderr[-6000:]}"


@pytest.mark.version_neutral
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.skipif(not _suite_installed(), reason="CPython's test package is not installed")
def test_cpython_multiprocessing_suite_passes_with_every_context(tmp_path: Path) -> None:
    assert FIRST in METHODS
    deadline = time.monotonic() + TIMEOUT
    runs = [_Run(FIRST, tmp_path)]
    results = []
    try:
        for method in METHODS:
            if method != FIRST:
                runs.append(_Run(method, tmp_path))
                results.append(runs[-1].wait(deadline))
        results.append(runs[0].wait(deadline))
    finally:
        for run in runs:  # an exception above: none is left running
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()
    failures = [failure for failure in results if failure is not None]
    assert not failures, "CPython's suite failed with " + "\n\n".join(failures)
