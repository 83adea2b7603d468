"""Existing torch code, unchanged but for one line: torch.multiprocessing's
spawn and start_processes become fastspawn's (zygote workers, orphan-safe).

    python examples/patch_torch.py
"""

import os

import torch
import torch.multiprocessing as mp

import fastspawn


def worker(rank: int, results: "mp.SimpleQueue[tuple[int, float]]") -> None:
    # Each rank computes on its own tensor and reports through a queue.
    value = torch.full((3,), float(rank)).sum().item()
    results.put((rank, value))


if __name__ == "__main__":
    fastspawn.patch_torch()  # the one line
    queue = mp.get_context("spawn").SimpleQueue()
    context = mp.spawn(worker, args=(queue,), nprocs=4, join=True)
    results = dict(queue.get() for _ in range(4))
    print(f"results: {dict(sorted(results.items()))}")
    print(f"spawn is fastspawn's: {mp.spawn is fastspawn.spawn}, pid {os.getpid()}")
