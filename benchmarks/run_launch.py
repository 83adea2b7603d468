"""Entry script of the launch benchmark: prints the table of benchmarks/README.md.

    python benchmarks/run_launch.py [--methods ...] [--nprocs ...] [--rounds N] [--json FILE]

Kept nearly empty on purpose.  A worker started with "spawn" (either
launcher) or by multiprocessing's "forkserver" re-runs the main module as
``__mp_main__``; the import below sits under the ``__main__`` guard so that
re-run costs the workers only runpy itself, as a well-behaved main module
would.  A heavier main module slows exactly those cases down.
"""

if __name__ == "__main__":
    from launch_timing import main

    main()
