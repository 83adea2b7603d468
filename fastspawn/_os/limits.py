"""How many processes one launch may ask for: the user's and the machine's
limits that ``nprocs`` must stay within, checked before anything starts.

A launch of N ranks takes N processes of this user (RLIMIT_NPROC), N of the
machine's process ids (kernel.pid_max) and tasks (kernel.threads-max), and N
open files in the caller, which holds a pidfd per rank (RLIMIT_NOFILE).  A
launch that asks for more than a limit allows can never succeed, and unchecked
it fails only part-way, after forking as many processes as the limit let
through: with the kernel's limits, after taking every free pid on the
machine, so that every user's fork fails meanwhile.  start_processes,
fastspawn.elastic and ``fastspawn run`` refuse such a launch up front
(:func:`check_nprocs`), ``fastspawn bench`` its sweep (see :class:`Demand`).
"""

from __future__ import annotations

import os
import resource  # here, not at first use: see held.import_held

# capability(7) numbers.
_CAP_SYS_ADMIN = 21
_CAP_SYS_RESOURCE = 24

_PID_MAX = "/proc/sys/kernel/pid_max"
_THREADS_MAX = "/proc/sys/kernel/threads-max"
# The least each can be: kernel/pid.c bounds what is written to pid_max
# (per pid namespace since Linux 6.14) below by pid_max_min, RESERVED_PIDS
# + 1; kernel/fork.c's set_max_threads() clamps threads-max to MIN_THREADS.
_PID_MAX_LEAST = 301
_THREADS_MAX_LEAST = 20


class Limits:
    """The limits a launch counts against; None where there is none.

    Attributes:
        nproc: the soft RLIMIT_NPROC, None where the kernel does not hold
            this process to it (:func:`nproc_enforced`).
        nofile: the soft RLIMIT_NOFILE.
        pid_max, threads_max: the machine's (kernel.pid_max,
            kernel.threads-max), None where unreadable.
    """

    __slots__ = ("nproc", "nofile", "pid_max", "threads_max")

    def __init__(
        self,
        *,
        nproc: int | None,
        nofile: int | None,
        pid_max: int | None = None,
        threads_max: int | None = None,
    ) -> None:
        self.nproc = nproc
        self.nofile = nofile
        self.pid_max = pid_max
        self.threads_max = threads_max

    def __repr__(self) -> str:
        return (
            f"Limits(nproc={self.nproc}, nofile={self.nofile}, pid_max={self.pid_max}, "
            f"threads_max={self.threads_max})"
        )

    @classmethod
    def current(cls, tasks: int | None = None) -> Limits:
        """This process's limits now: two getrlimit calls and two small /proc
        files, and where RLIMIT_NPROC is concerned two more (nproc_enforced).

        ``tasks``: the new processes a launch asks for.  Where they fit
        under the soft RLIMIT_NPROC beside this process, whether the kernel
        enforces it changes no answer, and those two files are not read:
        the check is on every launch's path (check_nprocs: 0.52 ms there
        before, the first launch after a pause; 0.23 ms with this and
        read_number's raw file, AMD EPYC)."""
        nproc = finite(resource.getrlimit(resource.RLIMIT_NPROC)[0])
        fits = nproc is None or (tasks is not None and 1 + tasks <= nproc)
        # Nor is a sysctl read where the tasks, with this process, are no
        # more than the least a kernel lets it be (None: no answer changes).
        total = None if tasks is None else 1 + tasks
        return cls(
            nproc=nproc if fits or nproc_enforced() else None,
            nofile=finite(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
            pid_max=_sysctl(_PID_MAX, total, _PID_MAX_LEAST),
            threads_max=_sysctl(_THREADS_MAX, total, _THREADS_MAX_LEAST),
        )


class Demand:
    """What a launch asks of the limits, and how a refusal words it.

    A launch (start_processes, fastspawn.elastic, ``fastspawn run``) compares
    its ``nprocs`` alone with each limit, counting nothing else but the
    caller's own process: what else the user runs and what the caller holds
    change from moment to moment, counting them means a scan of /proc per
    launch, and an ordinary launch on a busy machine must not be refused on
    such a guess.  A launch that passes here but does not fit beside what
    runs already fails at its fork with EAGAIN (a BlockingIOError that names
    the limit), leaving nothing behind.  The
    bench counts both (``tasks_in_use``, ``fds_open``) and keeps room for its
    helpers (``spare_*``): a sweep refused up front beats one that fails in
    its last round.

    Attributes:
        nprocs: the ranks asked for.
        subject: how the message names the request (``"nprocs=300"``).
        fewer: the first remedy (``"start fewer ranks"``).
        holder: who holds ``fds_per_rank`` fds per rank (a pidfd each).
        tasks_in_use: processes and threads this user runs now (0: not
            counted); fds_open: fds this process holds now (0: not counted).
        spare_tasks, spare_fds: room kept beside the ranks.
    """

    __slots__ = (
        "nprocs",
        "subject",
        "fewer",
        "holder",
        "fds_per_rank",
        "tasks_in_use",
        "fds_open",
        "spare_tasks",
        "spare_fds",
    )

    def __init__(
        self,
        nprocs: int,
        subject: str,
        fewer: str = "start fewer ranks",
        *,
        holder: str = "the caller",
        fds_per_rank: int = 1,
        tasks_in_use: int = 0,
        fds_open: int = 0,
        spare_tasks: int = 0,
        spare_fds: int = 0,
    ) -> None:
        self.nprocs = nprocs
        self.subject = subject
        self.fewer = fewer
        self.holder = holder
        self.fds_per_rank = fds_per_rank
        self.tasks_in_use = tasks_in_use
        self.fds_open = fds_open
        self.spare_tasks = spare_tasks
        self.spare_fds = spare_fds

    def __repr__(self) -> str:
        return f"Demand(nprocs={self.nprocs}, subject={self.subject!r})"

    @property
    def tasks(self) -> int:
        """New processes the launch needs (beside those in use)."""
        return self.nprocs + self.spare_tasks

    @property
    def fds(self) -> int:
        """Open files the holder needs, those it holds now included."""
        return self.fds_open + self.nprocs * self.fds_per_rank + self.spare_fds

    @property
    def about(self) -> str:
        """ "about " where the counts are estimates (spares kept)."""
        return "about " if self.spare_tasks or self.spare_fds else ""


def problem(demand: Demand, limits: Limits) -> str | None:
    """Why ``demand`` cannot start under ``limits`` (naming the limit and
    its value, and what to do), or None when it may."""
    # This user's limit on processes first, then the machine's (past which
    # no ulimit helps), then the open files.
    for why in (_nproc_problem, _machine_problem, _nofile_problem):
        found = why(demand, limits)
        if found is not None:
            return found
    return None


def _nproc_problem(demand: Demand, limits: Limits) -> str | None:
    # The caller is one of this user's processes, counted or not.
    in_use = max(demand.tasks_in_use, 1)
    if limits.nproc is None or in_use + demand.tasks <= limits.nproc:
        return None
    if demand.tasks_in_use:
        more = f"more processes, but RLIMIT_NPROC (ulimit -u) is {limits.nproc}, and this "
        more += f"user already runs {demand.tasks_in_use} processes and threads"
    else:
        more = f"processes beside the caller, but RLIMIT_NPROC (ulimit -u) is {limits.nproc}"
    fits_machine = _machine_problem(demand, limits) is None
    raise_it = ", or raise the limit with ulimit -u" if fits_machine else ""
    return f"{demand.subject} needs {demand.about}{demand.tasks} {more}: {demand.fewer}{raise_it}"


def _nofile_problem(demand: Demand, limits: Limits) -> str | None:
    if limits.nofile is None or demand.fds <= limits.nofile:
        return None
    fewer = demand.fewer
    if demand.fds_open:  # the fds held counted: how many ranks fit beside them
        fit = (limits.nofile - demand.fds_open - demand.spare_fds) // demand.fds_per_rank
        if fit > 0:
            fewer += f" (at most {fit} here)"
    return (
        f"{demand.subject} needs {demand.about}{demand.fds} open files in {demand.holder} "
        f"({demand.fds_per_rank} per rank), but RLIMIT_NOFILE (ulimit -n) is "
        f"{limits.nofile}: {fewer}, or raise the limit with ulimit -n {demand.fds}"
    )


def _machine_problem(demand: Demand, limits: Limits) -> str | None:
    """The machine's own limits, on all its users together: no rlimit
    raises them.  The caller holds one pid (and task) already."""
    for name, limit, what in (
        ("kernel.pid_max", limits.pid_max, "the bound on process ids"),
        ("kernel.threads-max", limits.threads_max, "the limit on tasks"),
    ):
        if limit is not None and 1 + demand.tasks > limit:
            return (
                f"{demand.subject} needs {demand.about}{demand.tasks} more processes, but "
                f"{name}, {what} of the whole machine, is {limit}: {demand.fewer}"
            )
    return None


# fds a launch opens in the caller beside a pidfd per rank (its report
# channel, the zygote's socket and pidfd, the warden's, an epoll set: 4 to 5
# measured), with room to spare.
LAUNCH_FDS = 16


class LimitError(ValueError):
    """A launch that the limits cannot let start: on processes, on open
    files, or on the size of one string exec passes (an environment
    variable); the message names the limit, its value and what to do."""


def check_nprocs(
    nprocs: int, subject: str, fewer: str = "start fewer ranks", fds_per_rank: int = 1
) -> None:
    """Refuse a launch of ``nprocs`` ranks that no limit lets start.

    The refusal counts the ranks alone (see :class:`Demand`); the limit on
    open files it advises counts the fds this process holds now and a
    launch's own as well, so that the launch starts once it is raised so.

    Args:
        fds_per_rank: the fds the caller holds per rank at once while the
            ranks start (a pidfd; fastspawn.elastic adds the ranks' pipes
            and log files).

    Raises:
        LimitError: ``nprocs`` processes beside the caller's own are more
            than the caller's RLIMIT_NPROC (where enforced), kernel.pid_max
            or kernel.threads-max allow, or ``nprocs * fds_per_rank`` fds
            more than its RLIMIT_NOFILE; the message names the limit, its
            value and what to do.
    """
    limits = Limits.current(tasks=nprocs)
    if problem(Demand(nprocs, subject, fewer, fds_per_rank=fds_per_rank), limits) is None:
        return
    held = len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd left out
    demand = Demand(
        nprocs, subject, fewer, fds_per_rank=fds_per_rank, fds_open=held, spare_fds=LAUNCH_FDS
    )
    raise LimitError(problem(demand, limits))


def nproc_enforced() -> bool:
    """Whether the kernel holds this process's forks to its RLIMIT_NPROC.

    kernel/fork.c, copy_process(): a fork past the limit fails with EAGAIN
    unless the real user is root of the initial user namespace (INIT_USER)
    or the process has CAP_SYS_RESOURCE or CAP_SYS_ADMIN there (setrlimit(2)
    says as much).  Root outside a user namespace of its own forks past any
    RLIMIT_NPROC; root inside one (a rootless container) does not.
    """
    initial_ns, host_uid = _user_namespace(os.getuid())
    if host_uid == 0:
        return False
    if not initial_ns:
        return True  # capabilities held in a user namespace do not count here
    wanted = 1 << _CAP_SYS_RESOURCE | 1 << _CAP_SYS_ADMIN
    return not _effective_capabilities() & wanted


def _user_namespace(uid: int) -> tuple[bool, int | None]:
    """(whether this is the initial user namespace, which uid ``uid`` is
    outside it: the host's, for a namespace one level down).  The initial
    namespace maps every id to itself (user_namespaces(7))."""
    try:
        with open("/proc/self/uid_map") as f:
            lines = [line.split() for line in f if line.strip()]
    except OSError:
        return True, uid  # no user namespaces in this kernel
    initial = lines == [["0", "0", "4294967295"]]
    for inside, outside, count in ((int(a), int(b), int(c)) for a, b, c in lines):
        if inside <= uid < inside + count:
            return initial, outside + uid - inside
    return initial, None


def _effective_capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def tasks_of(uid: int) -> int:
    """Processes plus threads of ``uid``: what RLIMIT_NPROC counts (a scan
    of /proc: the bench's, not every launch's)."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uid_line = threads = None
                for line in f:
                    if line.startswith("Uid:"):
                        uid_line = line
                    elif line.startswith("Threads:"):
                        threads = int(line.split()[1])
                        break
        except (OSError, ValueError):
            continue  # gone meanwhile
        if uid_line is not None and int(uid_line.split()[1]) == uid and threads:
            count += threads
    return count


def _sysctl(path: str, total: int | None, least: int) -> int | None:
    """The sysctl at ``path``, or None where ``total`` tasks cannot pass
    it: no more than ``least``, the lowest value a kernel lets it have."""
    if total is not None and total <= least:
        return None
    return read_number(path)


def read_number(path: str) -> int | None:
    """The number a small file holds (a sysctl, a cgroup's limit or
    usage); None where it is unreadable or holds something else (a
    cgroup's "max")."""
    # A raw file, not a text one: on every launch's path, where a text file
    # object took 37 us a read in a loop and 282 after a pause, 14 and 174
    # (AMD EPYC).  Not os.open's bare fd either: a Ctrl-C landing between
    # the open and the try would leak it, where a file object is closed as
    # the exception unwinds.
    try:
        with open(path, "rb", buffering=0) as f:
            return int(f.read(64))
    except (OSError, ValueError):
        return None


def finite(limit: int) -> int | None:
    """A resource limit as a number, None for RLIM_INFINITY."""
    return None if limit == resource.RLIM_INFINITY else limit


def eagain_advice() -> str:
    """What to say about EAGAIN from fork or clone: the limit on processes
    it most likely hit, with its value."""
    limits = Limits.current()
    if limits.nproc is not None:
        return (
            f"; the limit on processes may be reached: this user's RLIMIT_NPROC "
            f"(ulimit -u) is {limits.nproc}, threads counted; start fewer processes, or "
            "raise the limit with ulimit -u"
        )
    return (
        f"; the limit on processes may be reached: the machine's kernel.pid_max is "
        f"{limits.pid_max} and kernel.threads-max {limits.threads_max} for all its "
        "users (or a cgroup's pids.max is lower); start fewer processes"
    )
