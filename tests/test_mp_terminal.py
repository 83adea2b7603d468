"""fastspawn's contexts under a terminal's foreground job: the processes
stay in the caller's process group, as multiprocessing's do, so a Ctrl-C
reaches them (a process it did not stop would be waited for at exit), and
SIGKILL of the caller still leaves none of them, nor their children."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import KILL_BOUND_S, alive_after

# CI runs these on one Python version (.ci/run): the 30-minute budget.
pytestmark = pytest.mark.version_neutral

METHODS = ["fastspawn", "fastspawn-fork", "fastspawn-spawn", "fastspawn-forkserver"]

# The caller: one Process, which starts a sleep and records
# "its pid, the sleep's pid, its process group", then waits.
DRIVER = """
import os, subprocess, sys, time
import fastspawn

def work(path):
    child = subprocess.Popen(["sleep", "600"])
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.getpgrp()}")
    os.rename(path + ".tmp", path)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        open(path + ".interrupted", "w").close()
        raise

if __name__ == "__main__":
    ctx = fastspawn.get_context(sys.argv[1])
    process = ctx.Process(target=work, args=(sys.argv[2],))
    process.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("ready", os.getpid(), os.getpgrp(), flush=True)
    process.join()
"""

# Runs the driver as the foreground job of a new terminal, then presses
# Ctrl-C there (or SIGKILLs the driver); prints the driver's pid and group
# and how it ended.
TERMINAL = """
import os, pty, re, select, signal, sys, time

driver, method, record, action = sys.argv[1:5]
pid, master = pty.fork()  # the child leads a session on a new terminal
if pid == 0:
    os.execv(sys.executable, [sys.executable, driver, method, record])
out = b""
deadline = time.monotonic() + 120
while not re.search(rb"ready \\d+ \\d+\\s", out) and time.monotonic() < deadline:
    if select.select([master], [], [], 1)[0]:
        try:
            out += os.read(master, 4096)
        except OSError:
            break
line = next((l for l in out.decode().splitlines() if l.startswith("ready")), "none")
if action == "ctrl-c":
    os.write(master, b"\\x03")
else:
    os.kill(pid, signal.SIGKILL)
ended = None
deadline = time.monotonic() + 60
while ended is None and time.monotonic() < deadline:
    if select.select([master], [], [], 0.2)[0]:
        try:
            os.read(master, 4096)
        except OSError:
            pass
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        ended = status
if ended is None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
os.close(master)
print(line, "ended" if ended is not None else "still running", flush=True)
"""


def _run(tmp_path: Path, method: str, action: str) -> tuple[list[str], list[int]]:
    """(the terminal's report, the worker's pid, its sleep's pid, its group)."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    record = tmp_path / "worker"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TERMINAL), str(driver), method, str(record), action],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert record.exists(), f"the worker never started: {done.stdout}{done.stderr}"
    return done.stdout.split(), [int(word) for word in record.read_text().split()]


@pytest.mark.parametrize("method", METHODS)
def test_ctrl_c_on_a_terminal_reaches_the_processes(tmp_path, method):
    report, (worker, child, group) = _run(tmp_path, method, "ctrl-c")
    assert report[0] == "ready", report
    caller_group = int(report[2])
    assert group == caller_group, "the process is not in its caller's process group"
    assert (tmp_path / "worker.interrupted").exists(), "Ctrl-C did not reach the process"
    assert report[-1] == "ended", "the caller did not end after Ctrl-C"
    assert alive_after([worker, child]) == []


@pytest.mark.parametrize("method", METHODS)
def test_sigkill_of_a_foreground_caller_leaves_no_process(tmp_path, method):
    report, (worker, child, _group) = _run(tmp_path, method, "kill")
    assert report[0] == "ready", report
    alive = alive_after([worker, child])
    assert alive == [], (
        f"alive {KILL_BOUND_S:g} s after SIGKILL of a foreground caller ({method}): {alive}"
    )
