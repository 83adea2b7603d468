"""Small helpers shared by the test modules (not worker functions)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil


def gone(pid: int) -> bool:
    """True once ``pid`` has exited: no such process, or a zombie (an
    orphaned one is reaped by whoever adopted it, not by us)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_asleep(pid: int, timeout: float) -> None:
    """Wait, ``timeout`` seconds at most, until ``pid``'s main thread sleeps
    in nanosleep (``time.sleep``) or ``pid`` is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return
        except OSError:
            return  # gone
        time.sleep(0.01)


def kill_driver(driver: subprocess.Popen[str]) -> None:
    """SIGKILL a driver process of ours, reap it, close its stdout pipe."""
    driver.kill()
    driver.wait(timeout=30)
    if driver.stdout is not None:
        driver.stdout.close()


# How long a kill chain (pidfd, PR_SET_PDEATHSIG, a warden's or zygote's
# killpg: none waits on a timer) gets before a test calls what it missed
# left behind.  Beyond any scheduling delay: CI runs two test passes at
# once on 2 cores, and a chain once took over 1 s there.
KILL_BOUND_S = 5.0


def alive_after(pids: list[int]) -> list[str]:
    """The ``pids`` still alive once all are gone or KILL_BOUND_S passed,
    each as "pid (name, status)"; [] as soon as none is."""
    deadline = time.monotonic() + KILL_BOUND_S
    while True:
        alive = [pid for pid in pids if not gone(pid)]
        if not alive or time.monotonic() > deadline:
            return [_describe(pid) for pid in alive]
        time.sleep(0.02)


def _describe(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        return f"{pid} ({process.name()}, {process.status()})"
    except psutil.Error:
        return f"{pid} (gone since)"


def run_script(
    path: Path, code: str, command: list[str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Write ``code`` (dedented) to ``path`` and run it with this Python
    (or ``command``), output captured as text, within 120 s."""
    path.write_text(textwrap.dedent(code))
    return subprocess.run(
        command or [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def fake_sysfs(
    root: Path,
    nodes: dict[int, set[int]],
    sockets: dict[int, int],
    cores: dict[int, set[int]],
    last_caches: dict[int, set[int]],
) -> Path:
    """A sysfs tree under ``root`` with the NUMA nodes' CPUs, each CPU's
    socket, hyperthread siblings and last-level (L3) cache sharers (and an
    L1 instruction cache, which binding must skip); returns ``root``."""

    def cpu_list(cpus: set[int]) -> str:
        return ",".join(str(cpu) for cpu in sorted(cpus)) + "\n"

    def write(path: str, text: str) -> None:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    write("devices/system/node/possible", cpu_list(set(nodes)))
    for node, cpus in nodes.items():
        write(f"devices/system/node/node{node}/cpulist", cpu_list(cpus))
    for cpu, socket in sockets.items():
        base = f"devices/system/cpu/cpu{cpu}"
        write(f"{base}/topology/physical_package_id", f"{socket}\n")
        write(f"{base}/topology/thread_siblings_list", cpu_list(cores[cpu]))
        caches = [("Data", 1, {cpu}), ("Instruction", 1, {cpu}), ("Unified", 2, cores[cpu])]
        caches.append(("Unified", 3, last_caches[cpu]))
        for index, (kind, level, sharers) in enumerate(caches):
            write(f"{base}/cache/index{index}/type", f"{kind}\n")
            write(f"{base}/cache/index{index}/level", f"{level}\n")
            write(f"{base}/cache/index{index}/shared_cpu_list", cpu_list(sharers))
    return root


def twelve_cpus(root: Path) -> Path:
    """Three NUMA nodes of 4 CPUs (0-3, 4-7 on socket 0; 8-11 on socket 1),
    hyperthread pairs, last-level caches {0,1,2}, {3}, {4-7}, {8-11}."""
    nodes = {0: set(range(4)), 1: set(range(4, 8)), 2: set(range(8, 12))}
    cores = {cpu: {cpu - cpu % 2, cpu - cpu % 2 + 1} for cpu in range(12)}
    caches = {0: {0, 1, 2}, 1: {0, 1, 2}, 2: {0, 1, 2}, 3: {3}}
    caches.update({cpu: set(range(4, 8)) for cpu in range(4, 8)})
    caches.update({cpu: set(range(8, 12)) for cpu in range(8, 12)})
    sockets = {cpu: 0 if cpu < 8 else 1 for cpu in range(12)}
    return fake_sysfs(root, nodes, sockets, cores, caches)


# GPU index -> NUMA node in twelve_cpus: two GPUs on node 0, one on each other.
TWELVE_CPUS_GPUS = {0: 0, 1: 0, 2: 1, 3: 2}
