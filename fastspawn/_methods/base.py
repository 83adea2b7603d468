"""The surface every start method offers (see registry for the names)."""

from __future__ import annotations

import socket

from fastspawn._channel import Receiver

TYPE_CHECKING = False
if TYPE_CHECKING:
    from fastspawn._launch import LaunchRequest, Started


class StartMethod:
    """How the workers of one launch come to life.

    A method is a module-level instance of a subclass, registered by name
    (``registry.register``).  Its class attributes answer what the rest of
    fastspawn asks of a method:

    Attributes:
        name: what ``start_method=`` says.
        pickles_arguments: fn and args travel pickled, so they are checked
            for picklability before anything starts.
        supports_preload: ``preload=`` applies (modules imported once by a
            long-lived process the workers are forked from).
        caller_reaps: the workers are the caller's own children, reaped
            with waitid on their pidfds; else another process's (the
            zygote's), whose exit statuses come on the launch's channel.
        spawn_accepts: ``fastspawn.spawn()`` takes it as it is; any other
            method gets torch's FutureWarning and the default method.
    """

    name = ""
    pickles_arguments = True
    supports_preload = False
    caller_reaps = True
    spawn_accepts = False

    def __repr__(self) -> str:
        return f"<fastspawn start method {self.name!r}>"

    def check(self, request: LaunchRequest) -> None:
        """Refuse, with an error that says what to do, a request this
        method cannot start here; called before anything starts."""

    def launch(
        self, request: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started
    ) -> None:
        """Start every rank of ``request``, each appended to ``started`` as
        ``(pid, pidfd)`` as it starts, reporting on ``tx`` (the caller's
        copy of it is closed by the caller); on failure nothing is left
        running, ``started`` is empty, and the error is raised.  Sets
        ``request.group`` and ``request.watched_groups`` where the workers
        get a process group."""
        raise NotImplementedError

    def helper_pids(self) -> set[int]:
        """The long-lived processes this method keeps for the caller (the
        zygote and its guard), if any runs."""
        return set()
