"""Ranks that share an output keep every line whole, and each line shows as
soon as it is printed, with ``PYTHONUNBUFFERED=1`` (as many container
images set) and the output a pipe: every start method, and ``fastspawn
run``'s Python ranks (in the zygote, and exec'd with ``--exec``).

Unbuffered, Python writes a line and its newline in two write() calls, and
ranks writing to one pipe cut their lines into one another there."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

LINES = 400
RANKS = 4
# A line of its own length per rank and line, so that any cut shows.
LINE = re.compile(r"(out|err) rank (\d) line (\d+) (x+)")

# The ranks start printing together (each waits for the others' files),
# so that their lines meet in the pipe whatever their start-up times.
PRINTER = """
import os, sys, time

def print_lines(rank):
    folder = os.environ["LINES_DIR"]
    open(os.path.join(folder, f"started.{{rank}}"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(
        [name for name in os.listdir(folder) if name.startswith("started.")]
    ) < {ranks}:
        time.sleep(0.001)
    for i in range({lines}):
        print(f"out rank {{rank}} line {{i}} " + "x" * (20 + i % 50))
        print(f"err rank {{rank}} line {{i}} " + "x" * (20 + i % 50), file=sys.stderr)
"""

LAUNCHER = (
    PRINTER
    + """
import fastspawn

if __name__ == "__main__":
    fastspawn.start_processes(print_lines, nprocs={ranks}, start_method=sys.argv[1])
"""
)

RUN_PROGRAM = (
    PRINTER
    + """
import os

print_lines(int(os.environ["LOCAL_RANK"]))
"""
)

# Each rank prints a line, then waits until the test has read every rank's
# line (the file appears): a line held in a buffer would never come.
WAITER = """
import os, sys, time

def wait(rank, release):
    print(f"ready {{rank}}")
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
"""

WAIT_LAUNCHER = (
    WAITER
    + """
import fastspawn

if __name__ == "__main__":
    fastspawn.start_processes(wait, (sys.argv[2],), nprocs={ranks}, start_method=sys.argv[1])
"""
)

WAIT_PROGRAM = (
    WAITER
    + """
wait(os.environ["LOCAL_RANK"], sys.argv[1])
"""
)


def _env(folder: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if folder is not None:
        env["LINES_DIR"] = str(folder)
    return env


def _check_whole(stdout: str, stderr: str) -> None:
    for stream, text in (("out", stdout), ("err", stderr)):
        lines = [line for line in text.splitlines() if line.startswith(f"{stream} rank ")]
        cut = []
        for line in lines:
            m = LINE.fullmatch(line)
            if not m or m.group(1) != stream or len(m.group(4)) != 20 + int(m.group(3)) % 50:
                cut.append(line)
        assert cut == [], f"{len(cut)} of {len(lines)} {stream} lines cut: {cut[:5]}"
        seen = {(m.group(2), m.group(3)) for line in lines if (m := LINE.fullmatch(line))}
        assert len(seen) == RANKS * LINES, f"{stream}: {len(seen)} whole lines of {RANKS * LINES}"
        assert text.count("\n") >= RANKS * LINES  # no line glued to another


def _lines_come_while_ranks_wait(command: list[str], release: Path, cwd: Path) -> None:
    """Run ``command``; read a "ready" line from every rank while they wait,
    then let them go."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=cwd
    )
    try:
        assert proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + 90
        while seen.count(b"ready") < RANKS and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
        ready = sorted(line for line in seen.decode().splitlines() if line.startswith("ready"))
        assert ready == [f"ready {rank}" for rank in range(RANKS)], seen
    finally:
        release.touch()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()


@pytest.fixture(params=["zygote", "spawn", "fork", "forkserver"])
def method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_line_whole_under_unbuffered(tmp_path, method):
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(LAUNCHER.format(lines=LINES, ranks=RANKS)))
    done = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    _check_whole(done.stdout, done.stderr)


def test_a_line_shows_as_soon_as_it_is_printed(tmp_path, method):
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(WAIT_LAUNCHER.format(ranks=RANKS)))
    release = tmp_path / "release"
    _lines_come_while_ranks_wait(
        [sys.executable, str(script), method, str(release)], release, tmp_path
    )


@pytest.fixture(params=[[], ["--exec"]], ids=["zygote", "exec"])
def run_mode(request: pytest.FixtureRequest) -> list[str]:
    return list(request.param)


def test_fastspawn_run_ranks_keep_every_line_whole(tmp_path, run_mode):
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(RUN_PROGRAM.format(lines=LINES, ranks=RANKS)))
    done = subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", "--nproc-per-node", str(RANKS),
         *run_mode, str(program)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**_env(tmp_path), "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    _check_whole(done.stdout, done.stderr)


def test_fastspawn_run_lines_show_as_soon_as_printed(tmp_path, run_mode):
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(WAIT_PROGRAM.format()))
    release = tmp_path / "release"
    command = [sys.executable, "-m", "fastspawn", "run", "--nproc-per-node", str(RANKS),
               *run_mode, str(program), str(release)]  # fmt: skip
    _lines_come_while_ranks_wait(command, release, tmp_path)
