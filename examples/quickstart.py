"""Eight workers, each told its rank; one result per rank comes back."""

import os

import fastspawn


def work(rank: int, greeting: str) -> str:
    return f"{greeting} from rank {rank} (pid {os.getpid()}, MY_RANK={os.environ['MY_RANK']})"


if __name__ == "__main__":
    ctx = fastspawn.start_processes(
        work,
        args=("hello",),
        nprocs=8,
        envs={rank: {"MY_RANK": str(rank)} for rank in range(8)},
    )
    for _rank, line in sorted(ctx.return_values.items()):
        print(line)
