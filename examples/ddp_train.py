r"""A DistributedDataParallel training script for `fastspawn run` (as for torchrun):

    fastspawn run --nproc-per-node 2 examples/ddp_train.py --steps 5
    fastspawn run --preload torch --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29400 --rdzv-id job1 examples/ddp_train.py   # on each node

Each rank reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from its
environment (set by fastspawn run), joins the gloo process group, trains a
small model on its own shard of a synthetic data set, and rank 0 prints the
loss.  CPU only: no GPU needed.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--stamp",
        action="store_true",
        help="each rank prints the time it is past init_process_group (for benchmarks)",
    )
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run me with fastspawn run (or torchrun), which sets RANK and the rest")

    dist.init_process_group("gloo")  # env:// from fastspawn run's variables
    if args.stamp:
        print(f"past init_process_group {time.time():.6f}\n", end="", flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard
    inputs = torch.randn(64, 4, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()  # gradients are averaged across the ranks here
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} (world size {world})", flush=True)

    # DDP keeps the replicas identical: every rank ends with rank 0's weights.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if rank == 0:
        same = all(torch.equal(gathered[0], other) for other in gathered[1:])
        print(f"replicas identical: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
