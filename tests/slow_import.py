"""A module whose import costs SLOW_IMPORT_SECONDS (SPEC section 2, item 13)."""

import os
import time

SECONDS = float(os.environ.get("SLOW_IMPORT_SECONDS", "5"))
time.sleep(SECONDS)


def use(rank: int) -> float:
    return SECONDS
