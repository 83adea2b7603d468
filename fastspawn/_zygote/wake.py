"""A ready worker's side (see fastspawn._zygote.ready, the zygote's): its
warm-up, a rehearsal of its wake, its wait, and its wake into the rank a
launch assigns it; and the assignment's wire format, which the zygote
writes (Ranks, for ReadyPool.wake).

At the wake the worker does what the zygote does for forked ranks (takes
on the caller's environment, cwd and sys.path as of the launch, imports its
``preload=``, unpickles fn and args) and then what every forked rank does
(fastspawn._worker.forked.forked_child).  Before it waits it rehearses all
of that on an assignment of the zygote's own state, received as a launch's
is, through a call of a function that does nothing, so that the pages the
wake writes are copied then, not while the caller waits (benchmarks/README.md,
issue 31: a prototype's wake cost 3.2x the bare pre-forked floor without a
warm-up, 1.46x with one; rehearsing the whole wake, not only its
unpickling, took a rank's page faults from its wake to fn from about 76 to
12).
"""

from __future__ import annotations

import array
import faulthandler
import marshal
import os
import pickle
import signal
import socket
import struct
import sys
import time
import traceback
import weakref

from fastspawn._os import oscall, procstate
from fastspawn._wire import channel as _channel
from fastspawn._wire import payload as wire_payload
from fastspawn._wire import pickling
from fastspawn._worker import forked as worker_forked
from fastspawn._worker import runner
from fastspawn._worker import stacks as worker_stacks
from fastspawn._worker import stdio as worker_stdio
from fastspawn._zygote import link, protocol
from fastspawn._zygote.forking import set_up_child
from fastspawn._zygote.launch import LaunchStdio, adopt_tracker, import_all, take_on_caller

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    # sendmsg's ancillary data: here the fds of an assignment (SCM_RIGHTS).
    Ancillary = list[tuple[int, int, bytes]]

# signal.signal without its enum conversions (see fastspawn._os.held).
_setsignal: Callable[[int, Any], Any] = sys.modules["_signal"].signal

# A rank's assignment: the rank, how many of the fds its arguments carry,
# which optional fds follow those, the length of the launch's Brief, when
# the zygote took the worker (its CLOCK_MONOTONIC, ns: see
# _note_interrupt); then the Brief and, if the launch has per-rank
# environments, the rank's (marshalled).  MAX_ASSIGN at most.
ASSIGN = struct.Struct("=iiBIq")
MAX_ASSIGN = 65536
OUT, ERR, IN, LINK = 1, 2, 4, 8
# The worker was forked with the caller's environment, cwd and sys.path as
# the launch has them: it skips the header.
SAME_STATE = 16


def in_ready_worker(
    loop: oscall.ForkLoop,
    index: int,
    pairs: Sequence[tuple[socket.socket, socket.socket]],
    close_fds: Sequence[int],
    warm_fd: int,
    unlent: set[int],
    zygote: int,
    state: dict[str, Any],
    name: str,
    slot: int,
    rehearsal: Rehearsal,
) -> NoReturn:
    """A freshly forked ready worker (named READY_NAME, its rank's
    ``name`` once it has one): warm up on ``rehearsal`` (the zygote's, its
    memfd inherited), wait for a rank, become it.  ``slot``: the rank its
    stack dump's memfd is named for while it waits (see _name_stacks)."""
    try:
        set_up_child(loop, index, unlent)
        mine = pairs[index][1]
        for ours, theirs in pairs:
            ours.close()
            if theirs is not mine:
                theirs.close()
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        # Waiting, a Ctrl-C meant for the caller is not ours, but a SIGINT
        # sent once the caller has our pid is our rank's (the lent handling
        # is restored when the rank comes, see _note_interrupt).  _signal's
        # own call: signal.signal's enum conversions cost a waking rank
        # some 30 us (see held.py).
        interrupt = _setsignal(signal.SIGINT, _note_interrupt)
        stacks_fd = _arm_stacks_ahead()
        own_name = name.encode()
        _warm_up(zygote, stacks_fd, rehearsal)
        os.close(rehearsal.payload)  # the zygote's: no rank inherits it
        _name_stacks(slot, stacks_fd)
        if warm_fd >= 0:
            os.close(warm_fd)  # prefork() waits for that
        message, fds, _flags = _channel.recv_fds(mine, MAX_ASSIGN, _channel.MAX_FDS)
        if not message:
            os._exit(0)  # retired
        mine.close()
        oscall.set_name(own_name)
        _setsignal(signal.SIGINT, interrupt)
        if _interrupted_at >= ASSIGN.unpack_from(message)[-1]:
            signal.raise_signal(signal.SIGINT)  # as the rank's, handled as lent
        _become(message, fds, zygote, state, stacks_fd)
    except BaseException:
        runner.print_exc()
    finally:
        os._exit(1)


def _noop(*_args: object) -> None:
    """Does nothing: the rehearsal's fn, and take_on_caller's settle there."""


# When the last SIGINT came while this worker waited (CLOCK_MONOTONIC, ns;
# -1: none).
_interrupted_at = -1
# The rank this worker's stack memfd is named for (None: none yet).
_stacks_slot: int | None = None


def _note_interrupt(_signum: int, _frame: Any) -> None:
    """A waiting worker's SIGINT handler: note when.  The zygote reports a
    worker's pid to the caller only after it took the worker, and stamps
    the assignment with that moment: a SIGINT noted since (the caller's
    ``interrupt()`` the moment ``start()`` returned, say) is raised again
    once the rank's handling is in place, as a rank forked at launch would
    have had it; one from before (a Ctrl-C meant for the caller) is
    dropped."""
    global _interrupted_at
    _interrupted_at = time.monotonic_ns()


def _arm_stacks_ahead() -> int:
    """Register the stack dump now, on a memfd of its own that the rank's
    (named for its rank, see _stacks_for) replaces at the wake: the
    registration's page copies are paid here.  Its fd, -1 if out of fds."""
    try:
        fd = worker_stacks.stacks_memfd(-1)
    except OSError:
        return -1
    faulthandler.register(worker_stacks.STACKS_SIGNAL, file=fd, all_threads=True)
    return fd


def _name_stacks(slot: int, fd: int) -> None:
    """Before the wait: put a memfd named for rank ``slot`` at ``fd``, the
    stack dump's.  A worker the zygote then gives that rank (it does where
    it can, see ReadyPool._pick) keeps it: at the wake, creating the rank's
    memfd and releasing this one took 35-46 us of a woken rank's CPU, the
    kernel's work nearly all of it (the same three calls made in C took as
    long; benchmarks/README.md, "Ready workers at 4db3674")."""
    global _stacks_slot
    if fd >= 0 and _stacks_file(slot, fd):
        _stacks_slot = slot


def _stacks_file(rank: int, fd: int) -> bool:
    """A new memfd named for ``rank`` put at ``fd`` (as the fork loop gives
    a forked rank its own); False, ``fd`` left as it was, when out of fds
    or memory."""
    return oscall.stacks_file(worker_stacks.STACKS_PREFIX, rank, fd) == 0


def _stacks_for(rank: int, wanted: bool, fd: int) -> None:
    """At the wake: the stack dump armed into a memfd named for ``rank``
    (as every forked rank's), or, with stacks off, none."""
    if fd < 0:
        if wanted:
            worker_stacks.arm_stacks(rank)
        return
    # Named so before the wait (_name_stacks), or named now as that did.
    if wanted and (rank == _stacks_slot or _stacks_file(rank, fd)):
        return
    faulthandler.unregister(worker_stacks.STACKS_SIGNAL)
    os.close(fd)


def _warm_up(zygote: int, stacks_fd: int, rehearsal: Rehearsal) -> None:
    """Rehearse the wake on ``rehearsal``, both ways a wake may go, up to
    and through a call of a function that does nothing, reported on a
    channel of its own: the pages the wake writes (objects' reference
    counts, code the interpreter specialises as it runs it, the heap) are
    then this worker's before a launch waits for it (a rank's page faults
    from its wake to fn: about 76 with a warm-up that stopped at the
    unpickling, 12 now, at some 2.7 us each on the benchmark machine)."""
    brief = rehearsal.brief
    brief.stacks = stacks_fd >= 0  # else _stacks_for would arm them
    for flags in (0, SAME_STATE):
        # The assignment as the zygote sends it, with the launch's channel
        # (its far end read by nobody) and payload, received as at the wake.
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
        (ours, theirs), (channel, _far) = pairs
        try:
            brief.channel = runner.channel_identity(channel.fileno())
            encoded = brief.encode()
            message = ASSIGN.pack(-1, 0, flags, len(encoded), 0) + encoded
            socket.send_fds(ours, [message], [channel.fileno(), rehearsal.payload])
            message, fds, _flags = _channel.recv_fds(theirs, MAX_ASSIGN, _channel.MAX_FDS)
            rank, spec, _stdio, _link = _prepare(message, fds, zygote, stacks_fd)
            try:
                worker_forked.rehearse(spec, rank)
            finally:
                spec.tx.close()
        finally:
            for pair in pairs:
                for end in pair:
                    end.close()
    worker_stdio.whole_lines()


class Rehearsal:
    """What ready workers rehearse their wake on (_warm_up): a launch of a
    function that does nothing on the zygote's own state (its environment,
    cwd and sys.path, which a launch's header will mostly repeat), as its
    payload memfd and Brief.  Made in the zygote (see
    ReadyPool.forget_rehearsal) for the workers it makes ready, which share
    the memfd (read with pread, as a launch's ranks share theirs) and each
    close it once warmed up.  Made in each worker, that making (a header
    built and pickled, a memfd written: no wake does either) cost each
    worker some 30 page copies (minor faults 594-607 to ready, 570-577 now)
    and 0.45 ms of CPU (the median of eight alternated pairs of runs of
    prefork(64); the runs' medians 3.96 and 3.78 ms; AMD EPYC).

    ``state``: the zygote's process state as it started: where it raised
    its RLIMIT_NOFILE since, a launch gives its ranks that one back, and so
    does this (unrehearsed, under a soft limit of 1024, a rank from a ready
    worker took 0.56-0.64 ms of CPU against 0.43-0.50: 256 ranks, AMD
    EPYC).  OSError where no memfd can be made (out of fds or memory) or
    the cwd is gone (removed since a launch left the zygote in it)."""

    __slots__ = ("payload", "brief")

    def __init__(self, state: dict[str, Any]) -> None:
        process_state: dict[str, Any] = {}
        procstate.open_files_back(process_state, state)
        header = protocol.LaunchHeader(
            nprocs=1,
            daemon=False,
            preload=(),
            sys_path=sys.path,
            env=os.environ,
            cwd=os.getcwd(),
            envs={},
            process_group=False,
            process_state=process_state,
            tracker_index=None,
            user_fds=0,
            stdio_slots=(),
            default_stdio=2,
        )
        self.payload = os.memfd_create("fastspawn-warm-up", os.MFD_CLOEXEC)
        try:
            os.write(self.payload, pickle.dumps((_noop, ()), pickle.HIGHEST_PROTOCOL))
            wire_payload.append_trailer(self.payload, header.encode())
            # Its channel (and whether stack dumps are on) is each worker's
            # own: _warm_up sets them.
            self.brief = Brief.of(header, self.payload, self.payload)
        except BaseException:
            os.close(self.payload)
            raise

    def close(self) -> None:
        os.close(self.payload)


class Brief:
    """What a ready worker needs of a launch's header beyond the caller's
    environment, cwd and sys.path, sent with each rank's assignment, so that
    a worker forked with that state already reads no more (see SAME_STATE).
    Encoded once per launch with marshal: all plain data, read back in each
    worker without pickle's look-up of a class by its module's name (with
    pickle this step took 58-70 us of the 290-360 a woken rank took from
    its assignment to fn, 31-35 now; AMD EPYC).

    ``omp_threads``: OMP_NUM_THREADS is set for the workers (the first half
    of forked.torch_threads_to_match, decided once here: a worker's look at
    its environment for a variable that is not there raises and catches a
    KeyError).  ``channel``: the launch channel's identity
    (runner.channel_identity), ``payload_size``: its payload memfd's size,
    both taken once here for every rank, where each woken rank took them
    with an fstat of its own (those two steps of a rank: 35-40 and 26-27
    us before, 27-30 and 19-21 with this and the channel's socket made
    without asking the kernel its family and type; AMD EPYC, torch)."""

    __slots__ = (
        "daemon",
        "process_state",
        "stacks",
        "tracker_index",
        "line_buffered",
        "preload",
        "cwd",
        "omp_threads",
        "channel",
        "payload_size",
    )

    def __init__(
        self,
        daemon: bool,
        process_state: dict[str, Any],
        stacks: bool,
        tracker_index: int | None,
        line_buffered: bool,
        preload: list[str],
        cwd: str,
        omp_threads: bool,
        channel: tuple[int, int],
        payload_size: int,
    ) -> None:
        self.daemon = daemon
        self.process_state = process_state
        self.stacks = stacks
        self.tracker_index = tracker_index
        self.line_buffered = line_buffered
        self.preload = preload
        self.cwd = cwd
        self.omp_threads = omp_threads
        self.channel = channel
        self.payload_size = payload_size

    @classmethod
    def of(cls, header: protocol.LaunchHeader, tx: int, payload: int) -> Brief:
        """The Brief of the launch of ``header``, ``tx`` and ``payload``
        its channel's and payload's fds."""
        return cls(
            header.daemon,
            header.process_state,
            header.stacks,
            header.tracker_index,
            header.line_buffered,
            list(header.preload),
            header.cwd,
            worker_forked.omp_threads_set(b"OMP_NUM_THREADS" in header.env, header.envs),
            runner.channel_identity(tx),
            os.fstat(payload).st_size,
        )

    def encode(self) -> bytes:
        return marshal.dumps(tuple(getattr(self, name) for name in self.__slots__))

    @classmethod
    def decode(cls, data: bytes) -> Brief:
        return cls(*marshal.loads(data))


class Ranks:
    """What the assignments of one launch's ranks are made of: its header;
    its channel, its payload and the fds its arguments carry (``fds``); its
    stdio and links; whether the zygote holds the caller's environment, cwd
    and sys.path now (``same_state``: launch.holds_caller_state); its Brief,
    encoded once."""

    def __init__(
        self,
        header: protocol.LaunchHeader,
        fds: tuple[int, int, Sequence[int]],
        stdio: LaunchStdio,
        links: Sequence[socket.socket],
        same_state: bool,
    ) -> None:
        self.header = header
        self.fds = fds
        self.stdio = stdio
        self.links = links
        self.same_state = same_state
        self.brief = Brief.of(header, fds[0], fds[1]).encode()
        self.shared_fds: tuple[Ancillary, int] | None = None

    def fds_of(self, rank: int) -> tuple[Ancillary, int]:
        """The fds of ``rank``'s assignment (the launch's channel, payload
        and argument fds, then its own stdio, the caller's stdin, its link),
        as sendmsg's ancillary data, and the flags that say which of the
        optional ones follow.  Made once for all the ranks without stdio or
        a link of their own: the zygote's loop over the workers it wakes
        runs while the first of them already take the cores."""
        shared = rank not in self.stdio.by_rank and not self.links
        if shared and self.shared_fds is not None:
            return self.shared_fds
        tx, payload, user_fds = self.fds
        sent, flags = [tx, payload, *user_fds], 0
        own, _unused = self.stdio.for_rank(rank)
        for bit, fd in zip((OUT, ERR), own or (-1, -1), strict=True):
            if fd >= 0:
                sent.append(fd)
                flags |= bit
        if self.stdio.caller_in is not None:
            sent.append(self.stdio.caller_in)
            flags |= IN
        if self.links:
            sent.append(self.links[2 * rank + 1].fileno())
            flags |= LINK
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent).tobytes())]
        if shared:
            self.shared_fds = rights, flags
        return rights, flags


def _unpickle(
    header: protocol.LaunchHeader | None, brief: Brief, payload: Any, user_fds: Sequence[int]
) -> tuple[Any, Any, str | None]:
    """What Zygote.prepare does, here (``header`` None: the caller's state
    is this process's already): (fn, args, None), or (None, (), traceback)
    when that failed (the rank then reports it)."""
    fn: Any = None
    args: Any = ()
    error = None
    try:
        if header is not None:
            take_on_caller(header, user_fds, _noop)
        else:
            os.chdir(brief.cwd)  # a directory by that name may be another one now
            import_all(brief.preload, strict=True)
            pickling.inherited_fds[:] = user_fds
            if brief.tracker_index is not None:
                adopt_tracker(user_fds[brief.tracker_index])
        fn, args = pickle.load(payload)
    except BaseException:
        error = traceback.format_exc()
    finally:
        for fd in user_fds:
            os.close(fd)  # unpickled objects hold their own dups
        pickling.inherited_fds[:] = []
        payload.close()
    return fn, args, error


def _prepare(
    message: bytes, fds: list[int], zygote: int, stacks_fd: int
) -> tuple[int, worker_forked.ForkSpec, list[int] | None, int | None]:
    """Read the assignment ``message`` (and its ``fds``, taken over), do
    what Zygote.launch and Forker.fork_ranks do for a forked rank: (rank,
    the rank's spec, its stdio fds or None, its link's fd or None)."""
    rank, user_count, flags, brief_size, _taken = ASSIGN.unpack_from(message)
    brief = Brief.decode(message[ASSIGN.size : ASSIGN.size + brief_size])
    own_env = message[ASSIGN.size + brief_size :]
    env = marshal.loads(own_env) if own_env else None
    # Family, type and protocol given: socket() would ask the kernel.
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, fileno=fds[0])
    payload = wire_payload.read_payload(fds[1], size=brief.payload_size)
    extra = iter(fds[2 + user_count :])
    out = next(extra) if flags & OUT else -1
    err = next(extra) if flags & ERR else -1
    stdin = next(extra) if flags & IN else -1
    own_link = next(extra) if flags & LINK else None
    if flags & SAME_STATE:
        # The caller's environment, cwd and sys.path are those this worker
        # was forked with (the zygote's since): no need to read them.
        header = None
    else:
        header, _work_size = protocol.LaunchHeader.decode(payload)
    fn, args, payload_error = _unpickle(header, brief, payload, fds[2 : 2 + user_count])
    _stacks_for(rank, brief.stacks, stacks_fd)
    spec = worker_forked.ForkSpec(
        zygote,
        fn,
        args,
        tx,
        daemon=brief.daemon,
        envs={rank: env} if env else {},
        payload_error=payload_error,
        stdin=stdin,
        process_state=brief.process_state,
        from_zygote=True,
        match_torch_threads=brief.omp_threads and "torch" in sys.modules,
        channel=brief.channel,
    )
    spec.parent_death_armed = True  # by the fork loop
    # What exists now is the zygote's as far as the rank's exit goes, as for
    # a rank forked after the zygote unpickled (Forker.worker_spec).
    runner.zygote_finalizer_index = runner.next_finalizer_index(weakref.finalize)
    logging = sys.modules.get("logging")
    runner.zygote_handlers = len(getattr(logging, "_handlerList", ()))
    if brief.line_buffered:
        worker_stdio.line_buffer_stdout()
    stdio = None if out == err == -1 else [out, err]
    return rank, spec, stdio, own_link


def _become(
    message: bytes, fds: list[int], zygote: int, state: dict[str, Any], stacks_fd: int
) -> NoReturn:
    """Become the rank assigned by ``message``: what Zygote.launch and
    Forker.fork_ranks do for a forked rank, then forked_child."""
    rank, spec, stdio, own_link = _prepare(message, fds, zygote, stacks_fd)
    if "numpy.random" in sys.modules:
        worker_forked.reseed()
    if own_link is not None:
        link.use(socket.socket(fileno=own_link), zygote, state)
    worker_forked.forked_child(spec, rank, stdio)
