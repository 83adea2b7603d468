"""The Popen of fastspawn's contexts: what multiprocessing's Process drives
(``pid``, ``sentinel``, ``poll``, ``wait``, ``terminate``, ``kill``,
``close``), over a one-rank fastspawn launch.

The process object travels as a launch's argument, pickled with the fds of
the Connections, Queues, Locks and shared tensors it carries (see
fastspawn._wire.pickling) for the zygote and spawn, in memory for fork; in
the worker, fastspawn._mp.child runs it.  The launch brings fastspawn's
orphan safety (the worker and its own children die with the caller) and
pidfd waits.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from multiprocessing import process as mp_process
from multiprocessing import util

from fastspawn._launch.api import launch_context
from fastspawn._launch.methods import common, registry
from fastspawn._launch.methods.base import LaunchRequest
from fastspawn._launch.methods.names import context_name
from fastspawn._mp import child
from fastspawn._os.oscall import wait_readable
from fastspawn._wire import pickling

# At exit, multiprocessing's own end (its finalizers, a Manager's shutdown
# among them; then daemonic processes terminated, the others joined) must
# come before fastspawn's (fastspawn._launch.exiting), which waits for every
# launch still running (a Manager's server would never end) and then stops
# the zygote.  Registered after fastspawn's, it runs first; its second run,
# multiprocessing's own registration, does nothing.
atexit.register(util._exit_function)  # type: ignore[attr-defined]


def main_definitions() -> dict[str, bytes]:
    """The functions and classes a ``__main__`` without a file defines (a
    notebook's, ``python -c``'s), each pickled by value: the process puts
    them in its own ``__main__``, where what multiprocessing's own queues
    send by name (a Pool's task, an executor's) is then found.  One that
    cannot travel (or carries an fd) is left out: a task naming it fails
    there as it would under spawn."""
    import types

    main = sys.modules.get("__main__")
    found: dict[str, bytes] = {}
    for name, obj in list(vars(main).items()) if main is not None else []:
        if name.startswith("__") or not isinstance(obj, (types.FunctionType, type)):
            continue
        if getattr(obj, "__module__", None) != "__main__":
            continue
        collector = pickling.FdCollector()
        try:
            data = pickling.dumps([obj], collector)
        except Exception:  # whatever pickling raises: it stays behind
            continue
        if not collector.fds:
            found[name] = data
    return found


class Popen:
    """One process started by fastspawn for multiprocessing.

    Attributes:
        method: the context's name ("fastspawn", "fastspawn-spawn", ...).
        pid: the process's pid.
        sentinel: an fd that polls readable once the process has exited;
            open until ``close()`` (multiprocessing waits on it after the
            exit too).
        returncode: the exit code, minus the signal number, or None while
            it runs.
    """

    def __init__(self, process_obj: mp_process.BaseProcess, method: str) -> None:
        util._flush_std_streams()  # type: ignore[attr-defined]
        self.method = context_name(method)
        self.returncode: int | None = None
        self.finalizer: util.Finalize | None = None
        self._lock = threading.Lock()  # one thread collects the status
        prepared = child.preparation()
        if not pickling.main_is_importable():
            prepared["main"] = main_definitions()
        # A terminal's foreground job keeps its processes in its own group,
        # as multiprocessing's are: Ctrl-C reaches them too, and a process
        # it does not stop would be waited for at exit.  (fork and spawn
        # decide that themselves; the zygote is asked to.)
        foreground = common.foreground_on_a_terminal()
        start_method = registry.get(method)
        # A process started with fork or spawn is the caller's child, bound
        # to it (PR_SET_PDEATHSIG), in a process group the caller's warden
        # watches until it is empty.  Its own processes must outlive it, as
        # multiprocessing's do: they stay in that group, unbound, and die
        # with the program's first process.  (The zygote's come from the
        # zygote, through the caller's link: fastspawn._zygote.link.)
        outlive = start_method.caller_reaps and child.in_watched_group
        prepared["in_watched_group"] = start_method.caller_reaps and (outlive or not foreground)
        request = LaunchRequest(
            fn=child.run,
            args=(process_obj, prepared),
            nprocs=1,
            daemon=bool(process_obj.daemon),
            method=start_method,
            process_group=not foreground,
            caller_group=foreground,
            mp_process=True,
            outlive_caller=outlive,
        )
        self._context = launch_context(request)
        self._process = self._context.processes[0]
        self.pid = self._process.pid
        # The worker's pidfd closes once its status is in; multiprocessing
        # waits on the sentinel until the Process is closed.
        self.sentinel = os.dup(self._process.sentinel)
        self.finalizer = util.Finalize(self, os.close, (self.sentinel,))

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"returncode={self.returncode}"
        return f"<fastspawn Popen {self.method!r} pid={self.pid} {state}>"

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The exit code if the process has exited (else None); with
        ``flag`` 0, wait for the exit."""
        if self.returncode is None and not flag & os.WNOHANG:
            wait_readable([self.sentinel], None)
        if self.returncode is None:
            with self._lock:
                if self.returncode is None:
                    code = self._process.exitcode  # the zygote's word of it: ms
                    if code is not None:
                        self.returncode = code
                        self._context._finish()  # the launch's channel and waiter
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: no limit) for the exit;
        the exit code, or None if the process still runs."""
        if self.returncode is None:
            if timeout is not None and not wait_readable([self.sentinel], max(timeout, 0.0)):
                return None
            return self.poll(0)
        return self.returncode

    def interrupt(self) -> None:
        """SIGINT, through the pidfd: what Python 3.14's
        ``Process.interrupt()`` calls."""
        if self.returncode is None:
            self._process.interrupt()

    def terminate(self) -> None:
        """SIGTERM, through the pidfd (never to a process that took its pid)."""
        if self.returncode is None:
            self._process.terminate()

    def kill(self) -> None:
        """SIGKILL, through the pidfd."""
        if self.returncode is None:
            self._process.kill()

    def close(self) -> None:
        """Release the sentinel (multiprocessing's ``Process.close()``)."""
        if self.finalizer is not None:
            self.finalizer()
