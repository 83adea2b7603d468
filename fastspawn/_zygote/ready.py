"""Ready workers: processes the zygote forks ahead of any launch, each
waiting on a socketpair of its own for the rank it is to become.

A launch then costs a message per rank instead of a fork: the zygote puts
the ready worker in the launch's process group (setpgid on its child, which
has not exec'd) and sends it the rank, the launch's channel and payload
memfd, the fds its arguments carry, its stdio and, for a multiprocessing
process, its link.  The worker becomes that rank (fastspawn._zygote.wake,
the worker's side, which also rehearses the wake before it waits).  The
ranks a launch needs beyond the ready ones are forked as before.  The
ready workers take theirs before the zygote unpickles the launch (see
Zygote.start_ranks); a multiprocessing process's caller has the pid before
its worker is woken.

Each ready worker is forked by the same C loop as a launch's ranks
(PR_SET_PDEATHSIG against the zygote, checked; the workers' signal
handlers), under the name it waits with (READY_NAME, which the zygote
takes for the fork loop).  It waits with its stack dump's memfd named for
a rank, its slot (made again for an ended launch, the rank it stands in
for; else the lowest that no other waiting worker has), and a launch gives
rank r to a worker of slot r where one waits, whose wake then leaves that
file as it is (see wake._name_stacks).

How many are kept: ``fastspawn.prefork(n)`` makes n ready and keeps at
least n so; after a launch ends (multiprocessing processes: once they
began, as the next are due when they end), workers are made ready again
while the zygote is idle (no message for 10 ms, no launch in the last
10 ms and 2 ms per rank it had unless all its ranks ended) until as many
wait as the most ranks a launch had since prefork() (multiprocessing
processes: the most that ran at once), up to FASTSPAWN_READY (default
256; 0: never in the background).  256 idle workers, 2-3 MiB each (USS,
docs/performance.md), follow only a launch that large, and the next
launch of that size forks none (with 64, the default before, it forked
192); launches of 8 in a row, or processes started and joined one at a
time, keep 8, or 1, however many there were (see ReadyPool.owe).
``prefork(n, refill=False)``: n now, none made ready again after
(``prefork(0, refill=False)`` turns ready workers off).  How many the
limits allow (fastspawn._zygote.room): a quarter of the caller's
RLIMIT_NPROC, of a pids cgroup's pids.max (never its last half) and of
the zygote's RLIMIT_NOFILE (each holds two of the zygote's fds), none
while memory is short, on the machine or under a memory cgroup's limit.
The zygote raises its own soft RLIMIT_NOFILE for them where it is too
low, as far as the hard limit (the caller's soft 1024, a desktop's
default, held 128 before), and gives every rank the caller's back
(procstate.open_files_back).  A launch short of processes at a fork
(EAGAIN) has them make room (make_room).  A caller that set an
RLIMIT_NPROC of its own (lower, often) gets its ranks forked under it, as
before: the ready workers, which count against it, are killed and reaped
first, and none are made ready again until prefork() or a launch of a
caller without a limit of its own asks.  New modules in the zygote
(``preload()``, a launch's imports) retire the ready ones: they lack them.
"""

from __future__ import annotations

import collections
import itertools
import marshal
import os
import signal
import socket
import sys
import time

from fastspawn._os import oscall, procstate
from fastspawn._wire import channel as _channel
from fastspawn._zygote import protocol
from fastspawn._zygote.forking import end_if_forked
from fastspawn._zygote.room import FDS_EACH, LIMIT_SHARE, room_under_limits
from fastspawn._zygote.signals import ZYGOTE_SIGNALS, Signals
from fastspawn._zygote.wake import (
    ASSIGN,
    MAX_ASSIGN,
    SAME_STATE,
    Ranks,
    Rehearsal,
    in_ready_worker,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Sequence
    from typing import Any

    from fastspawn._zygote.wake import Ancillary

# A waiting worker's name (/proc/PID/comm, 15 characters at most): how the
# caller's leak checks tell it from a worker (client.helper_processes).
READY_NAME = "fastspawn-ready"
# The background's default cap (see above), and the setting that changes it.
DEFAULT_CAP = 256
CAP_VARIABLE = "FASTSPAWN_READY"
REFILL_BATCH = 16  # forked in one idle moment at most, then the zygote looks at its fds
REFILL_SLICE = 0.005  # seconds an idle moment's refill takes, about
# No refill while a launch's ranks come up: for this long after it began,
# and this long more per rank (seconds).
QUIET_AFTER_LAUNCH = 0.01
QUIET_PER_RANK = 0.002
# A launch of several ranks whose pickled fn and args are larger than this
# is forked: the zygote unpickles them once and its ranks share that copy,
# where each ready worker would unpickle one of its own (a 64 MiB argument,
# 8 ranks: 523-531 ms and 528 MiB of ranks from ready workers, 238-239 ms
# and 9.3 MiB forked; 1 MiB: about even in time, 2.9 MiB more per rank;
# 256 KiB: twice as fast from ready workers; Intel Xeon, measured before
# this rule: docs/performance.md, "Large arguments").
MAX_WAKE_WORK = 512 << 10


def cap_from_environment(environ: dict[str, str] | os._Environ[str]) -> int:
    """The background's cap, from FASTSPAWN_READY (a count; 0: off)."""
    raw = environ.get(CAP_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_CAP
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 0:
        print(
            f"fastspawn: {CAP_VARIABLE}={raw!r} is not a count of workers (0 turns ready "
            f"workers off); using {DEFAULT_CAP}",
            file=sys.stderr,
        )
        return DEFAULT_CAP
    return cap


class ReadyPool:
    """The zygote's ready workers: pid -> our end of its socketpair, oldest
    first; and their own ends, which the zygote keeps too (see spend)."""

    def __init__(self, me: int, signals: Signals, state: dict[str, Any]) -> None:
        self.me = me
        self.signals = signals
        self.state = state  # the zygote's process state, for links (Forker.state)
        self.waiting: dict[int, socket.socket] = {}
        self.theirs: dict[int, socket.socket] = {}
        self.spent: list[socket.socket] = []  # of woken workers, closed when idle
        # The zygote's environment, cwd and sys.path change with launches:
        # each change is a new generation, and each ready worker was forked
        # in one (pid -> generation).
        self.generation = 0
        self.born: dict[int, int] = {}
        # Each waits with its stack dump's memfd named for a rank, its slot
        # (wake._name_stacks), and a launch gives rank r a worker of slot r
        # where one waits: pid -> slot, and slot -> its workers, oldest first.
        self.slot: dict[int, int] = {}
        self.by_slot: dict[int, dict[int, None]] = {}
        self.cap = cap_from_environment(os.environ)
        self.asked = 0  # prefork(n)'s n: kept ready whatever the cap
        # Workers of ended launches, to be made ready again: the slot each
        # is to be made for, its rank there (a multiprocessing process is
        # rank 0 of a launch of its own: a pool's refills are all slot 0).
        self.owed: list[int] = []
        # How many the background keeps ready (see owe): the most ranks a
        # launch had, or multiprocessing processes ran at once, since
        # prefork() or stand_aside(); the cap at most.
        self.level = 0
        # No background refill before quiet_until: each launch whose ranks
        # may still come up -> when its quiet ends (see launched, ended);
        # and the limits' back-off (see refill).
        self.coming_up: dict[object, float] = {}
        self.held_until = 0.0
        # What the workers made ready rehearse their wake on, made in the
        # zygote for them; and one forgotten since, closed before the next
        # fill (see forget_rehearsal).
        self.rehearsal: Rehearsal | None = None
        self.forgotten: Rehearsal | None = None
        # Seconds the last fork loop of ready workers took a worker: what
        # one more adds to a step of the refill (see refill).
        self.fork_time = 0.001

    def fds(self) -> list[int]:
        ends = (*self.waiting.values(), *self.theirs.values(), *self.spent)
        forgotten = [self.forgotten.payload] if self.forgotten is not None else []
        return [end.fileno() for end in ends] + forgotten

    def spend(self, end: socket.socket) -> None:
        """Keep ``end``, of a worker a launch took, open until the zygote
        next makes workers ready (close_spent, in refill and prefork: no
        more are spent in between than were ready).  The launch's channel,
        a unix socket, is in flight to its workers until each has received
        it, and meanwhile the kernel answers the release of any unix socket
        (our end closed after its send, the worker's after its receive, if
        that copy is the last) by queueing its AF_UNIX garbage collection
        on a kworker, which then takes the core from the zygote or a rank:
        some 90 collections a launch of 64 ranks, which were all running in
        14.3-14.7 ms then, 12.5-14.0 now (benchmarks/README.md).  Kept
        here, neither end is released while the ranks come up."""
        self.spent.append(end)

    def close_spent(self, close_fds: Sequence[int] = ()) -> list[int]:
        """Close what spend() kept (the ranks are up by now) and the
        rehearsal forget_rehearsal() left open: ``close_fds`` (a list of the
        zygote's fds, for workers to close) without those, whose numbers the
        next fds may take."""
        closed = {end.fileno() for end in self.spent}
        for end in self.spent:
            end.close()
        self.spent.clear()
        if self.forgotten is not None:
            closed.add(self.forgotten.payload)
            self.forgotten.close()
            self.forgotten = None
        return [fd for fd in close_fds if fd not in closed]

    def wanted(self) -> int:
        """How many more to make ready in the background now."""
        background = min(len(self.owed), self.cap - len(self.waiting))
        return max(self.asked - len(self.waiting), background, 0)

    def refill_delay(self) -> float | None:
        """Seconds before a refill may start (None: none wanted, nothing
        spent to close)."""
        if self.wanted() <= 0 and not self.spent:
            return None
        return max(0.01, self.quiet_until - time.monotonic())

    def refill_due(self) -> bool:
        """Whether to refill now: workers wanted or spent ends to close,
        and the quiet time over."""
        due = self.wanted() > 0 or bool(self.spent)
        return due and time.monotonic() >= self.quiet_until

    @property
    def quiet_until(self) -> float:
        """No background refill before this (time.monotonic())."""
        return max([self.held_until, *self.coming_up.values()])

    def launched(self, launch: object, nprocs: int) -> None:
        """``launch`` began: its ranks come up, no refill for a while (until
        they all ended, if that is sooner: see ended)."""
        now = time.monotonic()
        quiet = now + QUIET_AFTER_LAUNCH + QUIET_PER_RANK * nprocs
        # (Those whose quiet is over are forgotten: one that started no rank never ends.)
        self.coming_up = {other: end for other, end in self.coming_up.items() if end > now}
        self.coming_up[launch] = quiet

    def ended(self, launch: object) -> None:
        """Every rank of ``launch`` ended: none of it comes up now, so its
        quiet ends, and the refill may start unless another launch's ranks
        come up.  A launch from ready workers whose ranks return at once (a
        sweep's) ends well before its quiet would: 256 such ranks returned
        0.16 s after the call, and the quiet held the refill until 0.52."""
        self.coming_up.pop(launch, None)

    def owe(self, size: int, running: int = 0) -> None:
        """A launch of ``size`` ranks ended (or, a multiprocessing process,
        started, ``running`` of them running now, it among them): workers
        are owed until as many wait or are owed as the level, which this
        launch raises to its size (that process: to as many as run).

        Not ``size`` more at every launch: launches that came faster than
        the refill, each forking its ranks while the last one's were owed
        still, added up, and 200 processes started and joined one at a
        time left 200 workers ready, 20 launches of 8 in a row 160.  The
        slots owed are the launch's ranks that no waiting or owed worker
        has, then its ranks again (a multiprocessing process's: rank 0)."""
        self.level = min(self.cap, max(self.level, size, running))
        short = self.level - len(self.waiting) - len(self.owed)
        if short <= 0:
            return
        held = collections.Counter(self.owed)
        for slot, workers in self.by_slot.items():
            held[slot] += len(workers)
        free = [rank for rank in range(size) if not held[rank]]
        slots = itertools.chain(free, itertools.cycle(range(size)))
        self._owe(itertools.islice(slots, short), self.cap)

    def _owe(self, slots: Iterable[int], most: int) -> None:
        """Owe workers for ``slots``, ``most`` owed at most (the latest)."""
        self.owed.extend(slots)
        del self.owed[: max(0, len(self.owed) - most)]

    def refill(self, close_fds: Sequence[int]) -> None:
        """One idle moment's refill: as many as fork in about REFILL_SLICE
        (REFILL_BATCH at most), so that a launch coming meanwhile waits
        that long at most.  The last launch's spent ends are closed first.

        A step costs the zygote about a millisecond besides its forks (the
        limits and memory check, the name, the signal handlers lent and
        taken back), once a step however many it forks, so the batch is
        sized by the fork loop's time a worker alone: sized by the whole
        step's, it was one or two workers a step with ready workers'
        rehearsals on the cores, 2.3 ms of the zygote's time each (AMD
        EPYC; benchmarks/README.md)."""
        close_fds = self.close_spent(close_fds)
        batch = max(1, min(REFILL_BATCH, int(REFILL_SLICE / self.fork_time)))
        count = min(self.wanted(), batch)
        if count <= 0:
            return
        made = self.fill(count, close_fds, slots=self.owed[:count])
        del self.owed[:made]
        if made < count:
            # The limits stop it: nothing more owed, and what prefork() asked
            # for is tried again in a second, not at every idle moment.
            self.owed.clear()
            self.held_until = time.monotonic() + 1.0

    def prefork(self, count: int, refill: bool, close_fds: Sequence[int]) -> int:
        """prefork(count, refill=refill): ``count`` ready now (fewer ready
        are retired); with ``refill``, kept so, and the background on (up
        to its cap), else neither.  How many are ready."""
        self.asked = count if refill else 0
        self.cap = cap_from_environment(os.environ) if refill else 0
        self.owed.clear()
        self.level = 0
        close_fds = self.close_spent(close_fds)
        while len(self.waiting) > count:
            pid = next(iter(self.waiting))
            self.gone(pid)
            _kill(pid)
        # Each worker made now closes its copy of ``warm_w`` once warmed
        # up: its EOF says they all have.
        warm_r, warm_w = os.pipe2(os.O_CLOEXEC)
        try:
            while len(self.waiting) < count:
                batch = min(count - len(self.waiting), 256)
                if not self.fill(batch, [*close_fds, warm_r], warm_w):
                    break
            os.close(warm_w)
            warm_w = -1
            deadline = time.monotonic() + 10.0
            while oscall.wait_readable([warm_r], max(0.0, deadline - time.monotonic())):
                if not os.read(warm_r, 4096):
                    break
        finally:
            os.close(warm_r)
            if warm_w >= 0:
                os.close(warm_w)
        return len(self.waiting)

    def fill(
        self, count: int, close_fds: Sequence[int], warm_fd: int = -1, slots: Sequence[int] = ()
    ) -> int:
        """Fork up to ``count`` ready workers, within the limits; how many.
        Each closes ``warm_fd`` (if given) once warmed up.  The first are
        made for ``slots`` (owed ones), the rest for the lowest ranks no
        waiting worker has."""
        # A soft RLIMIT_NOFILE too low for them is raised, in the zygote
        # alone (its workers and ranks get the caller's: see
        # procstate.open_files_back), for as many as it may keep, at once:
        # each worker made after the raise rehearses giving the caller's
        # back (wake.Rehearsal); one made before leaves that to its rank's
        # wake, unrehearsed.
        most = max(len(self.waiting) + count, self.cap, self.asked)
        procstate.raise_open_files(LIMIT_SHARE * FDS_EACH * most)
        count = min(count, room_under_limits(len(self.waiting)))
        if count <= 0:
            return 0
        if self.rehearsal is None:
            try:
                self.rehearsal = Rehearsal(self.state)
            except OSError:
                # Out of fds or memory, or the cwd a launch left us in was
                # removed since (which a worker cannot rehearse in): none now.
                return 0
        rehearsal = self.rehearsal
        pairs: list[tuple[socket.socket, socket.socket]] = []
        try:
            for _ in range(count):
                pairs.append(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        except OSError:
            pass  # out of fds: as many as there are pairs
        if not pairs:
            return 0
        slots = [*slots[: len(pairs)]]
        slots += self._new_slots(len(pairs) - len(slots), taken=set(slots))
        signal.pthread_sigmask(signal.SIG_BLOCK, ZYGOTE_SIGNALS)
        # The workers inherit the name they wait under: never listed, not
        # even for a moment after the fork, as anything but ready workers
        # (client.ready_workers; the stack walk, which signals ranks).
        own_name = _rename(READY_NAME)
        pids: list[int] = []
        try:
            unlent = self.signals.lend()
            loop = oscall.ForkLoop(len(pairs), self.me, 0, signal.SIGKILL)
            started = time.monotonic()
            rank = loop.fork()
            if rank != -1:
                in_ready_worker(
                    loop,
                    rank,
                    pairs,
                    close_fds,
                    warm_fd,
                    unlent,
                    self.me,
                    self.state,
                    own_name,
                    slots[rank],
                    rehearsal,
                )
            pids = loop.pids  # as many as forked before a failure (EAGAIN: RLIMIT_NPROC)
            if pids:
                self.fork_time = (time.monotonic() - started) / len(pids)
        except BaseException:
            end_if_forked(self.me)
            raise
        finally:
            _rename(own_name)
            self.signals.take_back()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, ZYGOTE_SIGNALS)
            for index, (ours, theirs) in enumerate(pairs):
                if index < len(pids):
                    self.waiting[pids[index]] = ours
                    self.theirs[pids[index]] = theirs  # see spend()
                    self.born[pids[index]] = self.generation
                    self.slot[pids[index]] = slots[index]
                    self.by_slot.setdefault(slots[index], {})[pids[index]] = None
                else:
                    ours.close()
                    theirs.close()
        return len(pids)

    def forget_rehearsal(self) -> None:
        """Before anything that may change the zygote's environment, cwd or
        sys.path (a message: a launch takes on its caller's, a preload
        imports; a launch's preparation left for later): the next fill
        makes the rehearsal again.  Kept between them, it is made once for
        a whole refill: made a step at a time, it took the zygote some 0.5
        ms a step and 100 page copies (its pages, shared with the workers
        made before, are copied as it writes them: AMD EPYC).

        Its memfd is closed before the next fill (close_spent), not here: at
        a launch's message that close took 93-103 us of the zygote's before
        its first wake (torch preloaded, AMD EPYC), which the launch waited
        for.  Until then it is among fds(), which the ranks a launch forks
        close before anything of theirs runs."""
        if self.rehearsal is not None:
            # (None is set aside now: fill makes a rehearsal only after close_spent.)
            self.forgotten = self.rehearsal
            self.rehearsal = None

    def _new_slots(self, count: int, taken: Collection[int] = ()) -> list[int]:
        """Slots for ``count`` workers about to be made (beside those for
        ``taken``): the lowest ranks that no waiting worker has."""
        slots: list[int] = []
        rank = 0
        while len(slots) < count:
            if rank not in self.by_slot and rank not in taken:
                slots.append(rank)
            rank += 1
        return slots

    def _pick(self, rank: int, nprocs: int) -> int:
        """The waiting worker to take for ``rank`` of a launch of
        ``nprocs``: the oldest of slot ``rank``; else the oldest that no
        later rank of the launch would take for its slot."""
        own = self.by_slot.get(rank)
        if own:
            return next(iter(own))
        for pid in self.waiting:
            slot = self.slot[pid]
            if not rank < slot < nprocs or len(self.by_slot[slot]) > 1:
                return pid
        return next(iter(self.waiting))

    def _unslot(self, pid: int) -> None:
        slot = self.slot.pop(pid, None)
        if slot is not None:
            workers = self.by_slot[slot]
            del workers[pid]
            if not workers:
                del self.by_slot[slot]

    def wake(
        self, ranks: Ranks, group: int, report: Callable[[list[int]], bool] | None = None
    ) -> list[int]:
        """Give the first ranks of a launch to ready workers, ``group`` its
        process group (0: none of its own): their pids, rank by rank (fewer
        than nprocs when too few are ready).  Each worker is woken as it is
        taken; a worker dead meanwhile is killed, and the next one takes its
        rank.  With ``report``, see _wake_reported."""
        header = ranks.header
        if report is not None and len(self.waiting) >= header.nprocs:
            return self._wake_reported(ranks, group, report)
        pids: list[int] = []
        while self.waiting and len(pids) < header.nprocs:
            taken = self._take(ranks, len(pids))
            if taken is None:
                break  # a preload list that large: the ranks are forked
            pid, ours, message, rights = taken
            try:
                if group:
                    os.setpgid(pid, group)
                ours.sendmsg(message, rights)
            except OSError:
                _kill(pid)  # our unreaped child: the pid is its own
                continue
            finally:
                self.spend(ours)
            pids.append(pid)
        return pids

    def _wake_reported(
        self, ranks: Ranks, group: int, report: Callable[[list[int]], bool]
    ) -> list[int]:
        """wake(), the caller told the pids first: ready workers take every
        rank, ``report`` has their pids, and only then is any woken (report
        False: the launch failed there, none is).  The caller runs first so,
        where woken workers would take the cores it waits on for the pids
        (on 2 cores start() returned 1-1.7 ms later so, after the target
        had run; benchmarks/README.md).  A worker found dead is not taken;
        one that dies after its pid went out is killed, its rank ends so.
        If too few are left to take every rank (some were dead), those
        taken are woken in turn, up to the first that cannot be."""
        nprocs = ranks.header.nprocs
        taken: list[tuple[int, socket.socket, list[bytes], Ancillary]] = []
        while self.waiting and len(taken) < nprocs:
            one = self._take(ranks, len(taken))
            if one is None:
                break
            pid, ours = one[:2]
            try:
                if _exited(pid):
                    raise ChildProcessError(f"ready worker {pid} exited")  # its SIGCHLD comes
                if group:
                    os.setpgid(pid, group)
            except OSError:
                _kill(pid)
                self.spend(ours)
                continue
            taken.append(one)
        pids = [pid for pid, _ours, _message, _sent in taken]
        all_taken = len(pids) == nprocs
        wake = not all_taken or report(pids)
        for index, (pid, ours, message, rights) in enumerate(taken):
            try:
                if index >= len(pids):
                    _kill(pid)  # after one that could not be woken: its rank is forked
                elif wake:
                    ours.sendmsg(message, rights)
            except OSError:
                _kill(pid)  # reported: its rank ends so; else forked
                if not all_taken:
                    del pids[index:]
            finally:
                self.spend(ours)
        return pids

    def _take(
        self, ranks: Ranks, rank: int
    ) -> tuple[int, socket.socket, list[bytes], Ancillary] | None:
        """A ready worker (see _pick), out of the pool, for ``rank``: its pid,
        our end of its socketpair, its assignment and the fds that go with
        it (sendmsg's ancillary data); None (and none taken) if the
        assignment would be too large."""
        header = ranks.header
        own_env = marshal.dumps(header.envs.get(rank)) if header.envs else b""
        if ASSIGN.size + len(ranks.brief) + len(own_env) > MAX_ASSIGN:
            return None
        pid = self._pick(rank, header.nprocs)
        ours = self.waiting.pop(pid)
        self._unslot(pid)
        self.spend(self.theirs.pop(pid))
        same = self.born.pop(pid) == self.generation and ranks.same_state
        rights, flags = ranks.fds_of(rank)
        flags |= SAME_STATE if same else 0
        taken = time.monotonic_ns()  # before its pid can reach the caller
        head = ASSIGN.pack(rank, len(ranks.fds[2]), flags, len(ranks.brief), taken)
        return pid, ours, [head + ranks.brief + own_env], rights

    @staticmethod
    def dup_fds(fds: Sequence[int]) -> list[int] | None:
        """Copies of a launch's argument fds for its ready workers (the
        zygote's own are closed once it has unpickled); None, the ranks
        then forked, when out of fds."""
        copies: list[int] = []
        try:
            for fd in fds:
                copies.append(os.dup(fd))
        except OSError:
            for fd in copies:
                os.close(fd)
            return None
        return copies

    def usable_for(self, header: protocol.LaunchHeader, work_size: int) -> bool:
        """Whether a launch may take ready workers: forked ranks, the fds
        for one message, fn and args (``work_size`` bytes pickled) small
        enough to unpickle in each (MAX_WAKE_WORK) unless it has one rank,
        and no RLIMIT_NPROC of the caller's own (see :func:`own_nproc`)."""
        return (
            bool(self.waiting)
            and header.binary is None
            and (header.nprocs == 1 or work_size <= MAX_WAKE_WORK)
            and header.user_fds + 6 <= _channel.MAX_FDS
            and not own_nproc(header)
        )

    def stand_aside(self) -> None:
        """Before the ranks of a caller with an RLIMIT_NPROC of its own
        fork under it: kill the ready workers and reap them (the kernel
        counts a child against its user's processes until it is reaped).
        None are made ready again until prefork() or a launch of a caller
        without a limit of its own asks."""
        waiting = list(self.waiting)
        self.retire()
        self.owed.clear()
        self.level = 0
        self.asked = 0
        for pid in waiting:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped already

    def make_room(self) -> bool:
        """A fork of a launch failed for want of processes (EAGAIN: the
        caller's RLIMIT_NPROC, a cgroup's pids.max, the machine's pids):
        if workers wait, which the launch did not take (a binary's, or
        fn and args too large for them), kill and reap them (stand_aside)
        so that the fork may be tried again, as the launch would have gone
        without them.  Whether any waited."""
        if not self.waiting:
            return False
        self.stand_aside()
        return True

    def gone(self, pid: int) -> None:
        """A child was reaped: if a ready worker, it is not ready now."""
        ours = self.waiting.pop(pid, None)
        theirs = self.theirs.pop(pid, None)
        self.born.pop(pid, None)
        self._unslot(pid)
        for end in (ours, theirs):
            if end is not None:
                end.close()

    def retire(self) -> None:
        """Kill every ready worker (reaped as any exited child is)."""
        self._owe(self.slot.values(), max(self.cap, self.asked))
        for pid, ours in self.waiting.items():
            ours.close()
            _kill(pid)
        for theirs in self.theirs.values():
            theirs.close()
        self.waiting.clear()
        self.theirs.clear()
        self.born.clear()
        self.slot.clear()
        self.by_slot.clear()
        self.close_spent()


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited (left unreaped: SIGCHLD's
    handling reaps it)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def own_nproc(header: protocol.LaunchHeader) -> bool:
    """Whether a launch's caller set an RLIMIT_NPROC other than the
    zygote's: its ranks are forked under it, as the caller's own fork
    would be, never from ready workers, which count against it."""
    import resource

    return resource.RLIMIT_NPROC in header.process_state.get("rlimits", {})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rename(name: str) -> str:
    """Set this process's name (/proc/self/comm); the old one."""
    try:
        with open("/proc/self/comm", "r+b", buffering=0) as f:
            old = f.read().decode().strip()
            f.write(name.encode())
        return old
    except OSError:
        return name
