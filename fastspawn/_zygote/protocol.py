"""The zygote's control protocol: every message between the caller and its
zygote, defined once and imported by both ends.

The control socket (SOCK_SEQPACKET, one message a datagram) carries:
- first, the caller's Hello: its spawn preparation data and preloads;
- then ControlMessages: PRELOAD (modules to import now), PREFORK (keep
  this many ready workers, with one fd: where the zygote says how many are
  ready once they are, see fastspawn._zygote.ready), LAUNCH (with fds:
  the launch's report channel, its payload memfd, then as many of the
  launch's other fds as fit) and FDS (the launch's fds that did not fit in
  its LAUNCH, MAX_FDS a message, straight after it).
A launch's LaunchHeader travels in its payload memfd, not on the socket,
whose messages are capped (~200 KB, which a large environment or per-rank
envs exceed): after fn and args, as their trailer (fastspawn._wire.payload).

Only plain data is unpickled from the socket and the header (no import, no
fd); the socket is an inherited socketpair that no other process can reach.
"""

from __future__ import annotations

import os
import pickle

from fastspawn._wire import payload as wire_payload

TYPE_CHECKING = False  # not typing's: the zygote, and so each worker, carries every import
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import IO, Any

# The zygote process's entry module (client starts ``python -c`` that
# imports it and calls its ``main``), named from this module's own name so
# that no move leaves it stale.  The command line of the zygote and of its
# guard shows MAIN_MARK, and so does every worker forked from it: how
# ``fastspawn stacks`` tells the zygote among a caller's descendants.
MAIN_MODULE = __name__.rpartition(".")[0] + ".main"
MAIN_MARK = f"from {MAIN_MODULE} import main".encode()

# ControlMessage operations.
PRELOAD = "preload"
PREFORK = "prefork"
LAUNCH = "launch"
FDS = "fds"

MAX_MESSAGE = 1 << 20  # what the zygote reads of one control message


class Hello:
    """The caller's first message: how to prepare like a spawned child (its
    main module, sys.path, ...: multiprocessing's preparation data) and the
    modules to import before the first launch."""

    __slots__ = ("preparation", "preload")

    def __init__(self, preparation: Mapping[str, Any], preload: Sequence[str]) -> None:
        self.preparation = dict(preparation)
        self.preload = list(preload)

    def encode(self) -> bytes:
        from fastspawn._wire import pickling

        # The authkey inside pickles only while "spawning", as for spawn.
        return pickling.dumps([(self.preparation, self.preload)], pickling.FdCollector())

    @classmethod
    def decode(cls, data: bytes) -> Hello:
        preparation, preload = pickle.loads(data)
        return cls(preparation, preload)


class ControlMessage:
    """One message on the control socket after the Hello."""

    __slots__ = ("op", "modules", "count", "refill")

    def __init__(
        self, op: str, modules: Sequence[str] = (), count: int = 0, refill: bool = True
    ) -> None:
        self.op = op
        self.modules = list(modules)  # PRELOAD's
        self.count = int(count)  # PREFORK's
        self.refill = bool(refill)  # PREFORK's

    def __repr__(self) -> str:
        return (
            f"ControlMessage({self.op!r}, modules={self.modules!r}, count={self.count}, "
            f"refill={self.refill})"
        )

    def encode(self) -> bytes:
        values = (self.op, self.modules, self.count, self.refill)
        return pickle.dumps(values, pickle.HIGHEST_PROTOCOL)

    @classmethod
    def decode(cls, data: bytes) -> ControlMessage:
        op, modules, count, refill = pickle.loads(data)
        return cls(op, modules, count, refill)


class LaunchHeader:
    """What the zygote needs to know of one launch before it unpickles fn
    and args.

    Attributes:
        nprocs, daemon: as the caller's request.
        preload: modules to import before unpickling (the launch's preload=).
        sys_path, env, cwd: the caller's now; the zygote takes them on before
            unpickling, as a spawned interpreter would have them.  ``env``
            as os.environ keeps it (environ_bytes): names and values in
            bytes.
        envs: ``{rank: {VAR: value}}``, applied in each rank.
        process_group: put the workers in a process group of their own.
        join_group: without process_group, the group the workers join (the
            caller's, when it is the foreground job of a terminal: its
            Ctrl-C then reaches them); 0: they stay in the zygote's.
        process_state: the caller's umask, affinity, nice value and limits
            that differ from the zygote's (see fastspawn._os.procstate).
        tracker_index: which of the user fds is the caller's resource
            tracker's pipe, or None.
        user_fds: how many fds the pickled arguments carry.
        stdio_slots: ``(rank, 1 or 2)`` for each per-rank stdio fd.
        default_stdio: how many of the caller's own stdio fds follow (2: fds
            1 and 2; 3: 0, 1 and 2).
        binary: ``(path, {rank: argv})`` when the ranks are that binary: the
            zygote starts them with the C launcher rather than as forked
            workers that exec it; else None.
        line_buffered: the caller's stdout shows lines as they are printed
            (a terminal, a notebook): the workers' is made line-buffered.
        stacks: forked workers arm the stack dump (fastspawn._worker.stacks).
        mp_process: the ranks are multiprocessing processes (fastspawn's
            contexts): each gets a link of its own to this zygote, through
            which the processes it starts come from here too, and once the
            process that asked for them has its pidfds, they outlive it, as
            multiprocessing's children outlive their parent (they still die
            with the zygote, so with the caller).
    The fds arrive in that order: user fds, stdio slots, the caller's stdio.
    """

    __slots__ = (
        "nprocs",
        "daemon",
        "preload",
        "sys_path",
        "env",
        "cwd",
        "envs",
        "process_group",
        "process_state",
        "tracker_index",
        "user_fds",
        "stdio_slots",
        "default_stdio",
        "binary",
        "line_buffered",
        "stacks",
        "join_group",
        "mp_process",
    )

    def __init__(
        self,
        *,
        nprocs: int,
        daemon: bool,
        preload: Sequence[str],
        sys_path: Sequence[str],
        env: Mapping[str, str] | Mapping[bytes, bytes],
        cwd: str,
        envs: Mapping[int, Mapping[str, str]],
        process_group: bool,
        process_state: Mapping[str, Any],
        tracker_index: int | None,
        user_fds: int,
        stdio_slots: Sequence[tuple[int, int]],
        default_stdio: int,
        binary: tuple[str, Mapping[int, Sequence[str]]] | None = None,
        line_buffered: bool = False,
        stacks: bool = True,
        join_group: int = 0,
        mp_process: bool = False,
    ) -> None:
        self.nprocs = int(nprocs)
        self.daemon = bool(daemon)
        self.preload = list(preload)
        self.sys_path = list(sys_path)
        self.env = environ_bytes(env)
        self.cwd = cwd
        self.envs = {rank: dict(env) for rank, env in envs.items()}
        self.process_group = bool(process_group)
        self.process_state = dict(process_state)
        self.tracker_index = tracker_index
        self.user_fds = user_fds
        self.stdio_slots = [(rank, stream) for rank, stream in stdio_slots]
        self.default_stdio = default_stdio
        self.binary = (
            None
            if binary is None
            else (binary[0], {rank: list(argv) for rank, argv in binary[1].items()})
        )
        self.line_buffered = bool(line_buffered)
        self.stacks = bool(stacks)
        self.join_group = 0 if self.process_group else int(join_group)
        self.mp_process = bool(mp_process) and binary is None

    def __repr__(self) -> str:
        return f"LaunchHeader(nprocs={self.nprocs}, fds={self.fd_count()})"

    def fd_count(self) -> int:
        """How many fds come with the launch beside its channel and payload."""
        return self.user_fds + len(self.stdio_slots) + self.default_stdio

    def encode(self) -> bytes:
        return pickle.dumps(
            tuple(getattr(self, name) for name in self.__slots__), pickle.HIGHEST_PROTOCOL
        )

    @classmethod
    def decode(cls, payload: IO[bytes]) -> tuple[LaunchHeader, int]:
        """Read a header from a payload file's trailer (it follows fn and
        args: fastspawn._wire.payload): the header, and the size of the
        pickled fn and args, at the start of which the file is left.  The
        values are set as they come: __init__ made them what they are
        before they were encoded."""
        values, work_size = wire_payload.read_trailer(payload)
        header = cls.__new__(cls)
        for name, value in zip(cls.__slots__, values, strict=True):
            setattr(header, name, value)
        return header, work_size


def environ_bytes(env: Mapping[str, str] | Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """An environment as os.environ keeps it: names and values in bytes,
    encoded as os.environ encodes them (the file system encoding, bytes no
    encoding decodes kept by surrogateescape).  A launch carries its
    caller's so, and the zygote and ready workers compare theirs with it so:
    os.environ's own copy is taken as it is, where decoding every name and
    value, and in the zygote encoding them again to compare, took 0.3 ms of
    each launch's way to its first rank (35 variables, after a pause, AMD
    EPYC; a cluster job's environment holds a hundred or more)."""
    data = getattr(env, "_data", None)
    if isinstance(data, dict):  # os.environ (CPython's os._Environ)
        return dict(data)
    # os.fsencode: os.environ's encoding on POSIX, bytes passed through.
    return {os.fsencode(name): os.fsencode(value) for name, value in env.items()}
