"""Functions, lambdas and classes defined in notebook cells, run in a real
Jupyter kernel (ipykernel, driven by nbclient) under every start method:
return values, a redefinition taking effect, the ranks' output in the cell
while they run, a failed rank's traceback, an unpicklable global named
before anything starts, and a kernel interrupt during a join.

Each notebook runs in notebook_driver.py, a process of its own, with the
Jupyter and IPython directories (connection files, runtime dirs, history)
and TMPDIR in a folder the test removes; the kernel's last cell lists its
descendants (the zygote, its guard, the warden), which must all be gone
once the driver has shut the kernel down.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import gone

pytest.importorskip("ipykernel")
pytest.importorskip("nbclient")

from fastspawn._launch.methods import registry  # noqa: E402

DRIVER = Path(__file__).with_name("notebook_driver.py")
METHODS = registry.names()

# The kernel's own descendants, printed by the cell run_notebook appends.
_DESCENDANTS = """
import json, psutil
print("descendants:", json.dumps([p.pid for p in psutil.Process().children(recursive=True)]))
"""


def run_notebook(
    tmp_path: Path,
    cells: list[str],
    triggers: dict[int, list[dict[str, Any]]] | None = None,
    timeout: float = 120,
) -> list[list[dict[str, Any]]]:
    """Run ``cells`` (dedented) in a fresh kernel; their outputs, in order.
    Every process the kernel started is gone when this returns."""
    home = tmp_path / "jupyter"
    work = tmp_path / "work"
    for folder in ("runtime", "data", "config", "ipython", "tmp"):
        (home / folder).mkdir(parents=True)
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JUPYTER"))}
    env.update(
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_PLATFORM_DIRS="1",
        IPYTHONDIR=str(home / "ipython"),
        TMPDIR=str(home / "tmp"),
    )
    spec = {
        "cells": [textwrap.dedent(cell) for cell in cells] + [_DESCENDANTS],
        "timeout": timeout,
        "cwd": str(work),
        "triggers": {str(index): found for index, found in (triggers or {}).items()},
    }
    spec_path, result_path = home / "spec.json", home / "result.json"
    spec_path.write_text(json.dumps(spec))
    try:
        done = subprocess.run(
            [sys.executable, str(DRIVER), str(spec_path), str(result_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout * (len(cells) + 1) + 120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs: list[list[dict[str, Any]]] = json.loads(result_path.read_text())
    finally:
        shutil.rmtree(home, ignore_errors=True)
    descendants = json.loads(stdout(outputs[-1]).split("descendants:")[1])
    assert wait_gone(descendants) == [], "the kernel's processes outlived it"
    return outputs[:-1]


def wait_gone(pids: list[int], patience: float = 30.0) -> list[int]:
    """The ``pids`` still running after up to ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while (left := [pid for pid in pids if not gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stdout(outputs: list[dict[str, Any]], name: str = "stdout") -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == name)


def error(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert len(errors) == 1, outputs
    return errors[0]


def no_error(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert not [o for o in outputs if o["output_type"] == "error"], outputs
    return outputs


DEFINITIONS = """
import fastspawn

SCALE = 10

def work(rank, x):
    return rank * x * SCALE

square = lambda rank: rank * rank

def make_adder(n):
    def add(rank):
        return rank + n
    return add

class Point:
    def __init__(self, x):
        self.x = x

    def moved(self, d):
        return Point(self.x + d)

def move(rank, p):
    return p.moved(rank)
"""

EVERY_KIND = """
m = {method!r}
values = [
    fastspawn.start_processes(work, args=(3,), nprocs=2, start_method=m).return_values,
    fastspawn.start_processes(square, nprocs=3, start_method=m).return_values,
    fastspawn.start_processes(make_adder(100), nprocs=2, start_method=m).return_values,
]
points = fastspawn.start_processes(move, args=(Point(5),), nprocs=2, start_method=m).return_values
values.append({{rank: (type(p) is Point, p.x) for rank, p in points.items()}})
print(repr(values))
"""


def test_functions_lambdas_closures_and_classes_of_cells_run_under_every_method(tmp_path):
    cells = [DEFINITIONS] + [EVERY_KIND.format(method=m) for m in METHODS]
    cells.append("print(repr(fastspawn.spawn(work, args=(2,), nprocs=2).return_values))")
    outputs = run_notebook(tmp_path, cells)
    expected = [{0: 0, 1: 30}, {0: 0, 1: 1, 2: 4}, {0: 100, 1: 101}, {0: (True, 5), 1: (True, 6)}]
    for method, cell in zip(METHODS, outputs[1:], strict=False):
        assert stdout(no_error(cell)).strip() == repr(expected), method
    assert stdout(no_error(outputs[-1])).strip() == repr({0: 0, 1: 20})


def test_a_redefined_function_class_or_global_takes_effect(tmp_path):
    launch_all = f"""
    print(repr([
        (fastspawn.start_processes(work, nprocs=1, start_method=m).return_values[0],
         fastspawn.start_processes(tagged, nprocs=1, start_method=m).return_values[0])
        for m in {METHODS!r}
    ]))
    """
    first = """
    import fastspawn
    LABEL = "old global"
    def work(rank):
        return "old function, " + LABEL
    class Box:
        tag = "old class"
    def tagged(rank):
        return Box.tag
    """
    outputs = run_notebook(
        tmp_path,
        [
            first,
            launch_all,
            'def work(rank):\n    return "new function, " + LABEL',
            launch_all,
            'class Box:\n    tag = "new class"\nLABEL = "new global"',
            launch_all,
        ],
    )
    runs = [stdout(no_error(outputs[i])).strip() for i in (1, 3, 5)]
    n = len(METHODS)
    assert runs[0] == repr([("old function, old global", "old class")] * n)
    assert runs[1] == repr([("new function, old global", "old class")] * n)
    assert runs[2] == repr([("new function, new global", "new class")] * n)


CHATTY = """
import os, time
import fastspawn

def chatty(rank, method, go):
    for line in range(3):
        print(f"{method} rank {rank} line {line}")
    print(f"{method} rank {rank} waiting")
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"{method} rank {rank} done")
    return os.path.exists(go)

def fails(rank):
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    return rank
"""


def test_rank_output_reaches_the_cell_while_they_run_and_a_traceback_the_error(tmp_path):
    # No flush in the workers: what they print must reach the cell before
    # they exit, for each rank waits until the driver has seen it waiting.
    cells = [CHATTY]
    triggers = {}
    for method in METHODS:
        go = tmp_path / f"go-{method}"
        triggers[len(cells)] = [
            {
                "when": [f"{method} rank {r} waiting" for r in range(2)],
                "then": "touch",
                "path": str(go),
            }
        ]
        cells.append(
            f"print(repr(fastspawn.start_processes(chatty, args=({method!r}, {str(go)!r}), "
            f"nprocs=2, start_method={method!r}).return_values))"
        )
        cells.append(f"fastspawn.start_processes(fails, nprocs=2, start_method={method!r})")
    outputs = run_notebook(tmp_path, cells, triggers)
    for index, method in enumerate(METHODS):
        chatter, failure = outputs[1 + 2 * index], outputs[2 + 2 * index]
        printed = stdout(no_error(chatter))
        assert printed.rstrip().endswith(repr({0: True, 1: True})), (method, printed)
        for rank in range(2):
            expected = [f"{method} rank {rank} line {i}" for i in range(3)]
            expected += [f"{method} rank {rank} waiting", f"{method} rank {rank} done"]
            if registry.get(method).pickles_arguments:
                # Line-buffered, onto the pipe the kernel reads: whole lines.
                lines = [line for line in printed.splitlines() if f" rank {rank} " in line]
            else:
                # A "fork" worker prints through the kernel's own stream
                # object, which ipykernel forwards write by write from a
                # forked process: ranks' lines may be cut into one another,
                # and one rank's own lines have come out of order (CI,
                # Python 3.10, ipykernel 7.3.0: "line 2" before "line 1"
                # under load). Each must arrive; "done" comes after
                # "waiting" reached the cell whatever ipykernel does, for
                # the rank waits until the driver has seen it.
                found = re.findall(rf"{method} rank {rank} (?:line \d|waiting|done)", printed)
                assert found.index(expected[-2]) < found.index(expected[-1]), (method, printed)
                lines = sorted(found, key=expected.index)
            assert lines == expected, (method, printed)
        shown = error(failure)
        assert shown["ename"] == "ProcessRaisedException", method
        assert "Process 1 terminated with the following error" in shown["evalue"], method
        assert "Traceback (most recent call last)" in shown["evalue"], method
        assert "ValueError: boom from rank 1" in shown["evalue"], method


def test_an_unpicklable_global_is_named_before_anything_starts(tmp_path):
    cells = [
        """
        import threading, psutil
        import fastspawn
        lock = threading.Lock()
        def locked(rank):
            with lock:
                return rank
        """
    ]
    pickling = [m for m in METHODS if registry.get(m).pickles_arguments]
    for method in pickling:
        cells.append(
            f"try:\n"
            f"    fastspawn.start_processes(locked, nprocs=2, start_method={method!r})\n"
            f"finally:\n"
            f"    print('children:', psutil.Process().children())"
        )
    outputs = run_notebook(tmp_path, cells)
    for method, cell in zip(pickling, outputs[1:], strict=True):
        shown = error(cell)
        assert shown["ename"] == "PicklingError", method
        assert "global 'lock' of locked()" in shown["evalue"], method
        assert "start_method='fork'" in shown["evalue"], method
        assert stdout(cell).strip() == "children: []", method  # not even a zygote


def test_the_example_notebook_runs(tmp_path):
    example = Path(__file__).parent.parent / "examples" / "notebook.ipynb"
    notebook = json.loads(example.read_text())
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    outputs = run_notebook(tmp_path, cells)
    for cell in outputs:
        no_error(cell)
    launched = stdout(outputs[1])  # the cell after the definitions
    assert "rank 3: pid" in launched and launched.rstrip().endswith("True"), launched


SLEEPER = """
import os, time
import fastspawn

def sleeper(rank, folder):
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    print(f"{os.path.basename(folder)} rank {rank} started")
    time.sleep(300)

def still_running(folder, patience=30.0):
    pids = [int(open(os.path.join(folder, name)).read()) for name in os.listdir(folder)]
    deadline = time.monotonic() + patience
    while True:
        left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if not left or time.monotonic() > deadline:
            return len(pids), left
        time.sleep(0.05)
"""


def test_interrupting_the_kernel_during_a_join_stops_every_worker(tmp_path):
    cells = [SLEEPER]
    triggers = {}
    folders = {}
    for method in METHODS:
        folders[method] = folder = tmp_path / f"pids-{method}"
        folder.mkdir()
        triggers[len(cells)] = [
            {"when": [f"pids-{method} rank {r} started" for r in range(3)], "then": "interrupt"}
        ]
        cells.append(
            f"fastspawn.start_processes(sleeper, args=({str(folder)!r},), nprocs=3, "
            f"start_method={method!r})"
        )
        # Checked from the kernel, before its shutdown could end them:
        # gone, not even a zombie of the kernel's.
        cells.append(f"print(repr(still_running({str(folder)!r})))")
    cells.append(
        "print(repr([fastspawn.start_processes(lambda rank: rank, nprocs=2, start_method=m)"
        f".return_values for m in {METHODS!r}]))"
    )
    outputs = run_notebook(tmp_path, cells, triggers)
    for index, method in enumerate(METHODS):
        interrupted, check = outputs[1 + 2 * index], outputs[2 + 2 * index]
        assert error(interrupted)["ename"] == "KeyboardInterrupt", (method, interrupted)
        assert stdout(no_error(check)).strip() == repr((3, [])), method
        pids = [int(p.read_text()) for p in folders[method].iterdir()]
        assert wait_gone(pids, 1.0) == [], method
    assert stdout(no_error(outputs[-1])).strip() == repr([{0: 0, 1: 1}] * len(METHODS))
