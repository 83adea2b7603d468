"""What every part of the bench names: the methods, the baselines, the
schema's id, and the bench's two errors."""

from __future__ import annotations

SCHEMA_ID = "fastspawn-bench/3"
BASELINE = "mp-spawn"
BINARY_BASELINE = "binary-popen"
FLOOR = "floor"

# name -> what it runs (for --help)
METHOD_HELP: dict[str, str] = {
    "fastspawn-zygote-warm": (
        'fastspawn.start_processes(start_method="zygote"), zygote running, every rank '
        "forked at launch (ready workers off)"
    ),
    "fastspawn-zygote-ready": "the same after fastspawn.prefork(nprocs): ranks from ready workers",
    "fastspawn-zygote-refilled": (
        "the second of two same-size launches, no prefork(): ranks from the workers the "
        "zygote made ready in the background"
    ),
    "fastspawn-zygote-cold": "the same after fastspawn.stop_zygote(): the launch starts it",
    "fastspawn-spawn": 'fastspawn.start_processes(start_method="spawn")',
    "fastspawn-fork": 'fastspawn.start_processes(start_method="fork")',
    "fastspawn-forkserver": 'fastspawn.start_processes(start_method="forkserver")',
    "mp-spawn": "multiprocessing spawn context: a Process per rank, start all, join all",
    "mp-fork": "the same with the fork context",
    "mp-forkserver": "the same with the forkserver context (preloading the fn's module)",
    "torch-spawn": "torch.multiprocessing.spawn(join=False) (each rank imports torch)",
    "floor": "a bare os.fork() loop in a small helper interpreter: the floor (see below)",
    "floor-sized": "the same loop in a helper the zygote's size (its modules, gc.freeze())",
    "floor-preforked": "floor's ranks forked ahead (untimed), each woken by one write",
    "floor-preforked-sized": "the same from floor-sized's helper",
    "binary-fastspawn": "fastspawn.elastic.start_processes with true(1) as the entrypoint",
    "binary-popen": 'subprocess.Popen(["true"])',
    "binary-popen-pdeathsig": "the same with a preexec_fn that sets PR_SET_PDEATHSIG",
}
ALL_METHODS: tuple[str, ...] = tuple(METHOD_HELP)
GROUPS: dict[str, list[str]] = {}
for _name in ALL_METHODS:
    GROUPS.setdefault(_name.split("-", 1)[0], []).append(_name)
del _name


class BenchError(Exception):
    """A round could not be measured: a rank died, a launch failed, ..."""


class UsageError(Exception):
    """Bad options, or a sweep this machine cannot run: exit status 2."""


class RoundFailed(BenchError):
    """A measured round failed; the rounds before it stand."""

    def __init__(self, method: str, nprocs: int, round_no: int, kind: str, why: str) -> None:
        when = "the warm-up" if round_no < 0 else f"round {round_no + 1}"
        what = f"{method} with nprocs={nprocs}, {when}"
        super().__init__(f"{what}{' (failure round)' if kind == 'failure' else ''}: {why}")
        self.method = method
        self.nprocs = nprocs
        self.round_no = round_no
        self.kind = kind
        self.why = why
