"""One multiprocessing Process at a time from fastspawn's context, with
torch imported: start to join, back to back and with a gap between starts,
so that ready workers made in the background (or not, with
FASTSPAWN_READY=0) show what they change for a loop of single starts.

    python benchmarks/process_starts.py [--starts 150] [--gap 0.03]
    FASTSPAWN_READY=0 python benchmarks/process_starts.py

This file is the main module: small, as a minimal main module should be
(fastspawn's workers import it as ``__mp_main__``).  Prints the median of
each loop in milliseconds; run both settings in turn, several times, on
the same machine, and compare.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch  # noqa: F401  (the zygote and the caller as a torch user has them)

from fastspawn._bench.mp_child import get_context, process_loop


def loop(ctx: object, starts: int, gap: float) -> float:
    """Median milliseconds from Process() to a joined exit, over ``starts``."""
    return statistics.median(process_loop(ctx, starts, gap)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=150, help="starts per loop")
    parser.add_argument("--gap", type=float, default=0.03, help="seconds between starts")
    options = parser.parse_args()
    ctx = get_context("fastspawn")
    loop(ctx, 20, 0)  # the zygote up, torch preloaded in it
    back_to_back = loop(ctx, options.starts, 0)
    gapped = loop(ctx, options.starts, options.gap)
    setting = os.environ.get("FASTSPAWN_READY", "default")
    print(
        f"FASTSPAWN_READY={setting}: back to back {back_to_back:.2f} ms, "
        f"{options.gap * 1e3:g} ms apart {gapped:.2f} ms (medians of {options.starts})"
    )


if __name__ == "__main__":
    main()
