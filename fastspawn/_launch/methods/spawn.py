"""Start method "spawn": each worker a fresh interpreter, exec'd by the C
launcher (clone + exec, PR_SET_PDEATHSIG armed before exec).

fn and args are pickled once, with multiprocessing's preparation data, into
a private memfd every worker reads; the caller's main module is imported in
each worker as ``__mp_main__``, as multiprocessing's spawn does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from fastspawn._launch.methods import base, common
from fastspawn._launch.methods.base import LaunchRequest, Started
from fastspawn._os import oscall
from fastspawn._os.launcher_thread import on_launcher_thread
from fastspawn._wire import payload, pickling
from fastspawn._wire.channel import Receiver
from fastspawn._worker import runner, spawned, stdio

_ENTRY = spawned.entry_code(f"{spawned.__name__}.spawn_main")


class Spawn(common.ChildrenOfCaller):
    name = "spawn"
    spawn_accepts = True

    def check(self, request: LaunchRequest) -> None:
        super().check(request)
        common.current_dir()  # its workers start there: a clear error if it is gone
        spawned.check_exec_env(
            request.envs,
            request.nprocs,
            "start_method='spawn' execs each worker with its environment; shorten it or "
            "pass the data another way (a file, an argument to fn), or use "
            "start_method='zygote' or 'fork', which do not exec",
        )

    def launch(self, req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
        on_launcher_thread(_spawn_ranks, req, tx, started)


def _spawn_ranks(req: LaunchRequest, tx: socket.socket, started: Started) -> None:
    payload_fd, user_fds = req.work or common.pickle_work(req)
    try:
        preparation = spawned.preparation_data("fastspawn-worker")
        payload.append_trailer(payload_fd, pickling.dumps([preparation], pickling.FdCollector()))
        tracker = common.tracker_fd()
        argv = [
            sys.executable,
            *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
            "-c",
            _ENTRY,
        ]
        base_env = dict(os.environ)
        runner.flush_std_streams()
        flags = ["1" if req.daemon else "0", "1" if req.stacks else "0"]
        tail = [str(payload_fd), str(tx.fileno()), *flags, str(tracker or -1)]
        tail.append("1" if stdio.stdout_shows_lines() else "0")
        tail += [str(fd) for fd in user_fds]
        keep = [payload_fd, tx.fileno(), *user_fds]
        keep += [tracker] if tracker is not None else []
        with common.launch_group(req, started) as group:
            for rank in range(req.nprocs):
                env = {**base_env, **req.envs.get(rank, {})}
                out, err = req.stdio.get(rank, (-1, -1))
                with oscall.held_signals():  # until the worker is in ``started``
                    started.append(
                        oscall.launch(
                            sys.executable,
                            argv + [str(rank)] + tail,
                            env,
                            stdout=out,
                            stderr=err,
                            keep_fds=keep,
                            pdeathsig=0 if req.outlive_caller else signal.SIGKILL,
                            process_group=group,
                        )
                    )
                    if rank == req.nprocs - 1:
                        base.release_anchor(req)  # here, with the signals still held
    finally:
        common.discard_work(req)


METHOD = Spawn()
