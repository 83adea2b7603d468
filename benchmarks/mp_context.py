"""fastspawn's multiprocessing contexts against multiprocessing's own, with
torch imported: a torch DataLoader's epochs, a ProcessPoolExecutor's life
and one Process started and joined, per context, side by side in one run.

    python benchmarks/mp_context.py [--quick] [--contexts LIST] [--rounds R]
        [--processes N] [--json FILE]

The same run as ``fastspawn bench --mp`` (fastspawn._bench.mp_scenarios;
``--help`` lists the rows, metrics and sizes).  Each row is measured in a
fresh ``python -m fastspawn._bench.mp_child``, a minimal main module that
imports torch and fastspawn: multiprocessing's spawn and forkserver workers
re-import the caller's main module, which must not be this script's.  The
default run takes about 4 minutes on 2 cores; --quick well under one.
"""

from __future__ import annotations

import sys

from fastspawn._bench import mp_scenarios

if __name__ == "__main__":
    sys.exit(mp_scenarios.main(sys.argv[1:]))
