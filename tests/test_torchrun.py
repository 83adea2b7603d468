"""fastspawn run as a faster torchrun: torchrun's options, Python ranks from
the zygote, and (with torch) torch's own elastic agent across nodes."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import gone

from fastspawn._cli import main as cli_main
from fastspawn._cli import options, topology

NODE_TIMEOUT = 240  # seconds a node of a torch job gets, on a loaded 2-core machine


def fastspawn_run(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    # TMPDIR: what torch or the launcher put in the temp dir stays in the test's.
    return subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(cwd), **(env or {})},
    )


def write(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


# ---------------------------------------------------------------- options


def test_torchrun_spellings_parse_alike():
    parser = cli_main.build_parser()
    dashed = parser.parse_args(
        ["run", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
         "--rdzv-id", "j", "--rdzv-conf", "a=1", "--max-restarts", "3", "--monitor-interval",
         "0.5", "--local-addr", "10.0.0.1", "--log-dir", "d", "--local-ranks-filter", "0,1",
         "--no-python", "--node-rank", "1", "--master-addr", "m", "--master-port", "5", "prog"]
    )  # fmt: skip
    underscored = parser.parse_args(
        ["run", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1",
         "--rdzv_id", "j", "--rdzv_conf", "a=1", "--max_restarts", "3", "--monitor_interval",
         "0.5", "--local_addr", "10.0.0.1", "--log_dir", "d", "--local_ranks_filter", "0,1",
         "--no_python", "--node_rank", "1", "--master_addr", "m", "--master_port", "5", "prog"]
    )  # fmt: skip
    assert vars(dashed) == vars(underscored)
    assert dashed.nproc_per_node == 2 and dashed.rdzv_conf == "a=1"
    assert dashed.local_ranks_filter == {0, 1} and dashed.monitor_interval == 0.5
    ours = parser.parse_args(["run", "--nprocs-per-node", "3", "-r", "3", "-t", "1", "x"])
    assert ours.nproc_per_node == 3 and int(ours.redirects) == 3 and int(ours.tee) == 1
    module = parser.parse_args(["run", "-m", "pkg.train", "--epochs", "2"])
    assert module.module and module.program == "pkg.train"
    assert module.program_args == ["--epochs", "2"]
    assert parser.parse_args(["run", "x"]).nproc_per_node == 1  # torchrun's default


def test_nnodes_takes_a_range():
    assert options.parse_nnodes("2") == (2, 2)
    assert options.parse_nnodes("1:4") == (1, 4)
    for bad in ["0", "3:2", "1:2:3", "x"]:
        with pytest.raises(ValueError):
            options.parse_nnodes(bad)
    parser = cli_main.build_parser()
    assert topology.wants_agent(parser.parse_args(["run", "--nnodes", "1:2", "x"]))
    assert topology.wants_agent(parser.parse_args(["run", "--standalone", "x"]))
    assert topology.wants_agent(parser.parse_args(["run", "--rdzv-backend", "c10d", "x"]))
    assert not topology.wants_agent(parser.parse_args(["run", "--nnodes", "2", "x"]))


def test_torchs_own_configuration_reads_our_options(tmp_path, monkeypatch):
    torchrun = pytest.importorskip("torch.distributed.run")
    from fastspawn._torch import torchrun as _torchrun

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it here
    args = cli_main.build_parser().parse_args(
        ["run", "--nnodes", "1:3", "--rdzv_backend", "c10d", "--rdzv-endpoint", "h:29400",
         "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=5,last_call_timeout=1",
         "--max-restarts", "2", "--monitor-interval", "0.5", "--role", "trainer",
         "--tee", "0:1,1:3", "--local-ranks-filter", "1", "--log-dir", str(tmp_path), "x.py"]
    )  # fmt: skip
    namespace = _torchrun.torch_args(args, 2, torchrun)
    config, _cmd, _args = torchrun.config_from_args(namespace)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 3, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "h:29400", "job7")
    assert config.rdzv_configs == {"join_timeout": "5", "last_call_timeout": "1", "timeout": 900}
    assert (config.max_restarts, config.monitor_interval, config.role) == (2, 0.5, "trainer")
    assert config.logs_specs.root_log_dir == str(tmp_path)
    assert _torchrun.restarts_possible(namespace)
    fixed = cli_main.build_parser().parse_args(["run", "--nnodes", "2", "--standalone", "x.py"])
    namespace = _torchrun.torch_args(fixed, 1, torchrun)
    assert namespace.rdzv_backend == "c10d" and namespace.rdzv_endpoint == "localhost:0"
    assert not _torchrun.restarts_possible(namespace)


def _run_subparser():
    parser = cli_main.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["run"]


def test_run_takes_and_lists_every_torchrun_option():
    torchrun = pytest.importorskip("torch.distributed.run")
    theirs = [a for a in torchrun.get_args_parser()._actions if a.option_strings]
    run = _run_subparser()
    ours = {flag for action in run._actions for flag in action.option_strings}
    help_text = run.format_help()
    missing, unlisted = [], []
    for action in theirs:
        missing += [flag for flag in action.option_strings if flag not in ours]
        # Listed by its dashed long spelling where it has one (the
        # underscore twins are accepted, not listed twice).
        dashed = [f for f in action.option_strings if f.startswith("--") and "_" not in f]
        if not any(
            re.search(rf"{re.escape(f)}\b", help_text) for f in dashed or action.option_strings
        ):
            unlisted.append(action.option_strings)
    assert missing == [] and unlisted == [], (missing, unlisted)


def test_duplicate_filters_and_numa_binding_reach_torchs_configuration(tmp_path, monkeypatch):
    torchrun = pytest.importorskip("torch.distributed.run")
    from fastspawn._torch import torchrun as _torchrun

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = cli_main.build_parser().parse_args(
        ["run", "--standalone", "--duplicate-stdout-filters", "apple,,x,orange",
         "--duplicate_stderr_filters", "err", "--numa-binding", "socket",
         "--log-dir", str(tmp_path), "x.py"]
    )  # fmt: skip
    namespace = _torchrun.torch_args(args, 2, torchrun)
    config, _cmd, _args = torchrun.config_from_args(namespace)
    assert config.duplicate_stdout_filters == ["apple,x", "orange"]
    assert config.duplicate_stderr_filters == ["err"]
    assert config.numa_options is not None
    assert config.numa_options.affinity_mode.value == "socket"
    # As torchrun reads them: the same lists from the same text.
    theirs = torchrun.get_args_parser().parse_args(
        ["--duplicate-stdout-filters", "apple,,x,orange", "--numa-binding", "socket", "x.py"]
    )
    assert theirs.duplicate_stdout_filters == args.duplicate_stdout_filters
    assert theirs.numa_binding == args.numa_binding


def test_options_from_pet_variables(tmp_path):
    # torchrun's environment defaults (Kubeflow sets PET_NPROC_PER_NODE and the rest).
    prog = write(
        tmp_path / "prog.py", "import os\nprint(os.environ['LOCAL_WORLD_SIZE'] + '\\n', end='')\n"
    )
    done = fastspawn_run(prog, cwd=tmp_path, env={"PET_NPROC_PER_NODE": "3"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "3", "3"]


def test_static_rdzv_endpoint_gives_master_addr_and_port(tmp_path):
    prog = write(
        tmp_path / "prog.py",
        "import os; print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\n",
    )
    done = fastspawn_run(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.1.2.3:29511", prog,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10.1.2.3", "29511"]


def test_dynamic_rendezvous_without_torch_says_what_needs_torch(tmp_path):
    # torch made unimportable, as where it is not installed.
    code = (
        "import sys; sys.modules['torch'] = None; from fastspawn._cli.main import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    for flags, named in (
        (["--standalone"], "--standalone"),
        (["--nnodes", "1:2"], "--nnodes 1:2"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-backend c10d"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", code, "run", *flags, "--nproc-per-node", "1", "/bin/true"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"fastspawn run: {named} runs torch's elastic agent")
        assert "runs torch's elastic agent, which needs torch" in done.stderr
        assert "use the static rendezvous" in done.stderr
    assert os.listdir(tmp_path) == []


# ------------------------------------------------- Python ranks, no torch


def test_script_runs_as_main_in_the_zygote(tmp_path):
    prog = write(
        tmp_path / "prog.py",
        """
        import json, multiprocessing, os, sys
        row = {
            "name": __name__, "argv": sys.argv, "path0": sys.path[0],
            "fastspawn": "fastspawn" in sys.modules, "mine": os.environ["MINE"],
            "rank": os.environ["RANK"], "main": sys.modules["__main__"].__file__,
            "process": multiprocessing.current_process().name,
            "parent": multiprocessing.parent_process(),
        }
        print(json.dumps(row) + "\\n", end="")  # one write: the ranks share the console
        """,
    )
    done = fastspawn_run("--nproc-per-node", "2", prog, "a", "--b", cwd=tmp_path, env={"MINE": "7"})
    assert done.returncode == 0, done.stderr
    rows = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == ["0", "1"]
    for row in rows:
        assert row["name"] == "__main__" and row["argv"] == [prog, "a", "--b"]
        assert row["path0"] == str(tmp_path) and row["main"] == prog
        assert row["fastspawn"] and row["mine"] == "7"  # a zygote worker, the caller's env
        assert row["process"] == "MainProcess" and row["parent"] is None  # as if fresh
    fresh = fastspawn_run("--nproc-per-node", "1", "--exec", prog, cwd=tmp_path, env={"MINE": "7"})
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["fastspawn"] is False  # a fresh interpreter


def test_module_runs_as_main(tmp_path):
    (tmp_path / "mymod.py").write_text(
        "import os, sys\n"
        "print(f'{__name__} {os.path.basename(sys.argv[0])} {sys.argv[1:]}\\n', end='')\n"
    )
    done = fastspawn_run("--nproc-per-node", "2", "-m", "mymod", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["__main__ mymod.py ['x']"] * 2


def test_script_exit_status_and_traceback_are_pythons(tmp_path):
    prog = write(
        tmp_path / "prog.py",
        """
        import os, sys
        if os.environ["RANK"] == "1":
            raise ValueError("bad input")
        """,
    )
    done = fastspawn_run("--nproc-per-node", "2", prog, cwd=tmp_path)
    assert done.returncode == 1
    # Printed as the interpreter prints it: the script's frames only.
    assert f'Traceback (most recent call last):\n  File "{prog}", line 4, in <module>' in (
        done.stderr
    )
    assert "_script.py" not in done.stderr and "ValueError: bad input" in done.stderr
    assert "rank 1 (local rank 1, pid" in done.stderr
    code = write(tmp_path / "code.py", "import sys; sys.exit(5)\n")
    assert fastspawn_run("--nproc-per-node", "1", code, cwd=tmp_path).returncode == 5


def test_missing_script_is_named_once(tmp_path):
    done = fastspawn_run("--nproc-per-node", "2", "nope.py", cwd=tmp_path)
    assert done.returncode == 127
    assert done.stderr.strip() == "fastspawn run: cannot start 'nope.py': no such Python script"


def test_preload_is_for_python_ranks(tmp_path):
    done = fastspawn_run("--preload", "json", "/bin/true", cwd=tmp_path)
    assert done.returncode == 2 and "--preload is for Python ranks" in done.stderr


def test_local_ranks_filter_shows_only_those_ranks(tmp_path):
    prog = write(tmp_path / "prog.py", "import os; print('rank', os.environ['RANK'])\n")
    done = fastspawn_run("--nproc-per-node", "3", "--local-ranks-filter", "1", prog, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "rank 1\n"
    logs = tmp_path / "logs"
    done = fastspawn_run(
        "--nproc-per-node", "2", "--local-ranks-filter", "0", "--tee", "1", "--log-dir",
        str(logs), prog, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[prog.py0]:rank 0\n"
    assert (logs / "attempt_0" / "1" / "stdout.log").read_text() == "rank 1\n"


# ------------------------------------------------------------- with torch


def test_script_rank_under_preload_torch(tmp_path):
    pytest.importorskip("torch")
    prog = write(
        tmp_path / "train.py",
        """
        import json, os, sys
        preloaded = "torch" in sys.modules  # before this script imports anything
        row = [__name__, sys.argv, os.environ["RANK"], os.environ["MINE"], preloaded]
        print(json.dumps(row) + "\\n", end="")
        """,
    )
    done = fastspawn_run(
        "--preload", "torch", "--nproc-per-node", "2", prog, "--lr", "0.1",
        cwd=tmp_path, env={"MINE": "x"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = sorted(json.loads(line) for line in done.stdout.splitlines())
    assert rows == [["__main__", [prog, "--lr", "0.1"], str(r), "x", True] for r in range(2)]


ALL_REDUCE = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(t)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if restart == "0" and os.environ["RANK"] == "3" and os.environ.get("FAIL_ONCE"):
    raise ValueError("rank 3 fails once")
dist.all_reduce(t)  # the others fail here in the failing attempt: rank 3 is gone
# One write per line: the ranks share the console (python -u writes a
# print's text and its newline apart).
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world} sum {t.item()} restart {restart}\\n", end="")
dist.destroy_process_group()
"""


class Node:
    """One `fastspawn run` of a multi-node job, its output in files (no pipe
    to fill up while another node is waited for)."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        self.out = tmp_path / f"{name}.out"
        self.err = tmp_path / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fastspawn", "run", *args],
                stdout=out,
                stderr=err,
                cwd=tmp_path,
                env={**os.environ, "TMPDIR": str(tmp_path), **env},
            )

    def wait(self, timeout: float = NODE_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        # Shown only when the test fails (a timeout included): what the
        # node's launcher and torch's agent said.
        print(f"== {self.err.name}, exit {self.proc.returncode}\n{self.err.read_text()[-6000:]}")

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()


def c10d(port: int, nnodes: str, conf: str = "") -> list[str]:
    return [
        *("--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-job"),
        *("--rdzv-conf", f"join_timeout=180{',' if conf else ''}{conf}", "--preload", "torch"),
    ]


def run_nodes(nodes: list[Node]) -> list[str]:
    try:
        for node in nodes:
            assert node.wait() == 0, node.err.read_text()
    finally:
        for node in nodes:
            node.stop()
    return sorted(line for node in nodes for line in node.lines())


def test_two_nodes_form_one_c10d_rendezvous(tmp_path):
    pytest.importorskip("torch.distributed")
    prog = write(tmp_path / "prog.py", ALL_REDUCE)
    args = [*c10d(topology.free_port(), "2"), prog]
    nodes = [Node(tmp_path, f"node{n}", args, {}) for n in range(2)]
    lines = run_nodes(nodes)
    assert lines == [f"rank {r} of 4 sum 40.0 restart 0" for r in range(4)]  # 10, then 4 x 10


def test_a_failing_rank_restarts_both_nodes(tmp_path):
    pytest.importorskip("torch.distributed")
    prog = write(tmp_path / "prog.py", ALL_REDUCE)
    args = [*c10d(topology.free_port(), "2"), "--max-restarts", "1", prog]
    nodes = [Node(tmp_path, f"node{n}", args, {"FAIL_ONCE": "1"}) for n in range(2)]
    lines = run_nodes(nodes)
    # Both agents restarted their group (the attempt in which rank 3 failed
    # printed nothing), and the job then succeeded.
    assert lines == [f"rank {r} of 4 sum 40.0 restart 1" for r in range(4)]


SHRINK = """
import os, subprocess, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
world = dist.get_world_size()
child = subprocess.Popen(["sleep", "600"])  # must die with the rank's node
with open(os.path.join(os.environ["UP_DIR"], f"up.{os.getpid()}"), "w") as f:
    f.write(f"{os.environ['NODE']} {world} {os.getpid()} {child.pid}")
t = torch.ones(1)
deadline = time.monotonic() + 150
while world == 4 and time.monotonic() < deadline:
    dist.all_reduce(t)  # fails once the other node is gone
    time.sleep(0.05)
child.kill()
child.wait()
print(f"done {os.environ['NODE']} world {world}\\n", end="")
dist.destroy_process_group()
"""


def _up(up_dir: Path, node: str, world: int) -> list[list[int]]:
    rows = []
    for path in up_dir.glob("up.*"):
        fields = path.read_text().split()
        if len(fields) == 4 and fields[0] == node and int(fields[1]) == world:
            rows.append([int(x) for x in fields[2:]])
    return rows


# The rendezvous store, outside both nodes, so that the killed node takes
# none of it along.  It marks when it is up and when a first node has
# joined (torch's c10d backend then replaces its null sentinel with the
# rendezvous state), and serves until the test kills it or ends.
STORE = """
import pathlib, sys, time
from torch.distributed import TCPStore

port, key, up_dir = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
(up_dir / "store").write_text("up")
deadline = time.monotonic() + float(sys.argv[4])
while not (store.check([key]) and store.get(key) != b"Y2FuaW1hZGFt"):
    assert time.monotonic() < deadline, "no node joined"
    time.sleep(0.05)
(up_dir / "joined").write_text("joined")
sys.stdin.read()  # until the test ends it, or ends itself
"""


def _wait_for(path: Path, what: str, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Until ``path`` exists; fails with ``what`` after NODE_TIMEOUT, or at
    once, naming it, when one of ``procs`` (by name) ends first (a node's
    stderr then comes from Node.stop)."""
    deadline = time.monotonic() + NODE_TIMEOUT
    while not path.exists():
        for name, proc in procs.items():
            assert proc.poll() is None, f"{what}: {name} ended first ({proc.returncode})"
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_sigkill_of_one_node_shrinks_the_job(tmp_path):
    pytest.importorskip("torch.distributed")
    prog = write(tmp_path / "prog.py", SHRINK)
    up_dir = tmp_path / "up"
    up_dir.mkdir()
    port = topology.free_port()
    key = "torch.rendezvous.test-job"
    store = subprocess.Popen(
        [sys.executable, "-c", STORE, str(port), key, str(up_dir), str(NODE_TIMEOUT)],
        stdin=subprocess.PIPE,
    )
    # The node whose join meets the minimum (1) sets the round's last call:
    # b joins first and its last call is long, so the first round waits for
    # a however loaded the machine; a's is short, so the shrunk round closes
    # 1 s after a rejoins alone.  Node b's heartbeats are missed 2 s after
    # it dies.
    conf = "keep_alive_interval=1,keep_alive_max_attempt=2,is_host=0,last_call_timeout="
    nodes: dict[str, Node] = {}
    try:
        _wait_for(up_dir / "store", "the store did not start", {"the store": store})
        for name, last_call in (("b", NODE_TIMEOUT), ("a", 1)):
            args = [*c10d(port, "1:2", f"{conf}{last_call}"), "--max-restarts", "1", prog]
            nodes[name] = Node(tmp_path, name, args, {"UP_DIR": str(up_dir), "NODE": name})
            if name == "b":
                procs = {"the store": store, "node b": nodes["b"].proc}
                _wait_for(up_dir / "joined", "node b did not join the rendezvous", procs)
        a, b = nodes["a"], nodes["b"]
        deadline = time.monotonic() + NODE_TIMEOUT
        while len(_up(up_dir, "a", 4)) < 2 or len(_up(up_dir, "b", 4)) < 2:
            assert a.proc.poll() is None and b.proc.poll() is None, "a node ended early"
            assert time.monotonic() < deadline, "the 2-node job did not start"
            time.sleep(0.1)
        doomed = {pid for row in _up(up_dir, "b", 4) for pid in row}
        doomed |= {p.pid for p in psutil.Process(b.proc.pid).children(recursive=True)}
        b.proc.send_signal(signal.SIGKILL)
        b.wait(timeout=60)
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in doomed):
            assert time.monotonic() < deadline, [p for p in doomed if not gone(p)]
            time.sleep(0.05)
        assert a.wait() == 0, "node a failed"
    finally:
        for node in nodes.values():
            node.stop()  # prints its stderr: shown if the test failed
        store.kill()
        store.communicate(timeout=60)  # and closes its stdin
    assert a.lines() == ["done a world 2"] * 2


def test_patch_torch_routes_torchrun_through_fastspawn(tmp_path):
    pytest.importorskip("torch.distributed")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("no torchrun script beside this Python")
    site = tmp_path / "site"
    site.mkdir()
    # The one line, in a site hook that only torchrun takes.
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.path.basename(sys.argv[0]) == 'torchrun':\n"
        "    import fastspawn; fastspawn.patch_torch(preload=False)\n"
    )
    prog = write(
        tmp_path / "prog.py",
        """
        import os, psutil
        parent = psutil.Process(os.getppid())
        print(os.environ["RANK"] + " " + " ".join(parent.cmdline()) + "\\n", end="")
        """,
    )
    done = subprocess.run(
        [sys.executable, str(torchrun), "--standalone", "--nproc-per-node", "2", prog],
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(site)},
    )
    assert done.returncode == 0, done.stderr
    rows = sorted(line.split(" ", 1) for line in done.stdout.splitlines())
    assert [rank for rank, _ in rows] == ["0", "1"]
    # Each rank's parent is fastspawn's zygote, not torchrun's agent.
    assert all("fastspawn._zygote" in parent for _, parent in rows), rows


def _wait_for_pids(pid_dir: Path, count: int, proc: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + NODE_TIMEOUT
    while True:
        pids = [int(p) for f in pid_dir.glob("pids.*") for p in f.read_text().split()]
        if len(pids) >= count:
            return pids
        assert proc.poll() is None, "the launcher ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "600"])
with open(os.path.join(sys.argv[1], f"pids.{os.getpid()}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


@pytest.mark.parametrize("agent", [False, True], ids=["static", "agent"])
def test_second_signal_kills_python_ranks_at_once(tmp_path, agent):
    # Python ranks (zygote workers) that ignore SIGINT and SIGTERM: the first
    # Ctrl-C starts a close that would wait its whole timeout; the second
    # kills them and their children at once.
    if agent:
        pytest.importorskip("torch.distributed")
    prog = write(tmp_path / "prog.py", STUBBORN)
    flags = ["--standalone"] if agent else []
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "fastspawn", "run", *flags, "--nproc-per-node", "2", prog,
             str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
    try:
        pids = _wait_for_pids(tmp_path, 4, run)
        run.send_signal(signal.SIGINT)
        # The close has begun (torch's agent logs it): the ranks ignore its signal.
        closing = "shutting down workers" if agent else "stopping every rank"
        deadline = time.monotonic() + 60
        while closing not in err_path.read_text():
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        assert not any(gone(pid) for pid in pids)
        run.send_signal(signal.SIGINT)
        run.wait(timeout=30)  # the close would wait 10 s (static) or 30 s (agent)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
    text = err_path.read_text()
    assert run.returncode == 128 + signal.SIGINT, text
    assert "got another signal, killing every" in text, text
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "ranks or their children survived"
        time.sleep(0.05)
