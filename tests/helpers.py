"""Small helpers shared by the test modules (not worker functions)."""

from __future__ import annotations

import psutil


def gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or a zombie (an
    orphaned one is reaped by whoever adopted it, not by us)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
