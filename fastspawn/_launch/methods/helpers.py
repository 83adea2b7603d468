"""The long-lived helper processes the start methods keep for the caller
(the zygote, and the warden of fork and spawn launches), as the rest of
fastspawn sees them: the only door to their clients outside the methods.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastspawn._warden import client as _warden_client
from fastspawn._zygote import client as _zygote_client
from fastspawn._zygote.client import prefork, preload
from fastspawn._zygote.client import stop_server as stop_zygote

__all__ = ["forget_groups", "linger_groups", "prefork", "preload", "stop_at_exit", "stop_zygote"]


def forget_groups(groups: Sequence[int]) -> None:
    """A launch's workers are all reaped: its groups need no cleanup now,
    by the zygote's watcher or by the warden."""
    if groups:
        _zygote_client.forget_groups(groups)
        _warden_client.forget_groups(groups)


def linger_groups(groups: Sequence[int]) -> None:
    """A fork or spawn launch of multiprocessing processes: the warden is
    to kill its groups at the caller's death until they are empty, not
    until its workers are reaped.  What such a process started (a
    ``subprocess``, in its group) outlives it, as under multiprocessing,
    and dies with the caller."""
    if groups:
        _warden_client.linger(groups)


def stop_at_exit() -> None:
    """At interpreter exit, once the caller's launches are ended: stop the
    zygote, and let go of the warden (which then kills nothing)."""
    _zygote_client.stop_server()
    _warden_client.release_at_exit()
