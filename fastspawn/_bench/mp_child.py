"""The minimal main module of ``fastspawn bench --mp``: one context's
measurements, in a fresh interpreter started as ``python -m`` on this module.

Its top level is what a small DataLoader program's main module holds: torch
and fastspawn imported, a Dataset and the workers' functions defined.
multiprocessing's spawn and forkserver workers re-import the caller's main
module (as ``__mp_main__``), and fastspawn's zygote imports it once, so each
of them imports exactly this: torch, fastspawn, nothing of the bench.  The
measuring code below runs only as ``__main__`` and imports what it needs
inside the functions.

Usage: ``python -m fastspawn._bench.mp_child CONTEXT CONFIG_JSON OUT_FILE``;
``mp_scenarios`` starts it, reads OUT_FILE (JSON: the samples, in seconds).
"""

from __future__ import annotations

import os
import struct
import time

import torch
from torch.utils.data import DataLoader, Dataset

import fastspawn  # registers fastspawn's contexts with multiprocessing

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# The row measured without any context: a bare fork loop, an in-process loader.
FLOOR_ROW = "floor"
MP_PREFIX = "mp-"  # mp-<multiprocessing's method>; the others are fastspawn's names


# Without torch installed (the type check's first pass), Dataset is Any to
# mypy, and subclassing Any is an error there; with it, the ignore is unused.
class Items(Dataset[torch.Tensor]):  # type: ignore[misc,unused-ignore]
    """``n`` small items: item ``i`` is ``torch.tensor([i])``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def trivial(x: int = 0) -> int:
    """What the pool's tasks and the processes run."""
    return x


def get_context(name: str) -> Any:
    """multiprocessing's context for a row name: ``mp-fork`` is
    multiprocessing's "fork"; fastspawn's names ("fastspawn",
    "fastspawn-fork", ...) are multiprocessing's too once fastspawn is
    imported."""
    import multiprocessing

    return multiprocessing.get_context(name.removeprefix(MP_PREFIX))


def loader_epochs(ctx: Any, config: dict[str, int]) -> list[float]:
    """Seconds per epoch of a non-persistent DataLoader (new workers every
    epoch); ``ctx`` None: in this process (num_workers=0)."""
    workers = config["workers"] if ctx is not None else 0
    loader = DataLoader(
        Items(config["items"]),
        batch_size=config["batch"],
        num_workers=workers,
        multiprocessing_context=ctx,
        persistent_workers=False,
    )
    expected = config["items"] * (config["items"] - 1) // 2
    times = []
    for _ in range(config["epochs"]):
        t0 = time.perf_counter()
        total = 0
        for batch in loader:
            total += int(batch.sum())
        times.append(time.perf_counter() - t0)
        if total != expected:
            raise RuntimeError(f"an epoch summed to {total}, not {expected}")
    return times


def pool_runs(ctx: Any, config: dict[str, int]) -> list[float]:
    """Seconds from a ProcessPoolExecutor's creation to its results in and
    its shutdown done."""
    from concurrent.futures import ProcessPoolExecutor

    results = config["pool_results"]
    times = []
    for _ in range(config["pool_repeats"]):
        t0 = time.perf_counter()
        with ProcessPoolExecutor(config["pool_workers"], mp_context=ctx) as pool:
            got = list(pool.map(trivial, range(results)))
        times.append(time.perf_counter() - t0)
        if got != list(range(results)):
            raise RuntimeError(f"the pool returned {got[:8]}...")
    return times


def process_loop(ctx: Any, n: int, gap: float = 0.0) -> list[float]:
    """Seconds per ``ctx.Process(target=trivial)``: start, join, close;
    ``gap`` seconds between one's close and the next start (untimed)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        proc = ctx.Process(target=trivial)
        proc.start()
        proc.join()
        times.append(time.perf_counter() - t0)
        if proc.exitcode != 0:
            raise RuntimeError(f"a process exited with {proc.exitcode}")
        proc.close()
        if gap:
            time.sleep(gap)
    return times


def stamp_entry(fifo: str) -> None:
    """target_loop's target: the time of its first line (time.monotonic(),
    one clock for every process of the machine), written to ``fifo``."""
    entered = time.monotonic()
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.write(fd, _STAMP.pack(entered))
    finally:
        os.close(fd)


_STAMP = struct.Struct("=d")


def target_loop(
    ctx: Any, n: int, gap: float = 0.0, before: Callable[[], object] | None = None
) -> list[tuple[float, float, float]]:
    """Per ``ctx.Process(target=stamp_entry)``: (seconds from Process() to
    start()'s return, to the target's first line, to the joined exit);
    ``gap`` seconds between one's close and the next start, ``before()``
    called before each start (both untimed).  The stamps come through a
    FIFO in a private temporary directory, removed on the way out."""
    import tempfile

    samples = []
    with tempfile.TemporaryDirectory(prefix="fastspawn-starts-") as folder:
        fifo = os.path.join(folder, "entered")
        os.mkfifo(fifo, 0o600)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        # Held open: a target's close is then no end of file for the next.
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            for _ in range(n):
                if before is not None:
                    before()
                t0 = time.monotonic()
                proc = ctx.Process(target=stamp_entry, args=(fifo,))
                proc.start()
                started = time.monotonic()
                proc.join()
                joined = time.monotonic()
                if proc.exitcode != 0:
                    raise RuntimeError(f"a process exited with {proc.exitcode}")
                proc.close()
                try:
                    stamp = os.read(reader, _STAMP.size)
                except BlockingIOError:
                    stamp = b""
                if len(stamp) != _STAMP.size:
                    raise RuntimeError("a process exited 0 without writing its stamp")
                (entered,) = _STAMP.unpack(stamp)
                samples.append((started - t0, entered - t0, joined - t0))
                if gap:
                    time.sleep(gap)
        finally:
            os.close(writer)
            os.close(reader)
    return samples


def fork_loop(n: int) -> list[float]:
    """The floor: seconds per bare ``os.fork()``, ``os._exit(0)`` in the
    child, ``waitpid`` here, from this process (torch imported)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, config: dict[str, int]) -> dict[str, Any]:
    """One context's samples: the loader's epochs (the first one cold: the
    zygote or forkserver starts in it), the pool's runs, the processes."""
    import gc
    import sys

    fastspawn.stop_zygote()  # none runs in a fresh process; cold whatever
    ctx = None if name == FLOOR_ROW else get_context(name)
    gc.collect()
    epochs = loader_epochs(ctx, config)
    gc.collect()
    pool = pool_runs(ctx, config) if ctx is not None else []
    gc.collect()
    processes = (
        fork_loop(config["process_n"]) if ctx is None else process_loop(ctx, config["process_n"])
    )
    return {
        "context": name,
        "start_method": None if ctx is None else ctx.get_start_method(),
        "epochs_s": epochs,
        "pool_s": pool,
        "process_s": processes,
        "torch": torch.__version__,
        "torch_imported": "torch" in sys.modules,
        "main_module": __spec__.name if __spec__ is not None else None,
    }


def main(argv: list[str]) -> int:
    import json
    import warnings

    # torch's "this DataLoader will create 8 worker processes in total. Our
    # suggested max number of worker in current system is 2": so it is.
    warnings.filterwarnings("ignore", message=r".*worker processes in total")
    name, config, out = argv
    result = measure(name, json.loads(config))
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
