"""fastspawn bench: options, limits, the JSON schema, the outputs, Ctrl-C."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import py_compile
import resource
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest

import fastspawn
from fastspawn._bench import common, cputime, host, main
from fastspawn._bench import floor as bench_floor
from fastspawn._bench import methods as bench_methods
from fastspawn._bench import options as bench_options
from fastspawn._bench import progress as bench_progress
from fastspawn._bench import ranks as bench_ranks
from fastspawn._bench import rounds as bench_rounds
from fastspawn._bench import session as bench_session
from fastspawn._bench import summary as bench_summary

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

# Cheap methods for the CLI runs: no torch, nothing that needs a cold start.
CHEAP = [
    "fastspawn-zygote-warm",
    "fastspawn-fork",
    "mp-spawn",
    "mp-fork",
    "binary-fastspawn",
    "binary-popen",
]
PYTHON_CHEAP = [m for m in CHEAP if not m.startswith("binary-")]
# Tables per nprocs with a row for each Python method: start, end, and the
# CPU time's where the kernel shows it.
TABLES = 3 if cputime.available() else 2


def bench(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastspawn", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def descendants_while_running(
    proc: subprocess.Popen[str], until: Callable[[dict[int, psutil.Process]], bool]
) -> dict[int, psutil.Process]:
    """Every descendant of ``proc`` seen, sampled until ``until(seen)`` (30 s at most)."""
    bench_proc = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    start = time.monotonic()
    while time.monotonic() - start < 30 and not until(seen):
        if proc.poll() is not None:
            break
        try:
            for child in bench_proc.children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    return seen


def bench_watched(
    *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str, dict[int, psutil.Process]]:
    """A bench run to its end, with every descendant seen while it ran:
    (exit status, stdout, stderr, descendants)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastspawn", "bench", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        seen = descendants_while_running(proc, lambda seen: False)  # until it exits
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, seen


def still_running(seen: dict[int, psutil.Process], patience: float = 10) -> list[int]:
    """The pids of ``seen`` still alive (not zombies) after ``patience`` seconds."""

    def left() -> list[int]:
        alive = []
        for pid, child in seen.items():
            try:
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    deadline = time.monotonic() + patience
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    return left()


def shadowing(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment in which ``import module`` fails, as if not installed."""
    package = tmp_path / "shadow" / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError('no {module} in this test')\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}


# ---------------------------------------------------------- JSON schema

SCHEMA = main.load_schema()


def validate(value: Any, schema: dict[str, Any] = SCHEMA) -> list[str]:
    """What is wrong with ``value`` against ``schema``, one line each."""
    validator = jsonschema.Draft202012Validator(schema)
    return [
        f"$/{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(value)
    ]


def test_the_shipped_schema_is_valid_and_matches_the_code():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    props = SCHEMA["properties"]
    assert props["schema"]["enum"] == [common.SCHEMA_ID]
    for part in ("rounds", "summary"):
        assert props[part]["items"]["properties"]["method"]["enum"] == list(common.ALL_METHODS)
    assert props["config"]["properties"]["methods"]["items"]["enum"] == list(common.ALL_METHODS)
    assert props["summary"]["items"]["properties"]["phase"]["enum"] == list(bench_rounds.PHASES)
    record = bench_rounds.new_record("mp-fork", 2, 0, "launch")
    # Every field a round has, the CPU time's optional: documents written
    # before it lack them.
    assert set(props["rounds"]["items"]["properties"]) == set(record)
    assert set(props["rounds"]["items"]["required"]) == set(record) - set(cputime.FIELDS)


def test_the_schema_rejects_what_it_should():
    schema = SCHEMA["properties"]["rounds"]["items"]
    good = bench_rounds.new_record("mp-fork", 2, 0, "launch")
    assert validate(good, schema) == []
    assert validate({**good, "method": "mp-vfork"}, schema)
    assert validate({**good, "nprocs": 0}, schema)
    assert validate({**good, "running_s": "fast"}, schema)
    assert validate({**good, "extra": 1}, schema)
    assert validate({k: v for k, v in good.items() if k != "kind"}, schema)
    assert validate({**good, "rank_entry_s": [0.1, None]}, schema)


# ----------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], str]:
    """One tiny sweep shared by the table and JSON tests: (stdout, document, stderr)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = bench(
        "--methods", ",".join(CHEAP), "--nprocs", "1,2", "--repeat", "1", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(out.read_text()), done.stderr


def test_the_run_says_what_it_measures_and_how_long_before_it_starts(tiny_sweep):
    _, _, err = tiny_sweep
    lines = err.splitlines()
    assert lines[0].startswith(
        f"fastspawn bench: {len(CHEAP)} method(s) at nprocs 1,2, 1 round(s) each"
    )
    # Python methods: a launch and a failure round per nprocs; binaries: a launch.
    rounds = 2 * (2 * len(PYTHON_CHEAP) + 2)
    estimate = next(line for line in lines if "rounds to measure" in line)
    assert estimate.startswith(f"fastspawn bench: {rounds} rounds to measure: about ")
    assert estimate.endswith(" s") or estimate.endswith(" min")


def test_table_has_every_method_and_the_ratio_column(tiny_sweep):
    table, _, _ = tiny_sweep
    for method in CHEAP:
        assert method in table
    assert "nprocs=1" in table and "nprocs=2" in table
    start = next(line for line in table.splitlines() if line.startswith("nprocs=1 start "))
    for title in ("created", "all running", "vs mp-spawn"):
        assert title in start
    end = next(line for line in table.splitlines() if line.startswith("nprocs=1 end "))
    for title in ("exit->joined", "failure->reaped", "USS MiB"):
        assert title in end
    cpu = [line for line in table.splitlines() if line.startswith("nprocs=1 CPU ")]
    assert len(cpu) == int(cputime.available())  # not on a kernel that hides it
    for title in ("CPU ms", "ranks'", "per rank", "helpers'", "caller's") if cpu else ():
        assert title in cpu[0]
    assert ("CPU ms: medians of the time on a CPU" in table) == bool(cpu)
    assert "vs binary-popen" in table
    assert "vs floor" not in table  # floor did not run
    spawn_rows = [line for line in table.splitlines() if line.startswith("mp-spawn ")]
    # A start, an end and a CPU row per nprocs; the ratio is in the start rows.
    assert len(spawn_rows) == 2 * TABLES and sum("1.00x" in row for row in spawn_rows) == 2
    fork_row = next(line for line in table.splitlines() if line.startswith("mp-fork "))
    assert any(token.endswith("x") for token in fork_row.split())  # its ratio
    assert "machine:" in table


def test_json_follows_the_documented_schema(tiny_sweep):
    table, document, err = tiny_sweep
    assert validate(document) == []
    # Whether fresh interpreters compiled fastspawn's modules: said, kept.
    uncached = len(host.uncached_modules())
    assert document["machine"]["uncached_modules"] == uncached
    assert ("of fastspawn's modules have no bytecode cache here" in err) == bool(uncached)
    assert ("fastspawn's modules had no bytecode cache" in table) == bool(uncached)
    assert document["machine"]["fastspawn"] == fastspawn.__version__
    assert document["machine"]["cpu"]
    assert document["config"]["methods"] == CHEAP
    assert document["config"]["nprocs"] == [1, 2]
    assert document["config"]["full"] is False and document["config"]["caps"] == {}
    assert document["failed"] is None
    rounds = document["rounds"]
    # Python methods: a launch and a failure round per nprocs; binaries: a launch.
    assert len(rounds) == 2 * (2 * len(PYTHON_CHEAP) + 2)
    for record in rounds:
        if record["kind"] == "failure":
            assert record["failure_s"] > 0
        elif record["method"].startswith("binary-"):
            assert record["reaped_s"] >= record["created_s"] > 0
        else:
            assert len(record["rank_entry_s"]) == record["nprocs"]
            assert record["running_s"] == max(record["rank_entry_s"])
            assert record["joined_s"] > 0
            assert record["uss_bytes"] > 0
            if not cputime.available():
                assert record["cpu_s"] is None
                continue
            # The launch's CPU: its parts add up; every launch runs ranks and
            # a caller; only the zygote's methods have a helper here.
            parts = [record[key] or 0.0 for key in cputime.FIELDS[1:]]
            assert record["cpu_s"] == pytest.approx(sum(parts))
            assert record["rank_cpu_s"] > 0 and record["caller_cpu_s"] > 0
            helpers = record["method"].startswith("fastspawn-zygote")
            assert (record["helper_cpu_s"] is not None) == helpers, record
    ratios = {
        (s["method"], s["nprocs"]): s["ratio"]
        for s in document["summary"]
        if s["phase"] == "running"
    }
    assert ratios[("mp-spawn", 1)] == ratios[("mp-spawn", 2)] == 1.0
    assert all(ratios[(m, n)] > 0 for m in PYTHON_CHEAP for n in (1, 2))


def test_plot_draws_a_png(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (pip install 'fastspawn[plot]')")
    png = tmp_path / "bench.png"
    done = bench(
        "--methods", "fastspawn-zygote-warm,mp-fork,binary-popen",
        "--nprocs", "1,2", "--repeat", "1", "--plot", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_measuring(tmp_path):
    png = tmp_path / "bench.png"
    without = shadowing(tmp_path, "matplotlib")
    done = bench("--methods", "mp-fork", "--plot", str(png), env=without)
    assert done.returncode == 2
    assert "matplotlib" in done.stderr and "fastspawn[plot]" in done.stderr
    assert done.stdout == "" and not png.exists()
    # Its advice, "or leave --plot out", followed:
    assert "or leave --plot out" in done.stderr
    done = bench("--methods", "mp-fork", "--nprocs", "1", "--repeat", "1", env=without)
    assert done.returncode == 0, done.stderr


def test_floor_run_reports_every_rank_shows_its_column_and_leaves_nothing(tmp_path):
    out = tmp_path / "floor.json"
    returncode, table, err, seen = bench_watched(
        "--methods", "floor,floor-sized,fastspawn-fork",
        "--nprocs", "1,4", "--repeat", "1", "--json", str(out),
    )  # fmt: skip
    assert returncode == 0, err
    assert seen  # the helper at least, alive for the whole run
    assert still_running(seen) == []

    header = next(line for line in table.splitlines() if line.startswith("nprocs=1 start "))
    assert "vs floor" in header and "vs mp-spawn" in header
    floor_rows = [line for line in table.splitlines() if line.startswith("floor ")]
    # A start row (with the ratios), an end and a CPU row per nprocs.
    assert len(floor_rows) == 2 * TABLES and sum("1.00x" in row for row in floor_rows) == 2
    sized_rows = [line for line in table.splitlines() if line.startswith("floor-sized ")]
    assert len(sized_rows) == 2 * TABLES

    document = json.loads(out.read_text())
    assert validate(document) == []
    floor = [r for r in document["rounds"] if r["method"] == "floor"]
    launches = [r for r in floor if r["kind"] == "launch"]
    assert sorted(r["nprocs"] for r in launches) == [1, 4]
    for record in launches:
        assert len(record["rank_entry_s"]) == len(record["rank_exit_s"]) == record["nprocs"]
        assert record["running_s"] == max(record["rank_entry_s"])
        assert min(record["rank_exit_s"]) >= record["running_s"]  # released once all ran
        assert record["joined_s"] > 0 and record["uss_bytes"] > 0
        assert record["helper_uss_bytes"] > 0
    assert sorted(r["nprocs"] for r in floor if r["kind"] == "failure") == [1, 4]
    assert all(r["failure_s"] > 0 for r in floor if r["kind"] == "failure")
    running = {
        (s["method"], s["nprocs"]): s for s in document["summary"] if s["phase"] == "running"
    }
    for nprocs in (1, 4):
        assert running[("floor", nprocs)]["floor_ratio"] == 1.0
        assert running[("fastspawn-fork", nprocs)]["floor_ratio"] > 0
        assert running[("floor-sized", nprocs)]["floor_ratio"] > 0
        assert running[("floor", nprocs)]["ratio"] is None  # mp-spawn did not run
    sized = [r for r in document["rounds"] if r["method"] == "floor-sized"]
    assert sorted(r["nprocs"] for r in sized if r["kind"] == "launch") == [1, 4]


def test_preforked_floors_wake_every_rank_and_leave_nothing(tmp_path):
    out = tmp_path / "preforked.json"
    returncode, table, err, seen = bench_watched(
        "--methods", "floor,floor-preforked,floor-preforked-sized",
        "--nprocs", "1,4", "--repeat", "2", "--json", str(out),
    )  # fmt: skip
    assert returncode == 0, err
    assert seen and still_running(seen) == []
    for name in ("floor-preforked", "floor-preforked-sized"):
        rows = [line for line in table.splitlines() if line.startswith(f"{name} ")]
        assert len(rows) == 2 * TABLES
    document = json.loads(out.read_text())
    assert validate(document) == []
    for name in ("floor-preforked", "floor-preforked-sized"):
        rounds = [r for r in document["rounds"] if r["method"] == name]
        launches = [r for r in rounds if r["kind"] == "launch"]
        assert sorted(r["nprocs"] for r in launches) == [1, 1, 4, 4]
        for record in launches:
            assert len(record["rank_entry_s"]) == len(record["rank_exit_s"]) == record["nprocs"]
            assert min(record["rank_exit_s"]) >= record["running_s"]  # released once all ran
            # The helper's writes, the ranks' wakes: each measured.
            if cputime.available():
                assert record["helper_cpu_s"] > 0 and record["rank_cpu_s"] > 0
        failures = [r for r in rounds if r["kind"] == "failure"]
        assert sorted(r["nprocs"] for r in failures) == [1, 1, 4, 4]
        assert all(r["failure_s"] > 0 for r in failures)


_REFILL_CHECK = """
import sys, time
import fastspawn
from fastspawn._bench import methods
from fastspawn._launch.methods import registry
from fastspawn._zygote import client

def noop(rank):
    pass

def cpu_times():
    times = {}
    for pid in client.ready_workers(client.zygote_pid()):
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        times[pid] = int(fields[11]) + int(fields[12])
    return times

if __name__ == "__main__":
    fastspawn.start_processes(noop, nprocs=int(sys.argv[1]))
    methods._await_ready(registry.get("zygote"), int(sys.argv[1]))
    returned = cpu_times()
    time.sleep(0.5)
    print(len(returned), returned == cpu_times())
"""


@pytest.mark.parametrize(("cap", "expected"), [("", "3"), ("2", "2")])
def test_the_refilled_method_waits_for_every_ready_worker_to_warm_up(tmp_path, cap, expected):
    # fastspawn-zygote-refilled's prepare: the timed launch must find the
    # workers the zygote made ready in the background, each asleep after its
    # warm-up (no CPU time spent after the wait), as prefork() leaves them;
    # with a cap under nprocs, as many as the cap.
    script = tmp_path / "refill_check.py"
    script.write_text(_REFILL_CHECK)
    env = dict(os.environ, FASTSPAWN_READY=cap)
    done = subprocess.run(
        [sys.executable, str(script), "3"], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [expected, "True"]


_SIZED_CHECK = """
import subprocess, sys
import fastspawn
import fastspawn._bench.ranks  # what unpickling a bench rank's fn imports in the zygote

def modules(rank):
    return sorted(sys.modules)

if __name__ == "__main__":
    # Here, not at the top: the zygote imports this module, and a bench's
    # zygote holds none of the bench's own modules (see _BareMain).
    from fastspawn._bench import floor as bench_floor
    rank = set(fastspawn.start_processes(modules, nprocs=1).return_values[0])
    code = bench_floor._SIZED_PREFIX + "import sys; print(' '.join(sorted(sys.modules)))"
    sized = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    helper = set(sized.stdout.split())
    print(sorted(helper - rank), sorted(rank - helper))
"""


def test_the_sized_floor_holds_the_modules_a_zygote_rank_holds(tmp_path):
    # The floor-sized helper is what a zygote serving a small program is:
    # the same modules, so a fork of it copies what a fork of the zygote does.
    script = tmp_path / "caller.py"
    script.write_text(_SIZED_CHECK)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] []"


def test_help_is_clear():
    done = bench("--help")
    assert done.returncode == 0
    words = ["all running", "failure->reaped", "USS", "--import", "--payload-bytes", "--json"]
    words += ["--plot", "matplotlib", "RLIMIT_NPROC", "Exit status", "130", "vs floor"]
    words += ["os.fork()", "python -I -S"]
    for word in [*common.ALL_METHODS, *words]:
        assert word in done.stdout, word


def test_without_psutil_the_bench_says_where_uss_comes_from(tmp_path):
    args = ("--methods", "mp-fork", "--nprocs", "1", "--repeat", "1")
    done = bench(*args, env=shadowing(tmp_path, "psutil"))
    assert done.returncode == 0, done.stderr
    assert "USS not measured (pip install 'fastspawn[bench]')" in done.stderr
    # Followed (the extra brings psutil, installed here): USS measured.
    done = bench(*args)
    assert done.returncode == 0 and "USS not measured" not in done.stderr, done.stderr


def test_unknown_method_lists_the_valid_ones():
    done = bench("--methods", "mp-spawn,mp-vfork")
    assert done.returncode == 2
    assert "'mp-vfork'" in done.stderr
    for method in common.ALL_METHODS:
        assert method in done.stderr
    assert done.stdout == ""
    # Followed: a name from the list, and a group it offers.
    valid = done.stderr.split("valid: ", 1)[1]
    name, group = valid.split(",")[0].strip(), valid.split("or a group: ", 1)[1].split(",")[0]
    done = bench("--methods", f"mp-spawn,{name},{group.strip()}", "--nprocs", "1", "--repeat", "1")
    assert done.returncode == 0, done.stderr


def test_torch_spawn_without_torch_says_so(tmp_path):
    without = shadowing(tmp_path, "torch")
    done = bench("--methods", "torch-spawn,mp-fork", env=without)
    assert done.returncode == 2
    assert "torch-spawn needs torch" in done.stderr
    # Followed: "or leave torch-spawn out of --methods".
    assert "leave torch-spawn out of --methods" in done.stderr
    done = bench("--methods", "mp-fork", "--nprocs", "1", "--repeat", "1", env=without)
    assert done.returncode == 0, done.stderr


def test_absurd_nprocs_is_refused_naming_the_limit():
    done = bench("--methods", "mp-fork", "--nprocs", "1,100000000")
    assert done.returncode == 2
    assert "RLIMIT_" in done.stderr and "lower --nprocs" in done.stderr
    # Followed: a lower --nprocs runs.
    done = bench("--methods", "mp-fork", "--nprocs", "1,2", "--repeat", "1")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("limit", "nprocs", "name"),
    [
        (resource.RLIMIT_NPROC, "5000", "RLIMIT_NPROC"),
        (resource.RLIMIT_NOFILE, "300", "RLIMIT_NOFILE"),
    ],
)
def test_real_limits_are_read(limit, nprocs, name):
    low = 4000 if limit == resource.RLIMIT_NPROC else 256
    hard = resource.getrlimit(limit)[1]
    if hard != resource.RLIM_INFINITY and hard < low:
        pytest.skip(f"the hard limit is already {hard}")

    def lower() -> None:
        resource.setrlimit(limit, (low, hard))

    done = bench("--methods", "mp-fork", "--nprocs", nprocs, preexec_fn=lower)
    assert done.returncode == 2
    assert name in done.stderr


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_leaves_no_process_behind(sig, status):
    methods = "fastspawn-zygote-warm,fastspawn-spawn,mp-forkserver,mp-spawn,floor,binary-popen"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastspawn", "bench", "--methods", methods,
         "--nprocs", "4", "--repeat", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        start = time.monotonic()
        # Mid-sweep: after the warm-up, with ranks and helpers around.
        seen = descendants_while_running(
            proc, lambda seen: len(seen) >= 8 and time.monotonic() - start >= 1.5
        )
        assert proc.poll() is None, proc.communicate()
        assert len(seen) >= 8
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, err
    assert "every process it started is stopped and reaped" in err
    assert still_running(seen) == []


_BOMB = """
import os
# Counts its imports in the file BENCH_BOMB names; from the BENCH_BOMB_AT-th
# on, the importing process dies: a rank that fails before its report.
fd = os.open(os.environ["BENCH_BOMB"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
os.write(fd, b".")
count = os.fstat(fd).st_size
os.close(fd)
if count >= int(os.environ["BENCH_BOMB_AT"]):
    os._exit(3)
"""


def test_a_failed_round_keeps_the_rounds_before_it_and_names_itself(tmp_path):
    (tmp_path / "bench_bomb.py").write_text(_BOMB)
    out = tmp_path / "bench.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "BENCH_BOMB": str(tmp_path / "count"),
        # Imported by the bench (1), mp-spawn's warm-up rank (2), its launch
        # and failure ranks of round 1 (3, 4); mp-fork's ranks inherit it.
        # Round 2 of mp-spawn dies; round 2 begins with mp-fork (the order
        # rotates), so 6 rounds stand.
        "BENCH_BOMB_AT": "5",
    }
    returncode, table, err, seen = bench_watched(
        "--methods", "mp-fork,mp-spawn", "--nprocs", "1", "--repeat", "4",
        "--import", "bench_bomb", "--json", str(out), env=env,
    )  # fmt: skip
    assert returncode == 1, err
    assert still_running(seen) == []
    assert "a measurement failed: mp-spawn with nprocs=1, round 2: rank 0 (pid " in err
    assert "exit code 3 before the bench released it" in err
    assert f"the rounds measured before it are above and in {out}" in err
    assert "fastspawn bench --methods mp-spawn --nprocs 1)" in err
    assert "(the 6 round(s) measured before mp-spawn failed)" in table
    rows = table.splitlines()
    # Start, end and CPU tables.
    mp_rows = [row.split()[0] for row in rows if row.startswith("mp-")]
    assert mp_rows == ["mp-spawn", "mp-fork"] * TABLES

    document = json.loads(out.read_text())
    assert validate(document) == []
    failed = document["failed"]
    assert {k: failed[k] for k in ("method", "nprocs", "round", "kind")} == {
        "method": "mp-spawn", "nprocs": 1, "round": 1, "kind": "launch",
    }  # fmt: skip
    assert "exit code 3" in failed["message"]
    assert [(r["method"], r["round"], r["kind"]) for r in document["rounds"]] == [
        ("mp-spawn", 0, "launch"),
        ("mp-spawn", 0, "failure"),
        ("mp-fork", 0, "launch"),
        ("mp-fork", 0, "failure"),
        ("mp-fork", 1, "launch"),
        ("mp-fork", 1, "failure"),
    ]
    assert {s["method"] for s in document["summary"]} == {"mp-fork", "mp-spawn"}

    # Following its advice measures just that method and size.
    again = bench("--methods", "mp-spawn", "--nprocs", "1", "--repeat", "1")
    assert again.returncode == 0, again.stderr
    assert "mp-spawn" in again.stdout


# -------------------------------------------------------------- the pieces


def test_limit_problem_names_the_limit():
    def problem(nprocs: int = 8, **kw: int) -> str | None:
        limits = dict(
            nproc_limit=1000, tasks_in_use=100, nofile_limit=1024, fds_open=10, report_ranks=50000
        )
        limits.update(kw)
        return host.limit_problem(nprocs, 2, **limits)

    assert problem() is None
    assert "RLIMIT_NPROC" in problem(nprocs=950)
    assert "ulimit -n" in problem(nprocs=600)
    assert "RLIMIT_NOFILE" in problem(nprocs=600)
    assert "report pipe" in problem(
        nprocs=600, nofile_limit=10**6, nproc_limit=10**6, report_ranks=100
    )
    unlimited = resource.RLIM_INFINITY
    assert problem(nprocs=5000, nproc_limit=unlimited, nofile_limit=unlimited) is None


def test_methods_take_names_and_groups_in_a_fixed_order():
    methods, notes = bench_options.parse_methods("binary,mp-spawn,fastspawn-fork", None)
    assert methods == [
        "fastspawn-fork",
        "mp-spawn",
        "binary-fastspawn",
        "binary-popen",
        "binary-popen-pdeathsig",
    ]
    assert notes == []
    everything, notes = bench_options.parse_methods("all", "torch is not installed")
    assert "torch-spawn" not in everything and len(everything) == len(common.ALL_METHODS) - 1
    assert notes == ["torch-spawn left out: torch is not installed"]
    with pytest.raises(common.UsageError, match="torch-spawn needs torch"):
        bench_options.parse_methods("torch", "torch is not installed")
    with pytest.raises(common.UsageError, match="valid: fastspawn-zygote-warm"):
        bench_options.parse_methods("spawn", None)


def test_sizes_and_nprocs_parse():
    assert bench_options.parse_size("4096") == 4096
    assert bench_options.parse_size("64K") == 65536
    assert bench_options.parse_size("1MiB") == 1 << 20
    assert bench_options.parse_nprocs("64,1,8,8") == [1, 8, 64]
    for bad in ("0", "1,,x", ""):
        with pytest.raises(common.UsageError):
            bench_options.parse_nprocs(bad)
    with pytest.raises(common.UsageError):
        bench_options.parse_size("lots")


def test_pause_parses_seconds_and_refuses_the_rest():
    assert bench_options.parse_pause("0") == 0.0
    assert bench_options.parse_pause("0.5") == 0.5
    for bad, says in (("soon", "takes seconds"), ("-1", "from 0 to 60"), ("nan", "from 0 to 60")):
        with pytest.raises(common.UsageError, match=says):
            bench_options.parse_pause(bad)
    with pytest.raises(common.UsageError, match="'600'"):
        bench_options.parse_pause("600")


def test_pause_sleeps_before_every_timed_launch_and_says_so(tmp_path):
    out = tmp_path / "pause.json"
    done = bench(
        "--methods", "mp-fork,binary-popen", "--nprocs", "1", "--repeat", "2",
        "--pause", "0.3", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "each launch after a pause of 0.3 s (--pause)" in done.stdout
    document = json.loads(out.read_text())
    assert validate(document) == []
    assert document["config"]["pause_s"] == 0.3
    # Warm-up (one launch each) and rounds (mp-fork: a launch and a failure
    # round each), all paused; none of it timed.
    paused = 2 + len(document["rounds"])
    assert len(document["rounds"]) == 6
    assert document["duration_s"] >= paused * 0.3


def test_the_bench_knows_which_of_fastspawns_modules_a_fresh_interpreter_compiles(
    tmp_path, monkeypatch
):
    # Caches looked for under an empty prefix: none is there.
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    root = Path(fastspawn.__file__).parent
    sources = sorted(str(path.relative_to(root)) for path in root.rglob("*.py"))
    assert len(sources) > 50 and host.uncached_modules() == sources
    init = str(root / "__init__.py")
    cached = Path(importlib.util.cache_from_source(init))
    py_compile.compile(init, cfile=str(cached), doraise=True)
    assert host.uncached_modules() == [p for p in sources if p != "__init__.py"]
    # A cache of another version of the source (its mtime) is not used.
    data = bytearray(cached.read_bytes())
    data[8:12] = ((int(os.stat(init).st_mtime) + 1) & 0xFFFFFFFF).to_bytes(4, "little")
    cached.write_bytes(bytes(data))
    assert host.uncached_modules() == sources


def test_quantile_and_summary():
    assert bench_summary.quantile([3.0], 0.9) == 3.0
    assert bench_summary.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert bench_summary.quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    records = []
    for method, running in (("mp-spawn", [0.2, 0.1, 0.3]), ("mp-fork", [0.03, 0.01, 0.02])):
        for round_no, value in enumerate(running):
            record = bench_rounds.new_record(method, 8, round_no, "launch")
            record["running_s"] = value
            records.append(record)
    summary = bench_summary.summarize(records, ["mp-spawn", "mp-fork"])
    fork = next(s for s in summary if s["method"] == "mp-fork")
    assert fork["median"] == 0.02 and fork["min"] == 0.01
    assert fork["p90"] == pytest.approx(0.028)
    assert fork["ratio"] == pytest.approx(0.1) and fork["baseline"] == "mp-spawn"
    table = bench_summary.format_table(
        summary,
        ["mp-spawn", "mp-fork"],
        3,
        {"cpu": "X", "cores": 2, "usable_cores": 2, "kernel": "6", "python": "3", "fastspawn": "0"},
    )
    assert "20.0 (10.0-28.0)" in table and "0.10x" in table and "1.00x" in table


def test_the_default_run_is_the_short_one_and_full_the_long_sweep(monkeypatch):
    monkeypatch.setattr(bench_options, "torch_problem", lambda: None)  # as if torch imported

    def options(*argv: str) -> bench_options.Options:
        return bench_options.Options(bench_options.build_parser().parse_args(argv), argv)

    short = options("--methods", "torch-spawn,mp-fork")
    assert (short.nprocs, short.repeat, short.full) == ([1, 8, 64], 3, False)
    assert short.caps == {"torch-spawn": 8}
    assert options("--methods", "mp-fork").caps == {}
    full = options("--methods", "torch-spawn,mp-fork", "--full")
    assert (full.nprocs, full.repeat, full.caps) == ([1, 8, 64], 5, {})
    assert options("--methods", "torch-spawn", "--nprocs", "64").caps == {}  # asked for
    assert options("--full", "--repeat", "2", "--methods", "mp-fork").repeat == 2
    with pytest.raises(common.UsageError, match="--repeat must be at least 1; got 0"):
        options("--repeat", "0", "--methods", "mp-fork")


def test_the_plan_keeps_a_capped_method_small_and_rotates_the_order():
    methods = [bench_rounds.make_method(n) for n in ("mp-fork", "torch-spawn", "binary-popen")]
    rounds = bench_rounds.plan(methods, [1, 8, 64], 3, {"torch-spawn": 8})
    by = {m.name: [r for r in rounds if r.method is m] for m in methods}
    assert [(r.nprocs, r.failure) for r in by["torch-spawn"]] == [(1, False)] * 3 + [(8, False)] * 3
    assert len(by["mp-fork"]) == 18 and sum(r.failure for r in by["mp-fork"]) == 9
    assert len(by["binary-popen"]) == 9 and not any(r.failure for r in by["binary-popen"])
    firsts = [next(r for r in rounds if r.nprocs == 1 and r.round_no == k) for k in range(3)]
    assert [r.method.name for r in firsts] == ["mp-fork", "torch-spawn", "binary-popen"]
    # A failure round follows its method's launch round.
    assert all(
        not r.failure or (rounds[i - 1].method is r.method and not rounds[i - 1].failure)
        for i, r in enumerate(rounds)
    )


def test_the_estimate_is_a_line_through_the_warm_up_launches():
    estimate = bench_progress.Estimate()
    estimate.add("m", 1, 0.5)
    estimate.add("m", 4, 2.0)
    assert estimate.round_s("m", 1) == 0.5
    assert estimate.round_s("m", 64) == pytest.approx(0.5 + 0.5 * 63)
    # A first launch that paid one-off costs (a server started): the
    # smaller time stands for one rank.
    estimate.add("z", 1, 3.0)
    estimate.add("z", 4, 0.4)
    assert estimate.round_s("z", 64) == pytest.approx(0.4)
    estimate.add("one", 1, 0.2)  # no probe: a sweep of single ranks
    assert estimate.round_s("one", 1) == pytest.approx(0.2)
    assert estimate.round_s("unknown", 8) == 0.0
    assert [bench_progress.clock(s) for s in (0.4, 8.4, 85, 120, 599, 840)] == [
        "0 s", "8 s", "1 min 25 s", "2 min", "9 min 59 s", "14 min",
    ]  # fmt: skip


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_rounds_time_and_time_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(bench_progress.time, "monotonic", lambda: now[0])
    # Off a terminal: a line at most every interval, nothing in between.
    log = io.StringIO()
    progress = bench_progress.Progress(log, interval=10)
    progress.begin([1.0, 1.0, 2.0])
    progress.round_starts("mp-fork nprocs=1 round 1")
    now[0] += 2.0  # twice as long as estimated: the time left doubles too
    progress.round_done()
    assert log.getvalue() == ""
    now[0] += 10.0
    progress.round_done()
    assert log.getvalue() == "fastspawn bench: 2/3 rounds, 12 s spent, about 12 s left\n"
    # On a terminal: a status line before each round, rewritten in place,
    # and cleared before a line that stays.
    tty = _Terminal()
    progress = bench_progress.Progress(tty)
    progress.begin([1.0, 3.0])
    progress.round_starts("mp-spawn nprocs=8 round 2 (failure)")
    assert tty.getvalue() == (
        "\r\x1b[Kfastspawn bench: 0/2 rounds, 0 s spent, about 4 s left: "
        "mp-spawn nprocs=8 round 2 (failure)"
    )
    progress.round_done()
    progress.say("done")
    assert tty.getvalue().endswith("\r\x1b[Kfastspawn bench: done\n")


def test_every_line_of_the_report_fits_100_columns():
    records = []
    for method in common.ALL_METHODS:
        for nprocs in (1, 4096):
            record = bench_rounds.new_record(method, nprocs, 0, "launch")
            keys = ("created_s", "reaped_s") if method.startswith("binary-") else (
                "created_s", "running_s", "joined_s", "failure_s")  # fmt: skip
            record.update(dict.fromkeys(keys, 123.456))  # 123456 ms
            record["uss_bytes"] = None if method.startswith("binary-") else 123456 * 2**20
            if not method.startswith("binary-"):
                record.update(dict.fromkeys(cputime.FIELDS, 123.456))
            records.append(record)
    summary = bench_summary.summarize(records, common.ALL_METHODS)
    machine = {
        "cpu": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "cores": 224,
        "usable_cores": 224, "kernel": "6.18.44-fc-v669-generic",
        "python": "3.13.1 (CPython)", "fastspawn": "0.1.0", "uncached_modules": 95,
    }  # fmt: skip
    table = bench_summary.format_table(summary, common.ALL_METHODS, 5, machine)
    assert "123456 (123456-123456)" in table and "binary-popen-pdeathsig" in table
    assert max(len(line) for line in table.splitlines()) <= bench_summary.WIDTH == 100


def test_every_series_of_the_plot_has_its_own_colour_and_marker():
    styles = bench_summary.SERIES_STYLE
    assert set(styles) == set(common.ALL_METHODS)
    assert len({colour for colour, _ in styles.values()}) == len(styles)
    assert len({marker for _, marker in styles.values()}) == len(styles)
    assert bench_summary.HEADLINE == "fastspawn-zygote-warm"


def test_the_rank_module_imports_nothing_heavy():
    # Spawn-like ranks import the module of their fn: it must not make them
    # pay for the bench's own imports, nor for fastspawn's launching side.
    # (multiprocessing's context module they load anyway, for their
    # payload; importing fastspawn registers its contexts there.)
    assert bench_ranks.rank_main.__module__ == "fastspawn._bench.ranks"
    code = (
        "import sys, fastspawn._bench.ranks; "
        "print(sorted({'argparse', 'json', 'dataclasses', 'psutil', 'tempfile', 'subprocess', "
        "'fastspawn._launch.api', 'fastspawn._launch.methods.registry', "
        "'fastspawn._launch.context', 'fastspawn._bench.main', 'fastspawn._bench.session', "
        "'fastspawn._bench.methods', 'multiprocessing.pool', 'multiprocessing.managers'} "
        "& set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_floor_ratio_and_its_column():
    records = []
    for method, running in (("floor", 0.001), ("mp-fork", 0.02), ("binary-popen", 0.004)):
        record = bench_rounds.new_record(method, 8, 0, "launch")
        record["running_s" if method != "binary-popen" else "reaped_s"] = running
        records.append(record)
    methods = ["mp-fork", "floor", "binary-popen"]
    summary = bench_summary.summarize(records, methods)
    ratios = {s["method"]: s["floor_ratio"] for s in summary}
    assert ratios["mp-fork"] == pytest.approx(20.0) and ratios["floor"] == 1.0
    assert ratios["binary-popen"] is None  # binaries are not compared with the floor
    machine = {"cpu": "X", "cores": 2, "usable_cores": 2, "kernel": "6", "python": "3"}
    table = bench_summary.format_table(summary, methods, 1, {**machine, "fastspawn": "0"})
    header = next(line for line in table.splitlines() if line.startswith("nprocs=8 start "))
    assert header.index("all running") < header.index("vs mp-spawn") < header.index("vs floor")
    assert "20.0x" in table and "1.00x" in table
    without = bench_summary.summarize(records[1:], methods)
    assert "vs floor" not in bench_summary.format_table(
        without, methods, 1, {**machine, "fastspawn": "0"}
    )


# ------------------------------------------------------------- the floor


@pytest.fixture
def floor(tmp_path: Path) -> Iterator[tuple[bench_methods.Method, bench_session.Session]]:
    """The floor method, set up in this process (its helper our child)."""
    reports = bench_session.Reports(str(tmp_path))
    session = bench_session.Session(reports, [], 0, "true", [])
    method = bench_rounds.make_method("floor")
    try:
        method.setup(session)
        yield method, session
    finally:
        for launched in session.live:
            launched.kill()
        method.teardown()
        reports.close()


def _floor_round(
    floor: tuple[bench_methods.Method, bench_session.Session], nprocs: int, fail_rank: int = -1
) -> tuple[bench_session.Launched, int, dict[int, float]]:
    """Launch, and wait until every rank reported its entry."""
    method, session = floor
    spec = session.spec(fail_rank)
    launched = method.launch(nprocs, spec, session)
    entered = session.reports.wait(spec[2], bench_ranks.ENTERED, nprocs, launched)
    return launched, spec[2], entered


def test_floor_helper_is_a_small_interpreter_that_forks_the_ranks(floor):
    method, session = floor
    launched, round_id, entered = _floor_round(floor, 3)
    assert sorted(entered) == [0, 1, 2]
    helper = psutil.Process(method.helper_pids()[0])
    assert helper.ppid() == os.getpid()
    assert helper.cmdline()[1:4] == ["-I", "-S", "-c"]
    mapped = {m.path for m in helper.memory_maps()}
    assert not [path for path in mapped if "fastspawn" in path or "multiprocessing" in path]
    pids = launched.pids()
    assert sorted(child.pid for child in helper.children()) == sorted(pids)
    launched.release(range(3))
    launched.join()
    exits = session.reports.wait(round_id, bench_ranks.EXITED, 3, None)
    assert sorted(exits) == [0, 1, 2]
    assert helper.children() == []
    session.live.remove(launched)
    method.teardown()
    assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("measured", [True, False])
def test_a_round_records_its_cpu_time_where_the_kernel_shows_it(floor, measured):
    if measured and not cputime.available():
        pytest.skip("this kernel refuses CPU clocks or shows no children lists in /proc")
    method, session = floor
    session.cpu = measured
    record = bench_rounds.python_round(method, 2, 0, session, False)
    assert record["running_s"] > 0
    if not measured:
        assert [record[key] for key in cputime.FIELDS] == [None] * 4
        return
    assert record["rank_cpu_s"] > 0 and record["caller_cpu_s"] > 0
    assert record["helper_cpu_s"] > 0  # the floor's helper forked them
    assert record["cpu_s"] == pytest.approx(
        record["rank_cpu_s"] + record["helper_cpu_s"] + record["caller_cpu_s"]
    )


def _spin(seconds: float) -> None:
    """Run on a CPU for ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cputime_counts_a_process_still_running_when_read():
    # What the kernel shows of another process's CPU time (its clock,
    # schedstat) grows at a tick or when it stops running: a rank still on
    # the other CPU since its wake read as having spent nothing (rank_cpu_s
    # 0.0 on a CI host).  A child reads its own clock (which brings its
    # count up to date), says so, runs on without a system call that would
    # and only then reads it again, says that, and sleeps: the reading
    # taken as soon as the first figure arrives must count up to the
    # second.
    if not cputime.available():
        pytest.skip("this kernel refuses CPU clocks or shows no children lists in /proc")
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(go_r, 1)
            os.write(said_w, time.process_time_ns().to_bytes(8, "little"))
            end = time.perf_counter() + 0.005  # the vDSO, or a clock that is no CPU's
            while time.perf_counter() < end:
                pass
            os.write(said_w, time.process_time_ns().to_bytes(8, "little"))
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        before = cputime.snapshot()
        os.write(go_w, b"x")
        first = int.from_bytes(os.read(said_r, 8), "little")
        share = cputime.spent(before, cputime.bench_ns(), [pid], [])
        second = int.from_bytes(os.read(said_r, 8), "little")
        assert second > first
        assert share["rank_cpu_s"] is not None
        assert before.processes[pid] + share["rank_cpu_s"] * 1e9 >= second - 1000  # float rounding
    finally:
        os.write(go_w, b"xx")  # both of its waits, however far it got
        os.waitpid(pid, 0)
        for fd in (said_r, said_w, go_r, go_w):
            os.close(fd)


def test_cputime_counts_a_process_there_before_the_launch_from_the_snapshot_on():
    # A pre-forked rank's (or ready worker's) CPU before the launch is not
    # the launch's: a child that ran 0.2 s before the snapshot and 0.02 s
    # after counts those 0.02 s (and what it took to wake), not its life.
    if not cputime.available():
        pytest.skip("this kernel refuses CPU clocks or shows no children lists in /proc")
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _spin(0.2)
            os.write(said_w, b"1")
            os.read(go_r, 1)
            _spin(0.02)
            os.write(said_w, b"2")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        os.read(said_r, 1)
        assert pid in (cputime.descendants(os.getpid()) or [])
        before = cputime.snapshot()
        assert before.processes[pid] >= 0.2e9
        os.write(go_w, b"x")
        os.read(said_r, 1)
        share = cputime.spent(before, cputime.bench_ns(), [pid], [pid])
        whole = cputime.process_ns(pid)
        assert whole is not None and whole >= 0.22e9
        assert 0.02 <= share["rank_cpu_s"] < whole / 1e9 - 0.2  # type: ignore[operator]
        assert share["helper_cpu_s"] is None  # its only helper was the rank itself
        assert share["caller_cpu_s"] is not None and share["caller_cpu_s"] >= 0
        assert share["cpu_s"] == pytest.approx(share["rank_cpu_s"] + share["caller_cpu_s"])
    finally:
        os.write(go_w, b"xx")  # both of its waits, however far it got
        os.waitpid(pid, 0)
        for fd in (said_r, said_w, go_r, go_w):
            os.close(fd)
    assert cputime.process_ns(pid) is None  # reaped: gone


def test_floor_ranks_run_the_ranks_module_every_method_runs(tmp_path, monkeypatch):
    # The floor's helper runs the source of the module the bench's ranks
    # come from: a copy whose rank_main stamps its entry -1.0 shows it does.
    source = Path(bench_ranks.__file__).read_text()
    marked = source.replace("entered = time.monotonic()", "entered = -1.0")
    assert marked != source
    copy = tmp_path / "ranks_copy.py"
    copy.write_text(marked)
    monkeypatch.setattr(bench_floor, "_ranks", types.SimpleNamespace(__file__=str(copy)))
    reports = bench_session.Reports(str(tmp_path))
    session = bench_session.Session(reports, [], 0, "true", [])
    method = bench_rounds.make_method("floor-preforked")
    try:
        method.setup(session)
        method.prepare(session, 2)
        launched, round_id, entered = _floor_round((method, session), 2)
        assert entered == {0: -1.0, 1: -1.0}
        launched.release(range(2))
        launched.join()
        assert sorted(session.reports.wait(round_id, bench_ranks.EXITED, 2, None)) == [0, 1]
        session.live.remove(launched)
    finally:
        for launched in session.live:
            launched.kill()
        method.teardown()
        reports.close()


def test_floor_kill_reaps_unreleased_ranks_and_the_helper_goes_on(floor):
    method, session = floor
    launched, _round_id, _entered = _floor_round(floor, 4)
    launched.kill()
    assert isinstance(launched, bench_floor.FloorLaunched)
    assert launched.codes == {rank: -signal.SIGKILL for rank in range(4)}
    helper = psutil.Process(method.helper_pids()[0])
    assert helper.children() == []
    session.live.remove(launched)
    again, round_id, _entered = _floor_round(floor, 1)
    again.release([0])
    again.join()
    assert session.reports.wait(round_id, bench_ranks.EXITED, 1, None).keys() == {0}
    session.live.remove(again)


def test_floor_failure_round_kills_the_others(floor):
    _method, session = floor
    launched, round_id, _entered = _floor_round(floor, 3, fail_rank=1)
    launched.release([1])
    launched.join_failure()
    assert session.reports.wait(round_id, bench_ranks.FAILED, 1, None).keys() == {1}
    assert isinstance(launched, bench_floor.FloorLaunched)
    assert launched.codes == {0: -signal.SIGKILL, 1: 1, 2: -signal.SIGKILL}
    session.live.remove(launched)


def test_floor_names_a_rank_that_died_before_its_release(floor):
    launched, _round_id, _entered = _floor_round(floor, 2)
    os.kill(launched.pids()[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (problem := launched.problem()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert problem is not None
    assert "rank 0" in problem and f"signal {int(signal.SIGKILL)}" in problem


def test_floor_ranks_exit_once_their_helper_is_gone(floor):
    method, session = floor
    launched, _round_id, _entered = _floor_round(floor, 2)
    ranks = [psutil.Process(pid) for pid in launched.pids()]
    os.kill(method.helper_pids()[0], signal.SIGKILL)  # not its ranks; teardown reaps it
    with pytest.raises(common.BenchError, match="helper .* exited"):
        launched.join()
    _gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []  # orphans that nobody would release
    session.live.remove(launched)


# ------------------------------------------------------- the release signal

# A rank whose process started a thread before rank_main blocks SIGUSR1, as
# torch's import does (a native thread of its own) in every torch-spawn rank:
# that thread does not block the signal.
_THREADED_RANK = """
import sys, threading, time
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
from fastspawn._bench.ranks import rank_main
fifo, bench_pid = sys.argv[1], int(sys.argv[2])
rank_main(0, (fifo, bench_pid, 7, (), b"", -1))
"""


class _OneRank(bench_session.Launched):
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def problem(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"the rank exited with status {code}"


def test_the_release_reaches_a_rank_whose_other_threads_do_not_block_it(tmp_path):
    reports = bench_session.Reports(str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", _THREADED_RANK, reports.path, str(os.getpid())])
    try:
        launched = _OneRank(proc)
        reports.wait(7, bench_ranks.ENTERED, 1, launched)
        launched.release([0])
        # Sent to the process, the signal would go to the sleeping thread and
        # kill the rank by its default action (exit status -SIGUSR1).
        assert proc.wait(timeout=60) == 0
        assert list(reports.wait(7, bench_ranks.EXITED, 1, None)) == [0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reports.close()
