"""``fastspawn`` on the command line: ``fastspawn run`` (and ``python -m
fastspawn run``) starts N ranks of a program per node, torchrun-style;
``fastspawn stacks`` and ``fastspawn bench``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from fastspawn._cli import stacks as cli_stacks
from fastspawn._cli.options import (
    RUN_DESCRIPTION,
    RUN_EPILOG,
    UsageError,
    _seconds,
    run_parser,
)
from fastspawn._cli.restart import run
from fastspawn._launch import stacks as _stacks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastspawn", description="fastspawn: orphan-safe, fast process launching."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="start N ranks of a program",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_parser(run)
    run.set_defaults(command_parser=run)  # for the usage errors found after parsing
    stacks = commands.add_parser(
        "stacks",
        help="print the Python stacks of every rank of a running job",
        description="Print the Python stacks of every thread of every rank below process "
        "PID: a `fastspawn run`, or a program that started ranks with fastspawn (only "
        "this user's processes).  The ranks keep running.",
    )
    stacks.add_argument(
        "pid",
        type=cli_stacks.process_id,
        metavar="PID",
        help="the process whose ranks to show: a fastspawn run, or any program of this user's "
        "that started ranks with fastspawn",
    )
    stacks.add_argument(
        "--timeout",
        type=_seconds,
        default=_stacks.DEMAND_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the ranks' answers (default {_stacks.DEMAND_TIMEOUT:g})",
    )
    bench = commands.add_parser(
        "bench", help="measure launch overhead on this machine", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def _package_version() -> str:
    from fastspawn import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser().print_help()  # no command: what there is to run
        return 2
    if argv and argv[0] == "bench":
        from fastspawn._bench.main import main as bench_main

        return int(bench_main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "stacks":
        return cli_stacks.stacks_command(args.pid, args.timeout)
    try:
        return run(args)
    except UsageError as exc:
        parser: argparse.ArgumentParser = args.command_parser
        parser.error(str(exc))  # exits 2


def console_main() -> None:
    # `fastspawn bench | head` ends quietly, as Unix tools do.  `fastspawn
    # run` keeps Python's handling: its tee stops writing to a console that
    # went away (| head -1) and the run goes on, with every line in the logs,
    # rather than the launcher dying and taking the ranks with it.
    if sys.argv[1:2] == ["bench"]:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
