"""pytest-benchmark entry of the launch benchmark (see launch_timing.py).

    pytest benchmarks/bench_launch.py

The file name does not match pytest's ``test_*.py``, and pyproject's
testpaths is ``["tests"]``: only naming this file on the command line runs it.

Each case (start method x nprocs) runs ``run_launch.py`` in a fresh
interpreter.  Under pytest the main module is the pytest script, and a
spawned worker of either launcher (or one from multiprocessing's fork
server) re-runs the main module: every such rank would import pytest
(~0.1 s here), which would swamp the launchers' own startup cost.
run_launch.py imports nothing when re-run that way.

What the case reports is in ``benchmark.extra_info`` (medians in seconds,
also in ``--benchmark-json``) and in the "launch latency medians" table at
the end of the run.  pytest-benchmark's own time columns are the wall time
of the whole case (warm-up plus every interleaved round, deadline sleeps
included): not a latency.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from launch_timing import DEFAULT_ROUNDS, NPROCS, START_METHODS, Result
from pytest_benchmark.fixture import BenchmarkFixture

SCRIPT = Path(__file__).with_name("run_launch.py")


def _run_case(method: str, nprocs: int, rounds: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="fastspawn-bench-") as tmp:
        out = Path(tmp) / "result.json"
        # On timeout subprocess.run SIGKILLs the interpreter; its fastspawn
        # workers die with it (PDEATHSIG), multiprocessing's return at their
        # deadline and its fork server / resource tracker exit on EOF.
        argv = [sys.executable, str(SCRIPT), "--methods", method, "--nprocs", str(nprocs)]
        argv += ["--rounds", str(rounds), "--json", str(out)]
        proc = subprocess.run(
            argv,
            check=False,  # a failure raises below, with the script's stderr
            capture_output=True,
            text=True,
            timeout=540,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"run_launch.py failed ({proc.returncode}):\n{proc.stderr}")
        (data,) = json.loads(out.read_text())["results"]
    return Result.from_json(data)


@pytest.mark.timeout(600)  # a 64-rank spawn case takes minutes on 2 cores
@pytest.mark.parametrize("nprocs", NPROCS)
@pytest.mark.parametrize("method", START_METHODS)
def test_launch_latency(
    benchmark: BenchmarkFixture, method: str, nprocs: int, launch_results: list[Result]
) -> None:
    rounds = DEFAULT_ROUNDS[nprocs]
    # One pedantic round = the whole interleaved measurement of this case.
    result: Result = benchmark.pedantic(  # type: ignore[no-untyped-call]
        _run_case, args=(method, nprocs, rounds), rounds=1
    )
    benchmark.extra_info.update(result.summary())
    launch_results.append(result)
