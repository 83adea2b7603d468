"""Orphans of multiprocessing's objects on fastspawn's contexts: SIGKILL of
the caller (or of the zygote, whose children the workers are) leaves no
Pool worker, executor worker, DataLoader worker (one blocked in a dataset
call, one blocked writing to a full pipe) or ``ctx.Process`` child (nor a
Process it started), nor any of their own children (within
helpers.KILL_BOUND_S); on every method the contexts offer.  While the
caller lives, a Process that ended leaves its own processes running, as
multiprocessing does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import KILL_BOUND_S, alive_after, gone, kill_driver

# The kill chain is the kernel's and fastspawn's, the same under every
# CPython: CI runs these (about 70 s) on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

METHODS = ["fastspawn", "fastspawn-fork", "fastspawn-spawn", "fastspawn-forkserver"]

# The caller: starts `WORKERS` workers of one kind, each of which starts a
# `sleep` of its own and records "worker-pid child-pid" as a file in the
# folder, then blocks; the caller prints every pid and waits to be killed.
DRIVER = """
import os, signal, subprocess, sys, time
from pathlib import Path
import fastspawn

WORKERS = 2
FOLDER = Path(sys.argv[3])


def block(_item=None):
    child = subprocess.Popen(["sleep", "600"])
    (FOLDER / f"{os.getpid()}-{child.pid}").touch()
    time.sleep(600)


def nest(_item=None):
    import multiprocessing

    grandchild = multiprocessing.Process(target=block)  # the context the caller's was
    grandchild.start()
    (FOLDER / f"{os.getpid()}-{grandchild.pid}").touch()
    time.sleep(600)


def start_and_end(_item=None):
    import multiprocessing

    grandchild = multiprocessing.Process(target=block)  # the context the caller's was
    grandchild.start()
    child = subprocess.Popen(["sleep", "600"])
    (FOLDER / f"{grandchild.pid}-{child.pid}.own").touch()  # .own: not block()'s name
    while len([p for p in FOLDER.iterdir() if p.name.startswith(f"{grandchild.pid}-")]) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)  # ends as Process.terminate() ends it


def flood(_item=None):
    return b"x" * (1 << 20)  # a worker blocks writing these to the full pipe


class Blocking:
    def __len__(self):
        return 64

    def __getitem__(self, index):
        block()


class Flooding:
    def __len__(self):
        return 1 << 20

    def __getitem__(self, index):
        if not any(p.name.startswith(f"{os.getpid()}-") for p in FOLDER.iterdir()):
            child = subprocess.Popen(["sleep", "600"])
            (FOLDER / f"{os.getpid()}-{child.pid}").touch()
        return flood()


def start(kind, ctx):
    if kind in ("process", "nested", "parent-ended"):
        target = {"process": block, "nested": nest, "parent-ended": start_and_end}[kind]
        procs = [ctx.Process(target=target) for _ in range(WORKERS)]
        for proc in procs:
            proc.start()
        return procs
    if kind == "pool":
        pool = ctx.Pool(WORKERS)
        pool.map_async(block, range(WORKERS), chunksize=1)
        return pool
    if kind == "executor":
        from concurrent.futures import ProcessPoolExecutor

        executor = ProcessPoolExecutor(WORKERS, mp_context=ctx)
        for _ in range(WORKERS):
            executor.submit(block)
        return executor
    from torch.utils.data import DataLoader

    dataset = Blocking() if kind == "dataloader" else Flooding()
    loader = DataLoader(dataset, num_workers=WORKERS, multiprocessing_context=ctx,
                        batch_size=None, prefetch_factor=64)
    iterator = iter(loader)
    if kind == "dataloader-full-pipe":
        next(iterator)  # then read no more: the workers fill the pipe and block
    return iterator


if __name__ == "__main__":
    kind, method = sys.argv[1], sys.argv[2]
    keep = start(kind, fastspawn.get_context(method))
    files = 2 * WORKERS if kind in ("nested", "parent-ended") else WORKERS
    deadline = time.monotonic() + 120
    while len(list(FOLDER.iterdir())) < files and time.monotonic() < deadline:
        time.sleep(0.05)
    if kind == "parent-ended":
        for proc in keep:
            proc.join(60)
            assert proc.exitcode == -signal.SIGTERM, proc
    pids = sorted({int(pid) for path in FOLDER.iterdir() for pid in path.stem.split("-")})
    print(" ".join(map(str, pids)), flush=True)
    from fastspawn._zygote import client

    print(client.zygote_pid() or 0, flush=True)
    time.sleep(600)
"""


def _driver(tmp_path: Path, kind: str, method: str) -> tuple[subprocess.Popen[str], list[int], int]:
    """The driver running ``kind`` on ``method``'s context: (driver, the pids
    of its 2 workers and their children, the zygote's pid or 0)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    folder = tmp_path / "pids"
    folder.mkdir()
    driver = subprocess.Popen(
        [sys.executable, str(script), kind, method, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert driver.stdout is not None
    pids = [int(word) for word in driver.stdout.readline().split()]
    zygote = int(driver.stdout.readline() or 0)
    return driver, pids, zygote


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "kind", ["process", "nested", "pool", "executor", "dataloader", "dataloader-full-pipe"]
)
def test_sigkill_of_caller_leaves_no_worker_nor_its_child(tmp_path, kind, method):
    """("nested": each worker is a Process that started a Process of its
    own, which started the sleep: 3 levels.)"""
    if kind.startswith("dataloader"):
        pytest.importorskip("torch")
    driver, pids, _zygote = _driver(tmp_path, kind, method)
    expected = 6 if kind == "nested" else 4
    try:
        assert len(pids) == expected, f"the driver did not report every process: {pids}"
        assert not any(gone(pid) for pid in pids), "a worker or its child ended before the kill"
        if kind == "dataloader-full-pipe":
            time.sleep(0.5)  # the workers fill the pipe and block on it
    finally:
        kill_driver(driver)
    alive = alive_after(pids)
    assert alive == [], (
        f"alive {KILL_BOUND_S:g} s after SIGKILL of the caller ({kind}, {method}): {alive}"
    )


@pytest.mark.parametrize("method", ["fastspawn", "fastspawn-forkserver"])
@pytest.mark.parametrize("kind", ["process", "pool"])
def test_sigkill_of_zygote_leaves_no_worker_nor_its_child(tmp_path, kind, method):
    """The workers are the zygote's children: they, and theirs, go with it
    (a Pool then starts new ones, from a new zygote)."""
    driver, pids, zygote = _driver(tmp_path, kind, method)
    try:
        assert len(pids) == 4 and zygote, (pids, zygote)
        assert not any(gone(pid) for pid in pids), "a worker or its child ended before the kill"
        os.kill(zygote, signal.SIGKILL)
        alive = alive_after(pids)
        assert alive == [], (
            f"alive {KILL_BOUND_S:g} s after SIGKILL of the zygote ({kind}, {method}): {alive}"
        )
    finally:
        kill_driver(driver)


@pytest.mark.parametrize("method", METHODS)
def test_processes_of_an_ended_process_live_while_the_caller_does(tmp_path, method):
    """Each worker starts a Process and a `sleep`, then dies of SIGTERM: as
    under multiprocessing, both outlive it while the caller lives (with the
    zygote's contexts the Process comes from the zygote, and the sleep is an
    orphan the zygote keeps; with fork and spawn both stay in the worker's
    process group, which the caller's warden watches until it is empty).
    SIGKILL of the caller then leaves none of them."""
    driver, pids, _zygote = _driver(tmp_path, "parent-ended", method)
    try:
        assert len(pids) == 6, f"the driver did not report every process: {pids}"
        time.sleep(1.0)  # a wrong kill would have landed by now
        dead = sorted(pid for pid in pids if gone(pid))
        assert dead == [], f"killed while the caller lives ({method}): {dead}"
    finally:
        kill_driver(driver)
    alive = alive_after(pids)
    assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the caller ({method}): {alive}"
