"""A module whose import costs SLOW_IMPORT_SECONDS (SPEC section 2, item 13)."""

import os
import time

SECONDS = float(os.environ.get("SLOW_IMPORT_SECONDS", "5"))
BEGAN = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
time.sleep(SECONDS)
ENDED = time.monotonic()


def use(rank: int) -> tuple[float, float, float]:
    """The import's cost and when the import this rank relies on ran."""
    return SECONDS, BEGAN, ENDED
