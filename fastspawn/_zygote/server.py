"""The zygote's main loop: the caller's messages, each launch prepared and
its ranks started, their exits reaped and reported, orphans killed; idle
time spent collapsing memory into huge pages and making workers ready."""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback

from fastspawn._os import hugepages, oscall, procstate
from fastspawn._os.children import children_of, kill_children
from fastspawn._wire import channel as _channel
from fastspawn._wire import payload as wire_payload
from fastspawn._wire import pickling
from fastspawn._worker import runner
from fastspawn._zygote import protocol
from fastspawn._zygote.forking import Forker
from fastspawn._zygote.launch import (
    Launch,
    LaunchStdio,
    holds_caller_state,
    import_all,
    release_tracker,
    say_taken,
    send_pidfds,
    take_on_caller,
)
from fastspawn._zygote.ready import ReadyPool, own_nproc
from fastspawn._zygote.signals import Signals, terminating
from fastspawn._zygote.wake import Ranks

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any


_READY_COUNT = struct.Struct("=i")  # prefork's answer

# From this many ranks on, a launch first collapses what the zygote has not
# collapsed yet (see Zygote.collapse_now).
COLLAPSE_BEFORE_FORKING = 128


class Zygote:
    """The zygote proper: serves its caller's launches until the caller is
    gone (its control socket's EOF, its pidfd, or our own SIGTERM)."""

    def __init__(self, control: socket.socket, parent: int, parent_fd: int) -> None:
        self.control = control
        self.me = os.getpid()
        self.parent_fd = parent_fd
        # multiprocessing.parent_process() is the caller, here and so in
        # every worker (made once: each worker making its own would copy
        # the pages that takes); its sentinel is our pidfd of the caller,
        # which workers keep.
        from multiprocessing import process

        process._parent_process = process._ParentProcess(  # type: ignore[attr-defined]
            "MainProcess", parent, self.parent_fd
        )
        oscall.set_child_subreaper()
        self.signals = Signals()
        self.epoll = select.epoll()
        for fd in (control.fileno(), self.parent_fd, self.signals.wake_r):
            self.epoll.register(fd, select.EPOLLIN)
        self.workers: dict[int, tuple[Launch, int]] = {}  # pid -> (launch, rank)
        self.channels: dict[int, Launch] = {}  # tx fd -> launch
        # Links of multiprocessing processes (LaunchHeader.mp_process): the
        # control sockets through which they start processes of their own
        # here.  fd -> (socket, worker pid); closed at its EOF or once the
        # worker is reaped, whichever comes first.
        self.links: dict[int, tuple[socket.socket, int]] = {}
        self.link_of: dict[int, int] = {}  # worker pid -> link fd
        # Orphans left by multiprocessing processes, kept as multiprocessing
        # keeps them (see settle_orphans): pid -> its process group.
        self.kept: dict[int, int] = {}
        # Channel fds closed while handling the current batch of events: a
        # later event of the batch for that number is stale, even if a new
        # launch got the number since (its hang-up must not end the new one).
        self.closed_in_batch: set[int] = set()
        self.settled_modules = 0  # len(sys.modules) at the last settle()
        # How preparing like a spawn child (importing the caller's main
        # module) failed, if it did: ("exit", code) or ("error", traceback).
        # Every launch's workers then fail as spawned ones would.
        self.prepare_failure: tuple[str, Any] | None = None
        self.to_collapse: list[int] = []  # stretches for collapse_when_idle
        # What launches left to do once their ranks run (see launch).
        self.after_launch: list[Callable[[], None]] = []
        self.forker = Forker(self.me, self.workers, self.signals)
        # What each control message is read into (channel.recv_fds_into):
        # anonymous memory, touched only as far as messages reach.
        self.message_buffer = mmap.mmap(-1, protocol.MAX_MESSAGE)
        self.ready = ReadyPool(self.me, self.signals, self.forker.state)
        self.forker.make_room = self.ready.make_room

    def settle(self) -> None:
        """Prepare the memory that workers share, once imports changed it.

        gc.freeze() moves every object to the permanent generation, as the
        gc docs advise before fork(): collections (here and in workers) then
        skip them instead of writing to every page that holds one, which
        would copy the page.  The heap and arenas are queued for collapsing
        into huge pages (see collapse_when_idle).
        """
        if len(sys.modules) == self.settled_modules:
            return
        self.ready.retire()  # forked without the new modules
        gc.freeze()
        self.settled_modules = len(sys.modules)
        if hugepages.wanted():
            self.to_collapse = hugepages.collapsible_ranges()

    def collapse_when_idle(self) -> None:
        """Collapse one queued stretch into a huge page (serve() calls this
        when nothing else is to be done and no worker runs).

        Forking a torch-sized zygote and tearing its workers down then costs
        one page-table entry per 2 MiB instead of one per 4 KiB (with torch
        loaded: fork 3.6x, teardown 3.3x cheaper, benchmarks/README.md).  Each
        stretch is copied (a few ms), so it happens only while the zygote is
        idle, one stretch at a time between polls, and only while no worker
        (nor kept orphan) runs: a worker still sharing the old pages would
        keep them alive beside the new ones.
        """
        # Failures are mostly quick (a stretch nothing was written to yet):
        # go on to the next one, for up to 5 ms.
        deadline = time.monotonic() + 0.005
        while self.to_collapse and not hugepages.collapse(self.to_collapse.pop()):
            if time.monotonic() > deadline:
                break

    def collapse_now(self) -> None:
        """Collapse what is still queued, before a large launch forks.

        Each fork copies one page-table entry per 4 KiB page left, and each
        worker's exit clears them, so with enough ranks collapsing first
        pays for itself.  With torch preloaded and no idle time before the
        launch, until all ranks run: 64 ranks about even (385-409 ms against
        336-410), 128 ranks 424-489 ms against 724-746, 256 ranks 1145-1243
        ms against 1578-1865 (benchmarks/collapse_first.py has the rest).
        """
        while self.to_collapse:
            hugepages.collapse(self.to_collapse.pop())

    def own_fds(self) -> list[int]:
        # Not parent_fd: the workers keep it (multiprocessing's
        # parent_process() sentinel); it is close-on-exec.
        fixed = [
            self.control.fileno(),
            self.epoll.fileno(),
            self.signals.wake_r,
            self.signals.wake_w,
        ]
        return fixed + list(self.channels) + list(self.links) + self.ready.fds()

    def serve(self) -> None:
        busy = False  # idle work was done last round: look at the fds, go on
        while True:
            # Idle time (nothing for 10 ms) goes to collapsing memory, then
            # to making workers ready, a step at a time with a look at the
            # fds in between, until something happens.  A child's exit is
            # not something: the signal pipe alone (each fork loop writes
            # it, see Signals.take_back) leaves the idle work going, where it
            # had made each step of a refill wait 10 ms (one or two workers a
            # step: 64 made ready in 0.8 s, 256 in 3.8).
            wait = self.idle_wait()
            timeout = -1.0 if wait is None else 0 if busy else wait
            events = self.epoll.poll(timeout)
            was_busy = busy
            busy = not events and wait is not None and self.idle_work()
            if busy or not events:
                continue
            self.closed_in_batch.clear()
            for fd, mask in events:
                if fd not in self.closed_in_batch and not self.on_event(fd, mask):
                    return
            busy = was_busy and all(fd == self.signals.wake_r for fd, _mask in events)

    def can_collapse(self) -> bool:
        """Whether memory may be collapsed now (see collapse_when_idle):
        nothing runs that shares the old pages, ready workers neither."""
        return (
            bool(self.to_collapse) and not self.workers and not self.kept and not self.ready.waiting
        )

    def idle_wait(self) -> float | None:
        """Seconds of quiet before idle work is due; None: there is none."""
        if self.after_launch:
            return max(0.0, self.ready.quiet_until - time.monotonic())
        if self.can_collapse():
            return 0.01  # first: ready workers made before would keep the old pages
        if self.spare_group_due():
            return 0.01
        if self.prepare_failure is not None:
            return None  # no ready workers from a failed preparation
        return self.ready.refill_delay()

    def spare_group_due(self) -> bool:
        """Whether to anchor the next launch's group ahead (Forker.
        make_spare_group): while workers are ready, as part of readiness
        (none with FASTSPAWN_READY=0; prefork(0) drops it)."""
        return bool(self.ready.waiting) and self.forker.spare_group_due()

    def idle_work(self) -> bool:
        """One step of idle work; whether the next may follow at once."""
        if self.after_launch:
            self.run_after_launch()
            return True
        if self.can_collapse():
            self.collapse_when_idle()
            return True
        if self.spare_group_due():
            # One step on its own: False, so that no other idle work follows
            # without a quiet of its own (a refill as the last ranks end,
            # before the next launch of a restarting job can come).
            self.forker.make_spare_group()
            return False
        if not self.ready.refill_due():
            return False
        self.ready.refill(self.own_fds())
        return True

    def on_event(self, fd: int, mask: int) -> bool:
        """One event of the main loop; False once the caller is gone."""
        if fd == self.control.fileno():
            return self.on_control(self.control)
        if fd == self.parent_fd:
            return False
        if fd in self.links:
            if not self.on_control(self.links[fd][0]):
                self.close_link(fd)
        elif fd == self.signals.wake_r:
            self.on_sigchld()
        elif fd in self.channels:
            launch = self.channels[fd]
            if mask & (select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP):
                launch.broken = True
            self.on_writable(launch)
        return True

    def on_control(self, control: socket.socket) -> bool:
        """One message from the caller's control socket, or a link's
        (see fork_links); False at its EOF."""
        try:
            data, fds, _flags = _channel.recv_fds_into(control, self.message_buffer, 256)
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        self.ready.forget_rehearsal()  # (the message may change our state)
        self.run_after_launch()  # before anything the message asks
        message = protocol.ControlMessage.decode(data)
        if message.op == protocol.PRELOAD:
            import_all(message.modules)
            self.signals.reclaim()
            self.settle()
        elif message.op == protocol.PREFORK:
            self.prefork(message.count, message.refill, fds)
        else:
            self.launch(control, fds)
        return True

    def prefork(self, count: int, refill: bool, fds: list[int]) -> None:
        """fastspawn.prefork(count, refill=refill): make them ready, then
        say how many are on the fd that came with the message (its only
        one).  None after a failed preparation: every launch fails then."""
        ready = 0 if self.prepare_failure is not None else count
        ready = self.ready.prefork(ready, refill, self.own_fds() + fds)
        if not ready:
            self.forker.drop_spare_group()  # readiness off: nothing held ahead
        for fd in fds:
            try:
                os.write(fd, _READY_COUNT.pack(ready))
            except OSError:
                pass  # the caller gave up waiting
            os.close(fd)

    def launch(self, control: socket.socket, fds: list[int]) -> None:
        """One launch: ``fds`` are its report channel, its payload memfd
        (fn and args, then the launch's header), then the fds the arguments
        carry and the ranks' stdio fds, those that did not fit following in
        messages of their own."""
        tx = socket.socket(fileno=fds[0])
        say_taken(tx)
        # The header (environment, sys.path, per-rank envs) travels in the
        # memfd, not in the control message, whose size is capped (~200 KB).
        # The memfd stays open for the ready workers, which read it too.
        payload = wire_payload.read_payload(fds[1], keep_open=True)
        header, work_size = protocol.LaunchHeader.decode(payload)  # plain data: no import, no fd
        # Our soft RLIMIT_NOFILE may be above the caller's (for the ready
        # workers' fds, see ReadyPool.fill): its ranks get the caller's.
        procstate.open_files_back(header.process_state, self.forker.state)
        launch = Launch(tx, header.nprocs, header.mp_process)
        self.ready.launched(launch, header.nprocs)
        # Forked ranks are made ready again once they end, unless their
        # caller holds them to an RLIMIT_NPROC of its own: then the ready
        # workers, which count against it, go before its ranks fork.
        own_limit = own_nproc(header)
        if own_limit:
            self.ready.stand_aside()
            self.forker.drop_spare_group()  # our child too: counted alike
        if own_limit or header.process_group:
            self.forker.groups_ahead = not own_limit
        launch.refills = header.binary is None and not own_limit
        saved_limits = procstate.adopt_open_files_limit(header.process_state)
        try:
            try:
                carried = fds[2:] + self.receive_fds(control, header.fd_count() + 2 - len(fds))
            except EOFError:
                if control is self.control:
                    raise  # the caller is gone: so are we
                # A process died in the middle of a launch through its
                # link: nothing started, nobody to tell.
                for fd in fds[1:]:
                    os.close(fd)
                tx.close()
                return
            try:
                pids, after, later = self.start_ranks(
                    header, payload, (fds[1], work_size), carried, launch
                )
            except BaseException:
                os.close(fds[1])
                raise
            try:
                if not launch.pids_said:  # (a multiprocessing process's, said early)
                    send_pidfds(launch, pids)
            except BaseException:
                after()
                raise
        finally:
            procstate.restore_limits(saved_limits)
        # The pidfds go out first: the caller waits for them, the rest waits.
        try:
            self.channels[tx.fileno()] = launch
            self.epoll.register(tx.fileno(), select.EPOLLRDHUP)
            self.on_writable(launch)
            if launch.refills and header.mp_process:
                # Multiprocessing's processes come again (a DataLoader's
                # next epoch, a pool's next worker), and end only when the
                # next are due: made ready again once these are up, not
                # once they ended, as many as run at once.  Counted once
                # the caller has the pidfds, which it waits for.
                running = sum(owner.mp_process for owner, _rank in self.workers.values())
                self.ready.owe(header.nprocs, running)
        finally:
            if later:
                self.after_launch.append(after)
            else:
                after()

    def run_after_launch(self) -> None:
        """What launches left for later (see start_ranks), once the zygote
        is idle or asked for anything, whichever comes first."""
        while self.after_launch:
            self.ready.forget_rehearsal()
            self.after_launch.pop(0)()

    def start_ranks(
        self,
        header: protocol.LaunchHeader,
        payload: IO[bytes],
        payload_file: tuple[int, int],
        carried: list[int],
        launch: Launch,
    ) -> tuple[list[int], Callable[[], None], bool]:
        """Take on the caller's state and start a launch's ranks (``carried``:
        all its fds beside the channel and payload; ``payload_file``: the
        payload's fd, and the size of the pickled fn and args): their pids (none
        when the launch failed, which is reported on its channel), what
        is left to do once the caller has them, and whether that may wait
        until the zygote is idle (see the end)."""
        payload_fd, work_size = payload_file
        user_fds = carried[: header.user_fds]
        stdio = LaunchStdio(header, carried[header.user_fds :])
        # Ready workers unpickle for themselves, with dups of the
        # arguments' fds: prepare() closes ours.
        usable = self.ready.usable_for(header, work_size)
        wake_fds = self.ready.dup_fds(user_fds) if usable else None
        prepared: list[tuple[Any, Any, str | None]] = []

        def prepare() -> tuple[Any, Any, str | None]:
            if not prepared:
                prepared.append(self.prepare(header, payload, user_fds, launch.tx))
            return prepared[0]

        # Ready workers take their ranks before the zygote takes on the
        # caller's state and unpickles (for the ranks it forks, and once
        # for the workers made ready later): a launch waits for none of it.
        # Unless the launch's preload= brings modules the zygote lacks:
        # imported here once, they retire the ready workers (see settle).
        if wake_fds is None or not all(name in sys.modules for name in header.preload):
            prepare()
        if header.binary is not None and prepare()[2] is None:
            pids = self.forker.start_binaries(header, launch, stdio)
        else:
            # (Not with ready workers: they hold the old pages.)
            idle = not self.workers and not self.ready.waiting
            if header.nprocs >= COLLAPSE_BEFORE_FORKING and idle:
                self.collapse_now()
            links = self.fork_links(header)

            def wake(group: int) -> list[int]:
                if wake_fds is None or (prepared and prepared[0][2] is not None):
                    return []
                fds = (launch.tx.fileno(), payload_fd, wake_fds)
                # Once prepare() ran, the zygote holds the caller's state.
                same_state = bool(prepared) or holds_caller_state(header)
                ranks = Ranks(header, fds, stdio, links, same_state)
                # A multiprocessing process's start() returns with its pid:
                # the caller has it before the worker is woken.
                return self.ready.wake(ranks, group, tell_pids if header.mp_process else None)

            def tell_pids(pids: list[int]) -> bool:
                said = send_pidfds(launch, pids)
                launch.flush()
                return said

            def own_fds() -> list[int]:
                return [*self.own_fds(), payload_fd, *(wake_fds or ())]

            try:
                pids = self.forker.fork_ranks(header, launch, stdio, prepare, own_fds, links, wake)
            finally:
                for fd in wake_fds or ():
                    os.close(fd)
            self.keep_links(pids, links)

        def after() -> None:
            try:
                prepare()  # if the ready workers took every rank: for those made later
            finally:
                os.close(payload_fd)  # read as prepare() unpickles: closed after
            prepared.clear()  # fn and args
            release_tracker()  # the workers hold the caller's tracker now
            # Arguments in a reference cycle (an object that refers to
            # itself) would wait for a collection, or be frozen by settle(),
            # holding the fds they carry open for every later worker:
            # collect them now.  Frozen objects are not traversed, so this is
            # cheap (0.2 ms with torch preloaded) except once after
            # unpickling imported a large module (torch not preloaded: 150k
            # new objects, 93 ms, beside the import's 1.8 s); only a full
            # collection is sure to reach arguments that a large unpickling
            # pushed into the old generation.
            gc.collect()
            self.settle()  # what unpickling imported (the module of fn, say)

        # Where ready workers took every rank and the launch carries no fd
        # (the zygote's copies of which prepare() closes), what is left here
        # (the unpickling for workers made ready later, a collection) may
        # wait: done while the ranks come up, it took a core from them for
        # 0.4-0.8 ms of a launch of 64 (torch preloaded, AMD EPYC).
        return pids, after, not prepared and header.user_fds == 0

    def prepare(
        self,
        header: protocol.LaunchHeader,
        payload: IO[bytes],
        user_fds: list[int],
        tx: socket.socket,
    ) -> tuple[Any, Any, str | None]:
        """Take on the caller's state and unpickle fn and args: ``(fn, args,
        None)``, or ``(None, (), traceback)`` when that failed (every rank
        then reports the traceback, as a spawned worker would)."""
        fn: Any = None
        args: Any = ()
        payload_error = None
        try:
            # The caller's environment, cwd and sys.path are taken on
            # before unpickling: imports run here and must see what a
            # spawned interpreter would.  The workers inherit all three.
            # settle() before unpickling: fn and args are the launch's, not
            # lasting zygote state, and must stay collectable in the workers.
            if take_on_caller(header, user_fds, self.settle):
                self.ready.generation += 1
            if self.prepare_failure is None:
                fn, args = pickle.load(payload)
            elif self.prepare_failure[0] == "exit":
                fn, args = runner.exit_during_prepare, (self.prepare_failure[1],)
            else:
                payload_error = self.prepare_failure[1]
        except BaseException:
            self.ready.generation += 1  # the state may be half taken on
            if terminating():
                # Our own SIGTERM (the guard died), landed in an import or
                # the unpickling: shut down, not a payload error for the
                # workers while the zygote serves on.
                tx.close()
                raise
            payload_error = traceback.format_exc()
        finally:
            self.signals.reclaim()  # imports and unpickling ran user code
            for fd in user_fds:
                os.close(fd)  # unpickled objects hold their own dups
            pickling.inherited_fds[:] = []
            payload.close()
        return fn, args, payload_error

    def fork_links(self, header: protocol.LaunchHeader) -> list[socket.socket]:
        """For a launch of multiprocessing processes, a link per rank (a
        socketpair: ours, then the worker's end): the control socket through
        which that process starts processes of its own here, not from a
        zygote of its own, which would take them down with it (a
        multiprocessing process's children outlive it).  The fds are the
        zygote's, under the caller's limit on open files (adopted for the
        launch): past it, the ranks go without."""
        links: list[socket.socket] = []
        if header.mp_process:
            try:
                for _rank in range(header.nprocs):
                    links.extend(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            except OSError:
                for link in links:
                    link.close()
                links = []
        return links

    def keep_links(self, pids: list[int], links: list[socket.socket]) -> None:
        """After the fork: hold our end of each forked worker's link (see
        fork_links), close the workers' ends and what no worker took."""
        for rank, (ours, theirs) in enumerate(zip(links[::2], links[1::2], strict=True)):
            theirs.close()
            if rank >= len(pids):
                ours.close()
                continue
            fd = ours.fileno()
            self.links[fd] = (ours, pids[rank])
            self.link_of[pids[rank]] = fd
            self.epoll.register(fd, select.EPOLLIN)

    def close_link(self, fd: int) -> None:
        """A link is done with: its process closed it, or was reaped."""
        link, pid = self.links.pop(fd)
        del self.link_of[pid]
        self.epoll.unregister(fd)
        link.close()
        self.closed_in_batch.add(fd)

    def receive_fds(self, control: socket.socket, count: int) -> list[int]:
        """Read ``count`` fds from the messages (MAX_FDS at most each) that
        follow a launch message on ``control``."""
        fds: list[int] = []
        while len(fds) < count:
            data, more, _flags = _channel.recv_fds(control, protocol.MAX_MESSAGE, _channel.MAX_FDS)
            fds.extend(more)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise EOFError("the caller went away in the middle of a launch")
        return fds

    def on_sigchld(self) -> None:
        try:
            while os.read(self.signals.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        touched: set[Launch] = set()
        # The process groups of the children reaped now, whose orphans stay
        # (multiprocessing processes', kept orphans') or go (other workers').
        keep: set[int] = set()
        drop: set[int] = set()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            entry = self.workers.pop(pid, None)
            if entry is None:
                # A ready worker that died, or an orphaned descendant: one
                # we killed, or one we kept.
                self.ready.gone(pid)
                if pid in self.kept:
                    keep.add(self.kept.pop(pid))
                continue
            if pid in self.link_of:
                self.close_link(self.link_of[pid])
            launch, rank = entry
            (keep if launch.mp_process else drop).add(launch.group)
            self.rank_ended(launch, rank, status)
            touched.add(launch)
        if keep or drop:  # a worker or a kept orphan ended: it may have left some
            self.settle_orphans(keep - drop)
        for launch in touched:
            self.on_writable(launch)

    def rank_ended(self, launch: Launch, rank: int, status: int) -> None:
        """A rank of ``launch`` was reaped: its exit is for the caller; after
        the last, nothing of the launch comes up any more (the refill may
        start, see ReadyPool.ended) and its forked ranks are owed."""
        launch.exits += [rank, os.waitstatus_to_exitcode(status)]
        launch.live -= 1
        if launch.live == 0:
            self.ready.ended(launch)
            if launch.refills and not launch.mp_process:
                self.ready.owe(launch.size)

    def settle_orphans(self, keep: set[int]) -> None:
        """Deal with the children that are not our workers: descendants
        whose parent died, reparented to us (a subreaper).  Those in the
        process group of a multiprocessing process or kept orphan that
        ended now (``keep``) stay, as multiprocessing's outlive their
        parent, until they exit, or we do (shutdown kills them, so they
        die with the caller).  The others are killed (a start_processes
        rank's leave nothing behind); unreaped, so their pids cannot be
        reused.  An orphan that left its parent's group goes too."""
        others = children_of(self.me) - self.workers.keys() - self.kept.keys()
        for pid in others - self.ready.waiting.keys() - {self.forker.spare_group}:
            if keep:
                try:
                    group = os.getpgid(pid)
                except ProcessLookupError:
                    continue  # gone already
                if group in keep:
                    self.kept[pid] = group
                    continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_writable(self, launch: Launch) -> None:
        """Send what a launch has queued; end it once all is said, or once
        its caller has gone from the channel."""
        if launch.tx.fileno() < 0:
            return  # ended already; its last workers are being reaped
        fd = launch.tx.fileno()
        sent = launch.broken or launch.flush()
        if launch.broken:
            self.abandon(launch)
        if launch.done or launch.broken:
            if fd in self.channels:
                del self.channels[fd]
                self.epoll.unregister(fd)
            launch.tx.close()
            self.closed_in_batch.add(fd)
            return
        if sent == launch.watching_out:
            # Always watched for the caller hanging up; for room to write
            # only while something waits to be sent.
            launch.watching_out = not sent
            events = select.EPOLLRDHUP | (select.EPOLLOUT if launch.watching_out else 0)
            self.epoll.modify(fd, events)

    def abandon(self, launch: Launch) -> None:
        """The caller closed a launch's channel while workers of it still
        ran (it gave up during the launch, or could not take the workers'
        pidfds): nobody can wait for them or stop them now, so kill them.
        Unreaped children of ours, so the pids are theirs; what they started
        goes as reparented orphans do (settle_orphans).  Multiprocessing
        processes whose pidfds the caller had stay (Launch.kept_when_broken):
        their caller died or ended before them, and they end as the
        zygote's other workers do, with the zygote at the latest."""
        launch.drop_outbox()
        if launch.kept_when_broken:
            return
        for pid, (owner, _rank) in self.workers.items():
            if owner is launch:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def shutdown(self) -> None:
        """The caller is gone: kill every worker and descendant, reap, exit."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # The workers first, from our own records: listing children in /proc
        # takes fds, which may have run out.  Then free what fds we can.
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for launch in self.channels.values():
            launch.drop_outbox()
            launch.tx.close()
        self.channels.clear()
        for link, _pid in self.links.values():
            link.close()
        self.links.clear()
        self.ready.retire()
        self.forker.drop_spare_group()
        kill_children(self.me)
