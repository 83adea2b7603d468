"""fastspawn bench --mp: a tiny run's table and JSON (their structure, never
their timings), its options, and its summary and goals on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastspawn._bench import mp_scenarios

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="the --mp scenarios import torch"
)

# The cheap rows, and one whose workers re-import the main module (spawn).
ROWS = ["floor", "mp-fork", "mp-spawn", "fastspawn"]


# Room for a loaded machine: CI runs this beside another test run (a quick
# run's spawn rows took 68 s there, when the limit was 110 s for all).
def bench_mp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastspawn", "bench", "--mp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@needs_torch
@pytest.mark.timeout(360)
def test_a_quick_run_prints_the_table_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    done = bench_mp("--quick", "--contexts", ",".join(ROWS), "--processes", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "CPU: " in text and "python -m fastspawn._bench.mp_child" in text
    assert "QUICK sizes" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    for row in ROWS:
        assert sum(line.startswith(row + " ") for line in text.splitlines()) == 2, row
    assert text.count("): not judged") == 4  # quick: the goals shown, none judged
    assert "round 1/1 mp-spawn" in done.stderr

    document: dict[str, Any] = json.loads(out.read_text())
    assert document["schema"] == mp_scenarios.SCHEMA_ID
    assert document["failed"] is None
    assert document["machine"]["cpu"] and document["machine"]["torch"]
    assert document["config"]["contexts"] == ROWS
    assert document["config"]["sizes"]["quick"] is True
    runs = {run["context"]: run for run in document["runs"]}
    assert sorted(runs) == sorted(ROWS) and len(document["runs"]) == len(ROWS)
    for name, run in runs.items():
        # Measured from the minimal main module, torch imported.
        assert run["main_module"] == document["config"]["child_main_module"]
        assert run["torch_imported"] is True
        slow = name in mp_scenarios.SLOW
        assert len(run["epochs_s"]) == (2 if slow else 3)
        assert len(run["process_s"]) == (1 if slow else 3)
        assert len(run["pool_s"]) == (0 if name == "floor" else 1 if slow else 2)
        assert all(t > 0 for t in run["epochs_s"] + run["pool_s"] + run["process_s"])
    assert runs["mp-spawn"]["start_method"] == "spawn"
    assert runs["fastspawn"]["start_method"] == "fastspawn"
    assert runs["floor"]["start_method"] is None
    metrics = {(s["context"], s["metric"]) for s in document["summary"]}
    assert ("floor", "pool") not in metrics
    assert {(row, "warm_epoch") for row in ROWS} <= metrics
    for stats in document["summary"]:
        assert stats["min_s"] <= stats["median_s"] <= stats["max_s"]
        if stats["context"] == "mp-fork":
            assert stats["over_fork"] == pytest.approx(1.0)
    assert [g["met"] for g in document["goals"]] == [None] * 4


def test_bad_options_exit_2() -> None:
    done = bench_mp("--contexts", "mp-fork,nonsense", timeout=30)
    assert done.returncode == 2
    assert "'nonsense'" in done.stderr and "mp-forkserver" in done.stderr
    done = bench_mp("--rounds", "0", timeout=30)
    assert done.returncode == 2


def test_help_lists_the_rows_and_the_main_help_names_the_mode() -> None:
    done = bench_mp("--help", timeout=30)
    assert done.returncode == 0
    for row in mp_scenarios.CONTEXTS:
        assert row in done.stdout
    main_help = subprocess.run(
        [sys.executable, "-m", "fastspawn", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "--mp" in main_help.stdout


def _run(name: str, epochs: list[float], pool: list[float], process: list[float]) -> Any:
    return {"context": name, "epochs_s": epochs, "pool_s": pool, "process_s": process}


def test_summary_ratios_and_goals_on_made_up_runs() -> None:
    runs = [
        _run("floor", [0.01, 0.01], [], [0.001, 0.001]),
        _run("mp-fork", [0.3, 0.2, 0.2], [0.1], [0.002]),
        _run("mp-forkserver", [9.0, 8.0], [3.0], [1.0]),
        _run("fastspawn", [2.0, 0.25, 0.25], [0.2], [0.004]),
    ]
    contexts = ["floor", "mp-fork", "mp-forkserver", "fastspawn"]
    summary = mp_scenarios.summarize(runs, contexts)
    stats = {(s["context"], s["metric"]): s for s in summary}
    assert stats[("fastspawn", "first_epoch")]["median_s"] == 2.0
    assert stats[("fastspawn", "warm_epoch")]["over_fork"] == pytest.approx(1.25)
    assert stats[("fastspawn", "warm_epoch")]["forkserver_over"] == pytest.approx(32.0)
    assert stats[("fastspawn", "process")]["over_floor"] == pytest.approx(4.0)
    assert stats[("fastspawn", "pool")]["over_floor"] is None
    goals = mp_scenarios.judge(summary, quick=False)
    assert [g["met"] for g in goals] == [True, True, False, True]  # pool: 2x fork's
    assert goals[2]["measured"] == pytest.approx(2.0)
    sizes = mp_scenarios.Sizes(False, None, None)
    text = mp_scenarios.format_report(
        summary,
        goals,
        contexts,
        sizes,
        {"cpu": "X", "usable_cores": 2, "python": "3", "torch": "t", "fastspawn": "f"},
    )
    assert "NOT MET" in text and text.count(": met") == 3
