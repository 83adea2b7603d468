"""Functions defined in a __main__ that has no file the workers could import
(``python -c``, a script read from stdin, the interactive prompt) run under
every start method: they travel by value (fastspawn/by_value.py), and an
ordinary script's launches never load cloudpickle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
from helpers import run_script

from fastspawn._launch.methods import registry
from fastspawn._wire import by_value, pickling

# Written for the interactive prompt too: a blank line ends each block,
# none inside one.  The start method comes in FASTSPAWN_TEST_METHOD.
PROGRAM = textwrap.dedent(
    """\
    import os, sys, threading
    import fastspawn
    method = os.environ["FASTSPAWN_TEST_METHOD"]
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

    def run(fn, *args, nprocs=2):
        ctx = fastspawn.start_processes(fn, args=args, nprocs=nprocs, start_method=method)
        return ctx.return_values

    values = [run(work, 3), run(square, nprocs=3), run(make_adder(100))]
    points = run(move, Point(5))
    values.append({rank: (type(p) is Point, p.x) for rank, p in points.items()})
    print("values:", repr(values))
    """
)
EXPECTED = repr([{0: 0, 1: 30}, {0: 0, 1: 1, 2: 4}, {0: 100, 1: 101}, {0: (True, 5), 1: (True, 6)}])

# How the program reaches the interpreter: its command, and its stdin.
WAYS = {
    "python -c": ([sys.executable, "-c", PROGRAM], None),
    "stdin": ([sys.executable, "-"], PROGRAM),
    "interactive prompt": ([sys.executable, "-i", "-q"], PROGRAM + "\n"),
}


def run_program(
    command: list[str], stdin: str | None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("way", list(WAYS))
def test_functions_lambdas_closures_and_classes_run_under_every_method(way, start_method):
    command, stdin = WAYS[way]
    done = run_program(command, stdin, FASTSPAWN_TEST_METHOD=start_method)
    assert f"values: {EXPECTED}" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


CARRIES_FDS = """\
import os, multiprocessing
import fastspawn
reader, writer = multiprocessing.Pipe(duplex=False)
def send(rank, conn):
    conn.send(rank * 10)
method = os.environ["FASTSPAWN_TEST_METHOD"]
fastspawn.start_processes(send, args=(writer,), nprocs=2, start_method=method)
print("received:", sorted(reader.recv() for _ in range(2)))
"""


def test_connections_still_carry_their_fds(start_method):
    # multiprocessing's reducers (fds passed to the workers) apply in the
    # by-value pickler too.
    done = run_program(
        [sys.executable, "-c", CARRIES_FDS], None, FASTSPAWN_TEST_METHOD=start_method
    )
    assert done.stdout.strip() == "received: [0, 10]", done.stdout + done.stderr


UNPICKLABLE = """\
import os, threading, psutil
import fastspawn
from fastspawn._zygote import client
lock = threading.Lock()
def locked(rank):
    with lock:
        return rank
try:
    fastspawn.start_processes(locked, nprocs=2, start_method=os.environ["FASTSPAWN_TEST_METHOD"])
except Exception as exc:
    print(type(exc).__name__, exc)
print("children:", psutil.Process().children(), client.zygote_pid())
"""


@pytest.mark.parametrize(
    "start_method", [m for m in registry.names() if registry.get(m).pickles_arguments]
)
def test_an_unpicklable_global_is_named_before_anything_starts(start_method):
    done = run_program(
        [sys.executable, "-c", UNPICKLABLE], None, FASTSPAWN_TEST_METHOD=start_method
    )
    assert done.returncode == 0, done.stderr
    first, children = done.stdout.splitlines()
    assert first.startswith("PicklingError fn (function "), first
    assert "it refers to global 'lock' of locked(), a lock" in first
    assert "TypeError: cannot pickle '_thread.lock' object" in first
    assert "start_method='fork'" in first
    assert children == "children: [] None"  # no worker, not even a zygote


def test_an_ordinary_script_never_loads_cloudpickle(tmp_path, start_method):
    done = run_script(
        tmp_path / "script.py",
        f"""
        import sys
        import fastspawn

        def loaded(rank):
            return "cloudpickle" in sys.modules

        if __name__ == "__main__":
            ctx = fastspawn.start_processes(loaded, nprocs=2, start_method={start_method!r})
            print(ctx.return_values, "cloudpickle" in sys.modules)
        """,
    )
    assert done.stdout.strip() == "{0: False, 1: False} False", done.stderr


def _as_if_in_main(fn: types.FunctionType) -> types.FunctionType:
    fn.__module__ = "__main__"
    return fn


@pytest.fixture
def main_without_file(monkeypatch):
    monkeypatch.setattr(pickling, "main_is_importable", lambda: False)


def _described(fn: object, *args: object) -> str:
    problem = pickling.describe_unpicklable(fn, args, "zygote")
    assert problem is not None
    return problem


def test_the_error_names_a_closure_variable_a_default_and_an_attribute(main_without_file):
    import threading

    lock = threading.Lock()

    def closes(rank):
        return lock

    assert "it refers to variable 'lock' that " in _described(_as_if_in_main(closes))

    def defaults(rank, guard=lock):
        return guard

    assert "it refers to a default argument of " in _described(_as_if_in_main(defaults))

    holder = type("Holder", (), {"__module__": "__main__"})()
    holder.guard = lock
    problem = _described(_as_if_in_main(lambda rank, h: h), holder)
    assert problem.startswith("args[0] (Holder ")
    assert "it refers to attribute 'guard' of a Holder, a lock" in problem


def test_a_function_pickles_by_value_only_where_main_has_no_file(main_without_file):
    def local(rank):
        return rank

    # A nested function of an importable module: by value here, where it
    # used to be an error; the same function named in its module: by name.
    assert by_value._by_value(local)
    assert not by_value._by_value(pickling.dumps)
    assert pickling.describe_unpicklable(local, (), "zygote") is None
