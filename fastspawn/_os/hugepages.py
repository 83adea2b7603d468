"""The zygote's memory in huge pages: what its workers share, fork and free.

Every fork() copies one page-table entry per 4 KiB page of the parent's
private memory, and every child's exit clears them again; when one rank of
hundreds fails, that teardown is most of the time until the caller hears of
it.  Memory in a huge page costs one entry per 2 MiB instead, and stays cheap
after a write splits it back into 4 KiB entries (the kernel then handles the
still-huge page in batches).  benchmarks/teardown_cost.py measures the
slopes on a 2-core VM: 1.3-1.8 us of teardown CPU per child for each
mapping, 22-26 us for each MiB in 4 KiB pages, under 1 us per MiB in huge
pages.  So the zygote

- places Python's object arenas in one 2 MiB-aligned region from its first
  line on (``place_arenas``), instead of wherever mmap puts each 1 MiB arena;
- when idle, collapses the whole 2 MiB stretches of that region and of the
  malloc heap into huge pages (``collapsible_ranges``, ``collapse``).

All of it is off with FASTSPAWN_HUGEPAGES=0, before Linux 6.1 (no
MADV_COLLAPSE) and where transparent huge pages are "never".

This module imports nothing but ``os`` (and the C core when it acts):
``place_arenas`` runs before the zygote imports anything else, so that
those imports land in the region.
"""

from __future__ import annotations

import os

HUGE_PAGE = 2 << 20
# Address space only; arenas beyond it go where they would have gone.  A
# zygote with torch imported fills 47 MiB of it.
ARENA_REGION = 256 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def wanted() -> bool:
    """Use huge pages unless the user opted out (FASTSPAWN_HUGEPAGES=0), the
    kernel predates MADV_COLLAPSE or the machine has huge pages off."""
    if os.environ.get("FASTSPAWN_HUGEPAGES", "1").strip() == "0":
        return False
    if not kernel_has_collapse():
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False  # no transparent huge pages in this kernel


def kernel_has_collapse() -> bool:
    """MADV_COLLAPSE arrived in Linux 6.1.  (An attempt's EINVAL cannot tell:
    the kernel also answers EINVAL for a stretch with no page in it yet.)"""
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 1)


def address_space_limited() -> bool:
    """Whether RLIMIT_AS (``ulimit -v``) caps this process: the region would
    take its size out of that limit, for the zygote and every worker.
    (Read from /proc: the ``resource`` module would add an extension module
    to every worker's address space.)"""
    try:
        with open("/proc/self/limits") as f:
            for line in f:
                if line.startswith("Max address space"):
                    return line.split()[3] != "unlimited"
    except OSError:
        pass
    return False


def pymalloc_in_use() -> bool:
    """Whether Python's object allocator takes arenas at all: not with
    PYTHONMALLOC=malloc (or mimalloc, or their _debug forms), nor in a
    free-threaded build (mimalloc throughout)."""
    import sys

    if "t" in getattr(sys, "abiflags", ""):
        return False
    chosen = os.environ.get("PYTHONMALLOC", "").strip()
    return not chosen.startswith(("malloc", "mimalloc"))


def place_arenas() -> bool:
    """Route this process's new object arenas into one aligned region
    (csrc/arena.c), where huge pages are wanted, pymalloc is in use and the
    address space is not capped.  Call it while the process has a single
    thread.  False where it was not done; nothing else changes then."""
    if not wanted() or not pymalloc_in_use() or address_space_limited():
        return False
    from fastspawn._os._core import lib

    return bool(lib.fs_arena_place(ARENA_REGION) == 0)


def arena_region() -> tuple[int, int, int]:
    """(start, size, bytes handed out at least once) of this process's arena
    region, inherited by forked children; all 0 where there is none."""
    from fastspawn._os._core import ffi, lib

    base = ffi.new("uintptr_t *")
    size = ffi.new("size_t *")
    used = ffi.new("size_t *")
    lib.fs_arena_region(base, size, used)
    return int(base[0]), int(size[0]), int(used[0])


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/smaps_rollup (``Anonymous``,
    ``AnonHugePages``, ...): how much of a process is in huge pages."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}


def collapsible_ranges() -> list[int]:
    """Start addresses of the 2 MiB-aligned stretches of private anonymous
    memory (the malloc heap, the arena region, other arenas)."""
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    starts: list[int] = []
    for line in lines:
        fields = line.split()
        # Private and writable, and either unnamed or the brk heap: not
        # files, not shared memory, not the stack.
        if fields[1][:2] != "rw" or fields[1][3] != "p":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        first = -(-low // HUGE_PAGE) * HUGE_PAGE
        starts.extend(range(first, high - HUGE_PAGE + 1, HUGE_PAGE))
    return starts


def collapse(address: int) -> bool:
    """Collapse one stretch into a huge page; False where it cannot be (no
    page there yet, no huge page to be had now): it stays as it is."""
    from fastspawn._os import oscall

    try:
        oscall.collapse_hugepages(address, HUGE_PAGE)
    except OSError:
        return False
    return True
