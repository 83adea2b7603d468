"""The machine the bench runs on, as its output records it, and the limits
a run must fit (processes, open files) before it starts."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from fastspawn._bench.session import Reports

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastspawn._bench.ranks import Record


def machine() -> Record:
    """The machine description that goes with the numbers."""
    import platform

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    cpu = value.strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    import fastspawn

    torch_version = None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch_version = str(getattr(torch, "__version__", "unknown"))
    else:
        from importlib import metadata

        try:
            torch_version = metadata.version("torch")  # installed, not imported
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "fastspawn": fastspawn.__version__,
        "torch": torch_version,
        "memory_bytes": memory,
        "uncached_modules": len(uncached_modules()),
    }


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity): what a machine
    record calls ``usable_cores``, without the rest of the record."""
    return len(os.sched_getaffinity(0))


def uncached_modules() -> list[str]:
    """fastspawn's modules (paths in the package) that a fresh interpreter
    compiles from source: no bytecode cache matching them where this
    interpreter looks (``PYTHONDONTWRITEBYTECODE`` kept it from writing
    one, or the install is read-only).  Every spawned rank, and a zygote or
    forkserver as it starts, then pays that compilation (15-17 ms of CPU
    a spawned rank on an Intel Xeon VM, benchmarks/README.md)."""
    import fastspawn

    root = os.path.dirname(os.path.abspath(fastspawn.__file__))
    missing = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not _cache_matches(path):
                missing.append(os.path.relpath(path, root))
    return sorted(missing)


def _cache_matches(source: str) -> bool:
    """Whether the bytecode cache of ``source`` is there and is the one the
    import system would load: this Python's magic number, and the source's
    mtime and size (a hash-based cache counts as there)."""
    import importlib.util

    try:
        cached = importlib.util.cache_from_source(source)
        stat = os.stat(source)
        with open(cached, "rb") as f:
            header = f.read(16)
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(header[4:8], "little") & 1:
        return True  # hash-based: checked by its hash, if at all
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    return mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF


# fds the bench holds per rank while a launch runs: a pidfd (fastspawn), a
# sentinel (multiprocessing), plus torch's error queue pipe; none for the
# floor (its helper reports on the ranks over one socket).
_FDS_PER_RANK = {"fastspawn": 1, "mp": 2, "torch": 4, "floor": 0, "binary": 1}
_SPARE_TASKS = 16  # the zygote, forkservers, resource tracker, their threads
_SPARE_FDS = 64


def limit_problem(
    nprocs: int,
    fds_per_rank: int,
    *,
    nproc_limit: int,
    tasks_in_use: int,
    nofile_limit: int,
    fds_open: int,
    report_ranks: int,
    pid_max: int | None = None,
    threads_max: int | None = None,
) -> str | None:
    """Why ``nprocs`` ranks cannot run under these limits, or None.

    ``nproc_limit`` / ``nofile_limit`` are soft RLIMIT_NPROC / RLIMIT_NOFILE
    values (resource.RLIM_INFINITY for none); ``tasks_in_use`` counts this
    user's processes and threads, ``fds_open`` this process's open fds;
    ``pid_max`` / ``threads_max`` the machine's (None: not checked).  The
    limits themselves are fastspawn's launch check (fastspawn._os.limits), here counting
    what runs already, with room for the bench's helpers.
    """
    from fastspawn._os import limits as _limits

    demand = _limits.Demand(
        nprocs,
        f"--nprocs {nprocs}",
        "lower --nprocs",
        holder="the bench",
        fds_per_rank=fds_per_rank,
        tasks_in_use=tasks_in_use,
        fds_open=fds_open,
        spare_tasks=_SPARE_TASKS,
        spare_fds=_SPARE_FDS,
    )
    limits = _limits.Limits(
        nproc=_limits.finite(nproc_limit),
        nofile=_limits.finite(nofile_limit),
        pid_max=pid_max,
        threads_max=threads_max,
    )
    problem = _limits.problem(demand, limits)
    if problem is None and nprocs > report_ranks:
        problem = (
            f"--nprocs {nprocs} is more ranks than the bench's report pipe holds "
            f"({report_ranks}; its size is capped by /proc/sys/fs/pipe-max-size): "
            "lower --nprocs"
        )
    return problem


def check_limits(nprocs: int, methods: Sequence[str], reports: Reports) -> str | None:
    """:func:`limit_problem` with this process's real limits.  RLIMIT_NPROC
    counts as set even where the kernel would let this process past it
    (root): a sweep measures launches, and one that runs past the limit its
    user set is not the measurement asked for."""
    import resource

    from fastspawn._os import limits as _limits

    machine = _limits.Limits.current()
    nproc_limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    tasks = _limits.tasks_of(os.getuid()) if nproc_limit != resource.RLIM_INFINITY else 0
    return limit_problem(
        nprocs,
        max(_FDS_PER_RANK[m.split("-", 1)[0]] for m in methods),
        nproc_limit=nproc_limit,
        tasks_in_use=tasks,
        nofile_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        fds_open=len(os.listdir("/proc/self/fd")),
        report_ranks=reports.max_ranks,
        pid_max=machine.pid_max,
        threads_max=machine.threads_max,
    )
