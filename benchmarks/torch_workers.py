"""A training-script-like module: it imports torch at the top, as user code does."""

import time

import torch  # noqa: F401  (the cost being measured)


def entry_time(rank: int) -> float:
    return time.monotonic()
