"""A start method in one file, for test_layout: each rank an os.fork() of
the caller, forked on the calling thread, with no process group.  Importing
this module registers it as "toy"."""

from __future__ import annotations

import os
import signal
import socket

from fastspawn._launch.methods import common, registry
from fastspawn._launch.methods.base import LaunchRequest, Started
from fastspawn._os import oscall
from fastspawn._wire.channel import Receiver
from fastspawn._worker import forked as worker_forked
from fastspawn._worker import runner


class Toy(common.ChildrenOfCaller):
    name = "toy"
    pickles_arguments = False

    def launch(self, req: LaunchRequest, tx: socket.socket, rx: Receiver, started: Started) -> None:
        spec = worker_forked.ForkSpec(
            os.getpid(),
            req.fn,
            req.args,
            tx,
            daemon=req.daemon,
            envs=req.envs,
            close_fds=[rx.fileno()],
        )
        runner.flush_std_streams()
        try:
            for rank in range(req.nprocs):
                with oscall.held_signals():
                    pid = os.fork()
                    if pid == 0:
                        signal.pthread_sigmask(signal.SIG_SETMASK, set())
                        worker_forked.forked_child(spec, rank)
                    started.append((pid, oscall.pidfd_open(pid)))
        except BaseException:
            common.end_group(req, started)
            raise


METHOD = registry.register(Toy())
