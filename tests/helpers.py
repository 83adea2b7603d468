"""Small helpers shared by the test modules (not worker functions)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil


def gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or a zombie (an
    orphaned one is reaped by whoever adopted it, not by us)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_driver(driver: subprocess.Popen[str]) -> None:
    """SIGKILL a driver process of ours, reap it, close its stdout pipe."""
    driver.kill()
    driver.wait(timeout=30)
    if driver.stdout is not None:
        driver.stdout.close()


def alive_after(pids: list[int], seconds: float = 1.0) -> list[int]:
    """The ``pids`` still alive ``seconds`` from now (the bound is the
    behaviour under test: a kill must land that fast)."""
    time.sleep(seconds)
    return [pid for pid in pids if not gone(pid)]


def run_script(
    path: Path, code: str, command: list[str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Write ``code`` (dedented) to ``path`` and run it with this Python
    (or ``command``), output captured as text, within 120 s."""
    path.write_text(textwrap.dedent(code))
    return subprocess.run(
        command or [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )
