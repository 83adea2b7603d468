"""A process's children as the kernel lists them, and killing them all.

Shared by the zygote (which kills the orphans it adopts as a subreaper), its
guard, and the caller's handle on the zygote (which finds the zygote proper
as its guard's only child).
"""

from __future__ import annotations

import os
import signal


def children_of(pid: int) -> set[int]:
    """The direct children of ``pid`` (/proc/PID/task/TID/children)."""
    children: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.update(int(c) for c in f.read().split())
        return children
    except FileNotFoundError:
        pass  # kernel without CONFIG_PROC_CHILDREN: scan every process
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.add(int(name))
    return children


def kill_children(me: int) -> None:
    """SIGKILL and reap this process's children, ``me`` being its pid, until
    none is left: as a subreaper it adopts the orphans of those it kills,
    daemons included, and kills them in the next round."""
    while True:
        try:
            children = children_of(me)
        except OSError:
            children = set()  # out of fds: reaping below frees some for the next round
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
