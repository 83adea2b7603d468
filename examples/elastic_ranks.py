"""fastspawn.elastic: binary ranks and function ranks, TorchElastic's way.

Each rank's output goes to a log file under its log directory (with tee, to
the console too, prefixed with the rank); a rank's return value or failure
comes back in the RunProcsResult.
"""

import os
import tempfile

from fastspawn.elastic import Std, start_processes


def square(n: int) -> int:
    print(f"squaring {n}")
    return n * n


if __name__ == "__main__":  # ranks start from the zygote, which imports this script
    with tempfile.TemporaryDirectory() as logs:
        for name in ("echo", "square"):
            os.mkdir(os.path.join(logs, name))  # each log_dir must exist and be empty

        # Binary ranks: each its own program, in a session of its own.
        echo = start_processes(
            "echo",
            "/bin/echo",
            args={0: ("hello",), 1: ("world",)},
            envs={0: {}, 1: {}},
            log_dir=os.path.join(logs, "echo"),
            tee=Std.OUT,
        )
        print("echo failures:", echo.wait().failures)

        # Function ranks: entrypoint(*args[rank]) in a zygote worker.
        squares = start_processes(
            "square",
            square,
            args={rank: (rank + 2,) for rank in range(3)},
            envs={rank: {} for rank in range(3)},
            log_dir=os.path.join(logs, "square"),
            redirects=Std.ALL,
        )
        result = squares.wait()
        print("squares:", dict(sorted(result.return_values.items())))
        with open(result.stdouts[1]) as log:
            print("rank 1 logged:", log.read().strip())
