"""Every example in examples/ runs as its docstring says, and prints what it
claims."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # What the example (or torch in it) puts in the temp dir stays in the test's.
    env = {**os.environ, "TMPDIR": str(cwd)}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_quickstart(tmp_path):
    done = _run(str(EXAMPLES / "quickstart.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8
    assert all(line.startswith(f"hello from rank {rank} ") for rank, line in enumerate(lines))


def test_elastic_ranks(tmp_path):
    done = _run(str(EXAMPLES / "elastic_ranks.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[echo0]:hello" in done.stdout and "[echo1]:world" in done.stdout
    assert "echo failures: {}" in done.stdout
    assert "squares: {0: 4, 1: 9, 2: 16}" in done.stdout
    assert "rank 1 logged: squaring 3" in done.stdout


def test_patch_torch(tmp_path):
    pytest.importorskip("torch.multiprocessing")
    done = _run(str(EXAMPLES / "patch_torch.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "results: {0: 0.0, 1: 3.0, 2: 6.0, 3: 9.0}" in done.stdout
    assert "spawn is fastspawn's: True" in done.stdout


def test_ddp_train_under_fastspawn_run(tmp_path):
    pytest.importorskip("torch.distributed")
    script = str(EXAMPLES / "ddp_train.py")
    done = _run("-m", "fastspawn", "run", "--nprocs-per-node", "2", script, "--steps", "3",
                cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "step 2 loss" in done.stdout and "(world size 2)" in done.stdout
    assert "replicas identical: True" in done.stdout
