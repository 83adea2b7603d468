"""Chaos: over many rounds, SIGKILL one of the caller, its zygote, guard or
warden, or a rank, at a random moment of a launch and its join, and check
fastspawn's promise: nothing is left running, and every failure reaches the
caller as an exception (never a hang, never ``True``).

Each round runs tests/chaos_driver.py as the caller, in a session of its own
(as a batch job: fork and spawn launches get a process group and a warden),
with a plan drawn from the round's seed: the start method and target (every
pair in turn, in an order shuffled per cycle), ``nprocs``, whether the
helpers are already up, a blocking or a polling join, and per rank a sleep,
a grandchild, a daemon (double fork and setsid), and whether it returns,
raises or exits non-zero.  Then:

(a) The caller's report is judged against what the ranks wrote themselves,
    not against when the kill was sent (a kill may land after every rank is
    done, and True is then right): a join that returned True needs every
    rank done, none failed, every value; an exception must be explained by
    a rank that failed or by a kill that could have caused it.  A caller
    that does not exit within ROUND_LIMIT_S hangs, and fails the round.
(b) Every process the round made is gone (a zombie counts: its reaper is
    someone else), within PATIENCE_S: the ranks, their children and daemons
    (each records its own pid), and every descendant of the caller seen
    meanwhile (the zygote, its guard, the warden).  The one exception is
    the README's: with "fork" and "spawn", a daemon (a session of its own)
    of a rank that died without stopping it is beyond the warden's reach;
    those are counted, then killed here.

``FASTSPAWN_CHAOS_ROUNDS`` (default DEFAULT_ROUNDS), ``FASTSPAWN_CHAOS_SECONDS``
(a time budget: no round starts after it; default DEFAULT_SECONDS, none when
ROUNDS is given), ``FASTSPAWN_CHAOS_SEED`` to replay a run, and
``FASTSPAWN_CHAOS_ROUND`` to replay one round of it.  The seed and the
figures (rounds per method and target, kills landed, outcomes, problems)
are printed (``pytest -s``) and, on failure, in the message.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from fastspawn._warden import main as warden_main

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

TESTS = Path(__file__).resolve().parent
DRIVER = TESTS / "chaos_driver.py"

HELPERS = {"zygote": ["zygote", "guard"], "forkserver": ["zygote", "guard"]}
HELPERS.update(fork=["warden"], spawn=["warden"])
COMBOS = [
    (method, target)
    for method in ("zygote", "forkserver", "fork", "spawn")
    for target in ["caller", *HELPERS[method], "rank"]
]
DEFAULT_ROUNDS = 2 * len(COMBOS)  # each method and target twice
DEFAULT_SECONDS = 35.0
ROUND_LIMIT_S = 60.0  # from the caller's start to its exit: longer is a hang
PATIENCE_S = 10.0  # for the round's processes to be gone once the caller exited
SAMPLE_S = 0.02  # how often the caller's descendants are listed
OUTCOMES = ("returned", "raised", "caller killed", "hang", "no report")
RANK_KILLERS = {"zygote", "guard", "rank"}  # targets whose death may take ranks with it


def _settings() -> tuple[int, float | None, int, int | None]:
    rounds_env = os.environ.get("FASTSPAWN_CHAOS_ROUNDS")
    rounds = int(rounds_env) if rounds_env else DEFAULT_ROUNDS
    seconds_env = os.environ.get("FASTSPAWN_CHAOS_SECONDS")
    seconds = float(seconds_env) if seconds_env else (None if rounds_env else DEFAULT_SECONDS)
    seed_env = os.environ.get("FASTSPAWN_CHAOS_SEED")
    seed = int(seed_env) if seed_env else random.SystemRandom().randrange(1 << 32)
    only = os.environ.get("FASTSPAWN_CHAOS_ROUND")
    return rounds, seconds, seed, int(only) if only else None


def _timeout() -> float:
    rounds, seconds, _seed, only = _settings()
    if only is not None:
        rounds = 1
    per_round = ROUND_LIMIT_S + PATIENCE_S + 10
    return min(rounds * per_round, (seconds or float("inf")) + per_round) + 60


# --------------------------------------------------------------- the plan


@dataclass
class Plan:
    """One round, drawn from (seed, index) alone: replayable by itself."""

    seed: int
    index: int
    method: str
    target: str
    nprocs: int
    warm: bool
    join: str
    poll: float
    ranks: list[dict[str, Any]]
    victim_rank: int
    delay: float

    @staticmethod
    def draw(seed: int, index: int) -> Plan:
        cycle, position = divmod(index, len(COMBOS))
        order = list(COMBOS)
        random.Random(f"{seed}/cycle{cycle}").shuffle(order)
        method, target = order[position]
        rng = random.Random(f"{seed}/{index}")
        nprocs = rng.randint(2, 4 if method == "spawn" else 8)
        failing = rng.randrange(nprocs) if rng.random() < 0.35 else -1
        fate = rng.choice(["raise", "raise", "exit"])
        victim = rng.randrange(nprocs)
        ranks = [
            {
                "sleep": rng.uniform(0.0, 0.4),
                "grandchild": rng.random() < 0.4,
                "daemon": rng.random() < 0.25,
                "fate": fate if rank == failing else "return",
                # fork and spawn leave a rank's children to it while the
                # caller lives (as multiprocessing does): it stops them.
                "tidy": method in ("fork", "spawn"),
            }
            for rank in range(nprocs)
        ]
        if target == "rank" and rng.random() < 0.5:
            # The victim is the last rank running: nothing else stops then.
            ranks[victim]["sleep"] += 0.4
            ranks[victim]["grandchild"] = True
        warm = rng.random() < 0.5
        # The launch (a cold zygote starts first; spawn starts interpreters),
        # the ranks' sleeps, the join, and the caller's exit.
        launch = (0.02 if warm else 0.12) + (0.1 * nprocs if method == "spawn" else 0.0)
        window = launch + max(rank["sleep"] for rank in ranks) + 0.05
        return Plan(
            seed=seed,
            index=index,
            method=method,
            target=target,
            nprocs=nprocs,
            warm=warm,
            join=rng.choice(["blocking", "polling"]),
            poll=rng.uniform(0.005, 0.2),
            ranks=ranks,
            victim_rank=victim,
            delay=rng.uniform(0.0, window),
        )

    def name(self) -> str:
        target = f"rank {self.victim_rank}" if self.target == "rank" else self.target
        return (
            f"round {self.index} ({self.method}, kill {target} at +{self.delay:.3f}s, "
            f"nprocs={self.nprocs}, {'warm' if self.warm else 'cold'}, {self.join} join; "
            f"replay: FASTSPAWN_CHAOS_SEED={self.seed} FASTSPAWN_CHAOS_ROUND={self.index})"
        )


# ------------------------------------------------------- watching a round


class Watcher:
    """Every process seen in the caller's tree (kept as psutil.Process, so
    a pid reused later is not mistaken for it), listed every SAMPLE_S."""

    def __init__(self, root: int) -> None:
        self.root = psutil.Process(root)
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(SAMPLE_S)

    def sample(self) -> list[psutil.Process]:
        try:
            found = self.root.children(recursive=True)
        except psutil.Error:
            return []
        with self.lock:
            for proc in found:
                try:
                    self.seen.setdefault((proc.pid, proc.create_time()), proc)
                except psutil.Error:
                    pass
        return found

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def find_helper(driver: int, target: str) -> psutil.Process | None:
    """The caller's zygote guard, zygote or warden, if it runs now."""
    try:
        children = psutil.Process(driver).children()
    except psutil.Error:
        return None
    for child in children:
        line = _cmdline(child)
        if target == "warden" and warden_main.__file__ in line:
            return child
        if target in ("guard", "zygote") and "fastspawn._zygote" in line:
            if target == "guard":
                return child
            try:
                zygotes = child.children()
            except psutil.Error:
                return None
            return min(zygotes, key=lambda p: p.pid) if zygotes else None
    return None


def recorded(folder: Path) -> dict[str, psutil.Process]:
    """role-pid -> process, of those the round's processes recorded of
    themselves that still exist (as zombies too): by pid and start time,
    never a later process that got the pid."""
    out = {}
    boot, hertz = psutil.boot_time(), os.sysconf("SC_CLK_TCK")
    for name in os.listdir(folder / "pids"):
        role, pid, ticks = name.rsplit("-", 2)
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - (boot + int(ticks) / hertz)) < 0.5 / hertz:
                out[f"{role}-{pid}"] = proc
        except psutil.Error:
            pass
    return out


def find_rank(folder: Path, rank: int) -> psutil.Process | None:
    for key, proc in recorded(folder).items():
        if key.startswith(f"rank{rank}-"):
            return proc
    return None


@dataclass
class Kill:
    sent: bool = False
    pid: int = 0  # of the process killed
    moment: float = 0.0  # seconds after the caller's "ready"
    at: float = 0.0  # time.monotonic() when sent
    note: str = ""
    # When the victim's exit showed (its pidfd readable), set by ``landing``,
    # a thread: a SIGKILL takes effect once the victim runs again, which on
    # a busy host can be milliseconds after it was sent.
    landed: float | None = None
    landing: threading.Thread | None = None

    def landed_after(self, moment: float) -> bool:
        """Whether the victim was still there at ``moment`` (its exit seen
        later, or not at all within the round)."""
        if self.landing is not None:
            self.landing.join(PATIENCE_S)
        return self.landed is None or self.landed > moment


def watch_landing(kill: Kill, pidfd: int) -> None:
    """Record in ``kill`` when the process behind ``pidfd`` exits."""

    def wait() -> None:
        try:
            if select.select([pidfd], [], [], ROUND_LIMIT_S + PATIENCE_S)[0]:
                kill.landed = time.monotonic()
        finally:
            os.close(pidfd)

    kill.landing = threading.Thread(target=wait, daemon=True)
    kill.landing.start()


def events(folder: Path) -> dict[str, dict[str, Any]]:
    try:
        lines = (folder / "events").read_text().splitlines()
    except FileNotFoundError:
        return {}
    out = {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # cut short by the caller's death
        out[event["event"]] = event
    return out


def deliver(plan: Plan, driver: subprocess.Popen[bytes], folder: Path, ready: float) -> Kill:
    """At the plan's moment, SIGKILL its target (by pid, through a handle
    that knows the process's start time); a target not there yet is waited
    for while the caller runs, so a helper's or rank's birth is hit too."""
    kill = Kill()
    time.sleep(max(0.0, ready + plan.delay - time.monotonic()))
    while driver.poll() is None:
        if plan.target == "caller":
            victim: Any = driver
        elif plan.target == "rank":
            victim = find_rank(folder, plan.victim_rank)
        else:
            victim = find_helper(driver.pid, plan.target)
        if victim is not None:
            try:
                # Opened first, then the victim's identity checked (psutil
                # compares its start time): the pidfd is the victim's.
                pidfd = os.pidfd_open(victim.pid)
            except OSError:
                pidfd = -1  # gone meanwhile
            try:
                if pidfd < 0 or (isinstance(victim, psutil.Process) and not victim.is_running()):
                    raise ProcessLookupError
                victim.send_signal(signal.SIGKILL)
            except (psutil.Error, ProcessLookupError):
                if pidfd >= 0:  # gone meanwhile: look again
                    os.close(pidfd)
            else:
                kill.sent, kill.pid = True, victim.pid
                kill.at = time.monotonic()
                kill.moment = kill.at - ready
                watch_landing(kill, pidfd)
                return kill
        time.sleep(0.005)
    kill.note = "not sent: the caller exited first"
    return kill


# ------------------------------------------------------------- judging


@dataclass
class Verdict:
    outcome: str  # returned / raised <exception> / caller killed / hang / no report
    problems: list[str] = field(default_factory=list)
    escaped_daemons: int = 0
    kill: Kill = field(default_factory=Kill)
    ranks_failed: bool = False  # some rank never finished, or raised or exited non-zero


def markers(folder: Path, nprocs: int) -> tuple[set[int], set[int]]:
    names = set(os.listdir(folder))
    done = {r for r in range(nprocs) if f"done-{r}" in names}
    failed = {r for r in range(nprocs) if f"fail-{r}" in names}
    return done, failed


def judge_result(plan: Plan, kill: Kill, result: dict[str, Any], folder: Path) -> list[str]:
    """What the caller reported, against what the ranks did."""
    done, failed = markers(folder, plan.nprocs)
    everyone = set(range(plan.nprocs))
    problems = []
    if result["outcome"] == "returned":
        if done != everyone or failed:
            problems.append(
                f"join returned True, but ranks {sorted(everyone - done)} never finished "
                f"and ranks {sorted(failed)} failed"
            )
        expected = {str(r): r for r in everyone}
        if result["return_values"] != expected:
            problems.append(f"return_values {result['return_values']} (expected {expected})")
        if any(code != 0 for code in result["exitcodes"]):
            problems.append(f"join returned True with exit codes {result['exitcodes']}")
        return problems
    kind, index = result["type"], result["error_index"]
    could_kill_ranks = kill.sent and plan.target in RANK_KILLERS
    fates = {r: plan.ranks[r]["fate"] for r in failed}
    if kind == "ProcessRaisedException":
        if fates.get(index) != "raise":
            problems.append(
                f"ProcessRaisedException for rank {index}, which did not raise: {result['message']}"
            )
    elif kind == "ProcessExitedException":
        if result["signal_name"] is not None:
            explained = could_kill_ranks and (
                plan.target != "rank"
                or (index == plan.victim_rank and result["signal_name"] == "SIGKILL")
            )
        elif result["exit_code"] == 1:  # a raise whose traceback was lost
            explained = fates.get(index) == "raise" and could_kill_ranks
        else:
            explained = result["exit_code"] == 3 and fates.get(index) == "exit"
        if not explained:
            problems.append(
                f"ProcessExitedException for rank {index} (exit code {result['exit_code']}, "
                f"signal {result['signal_name']}) that nothing explains"
            )
    elif not (kill.sent and plan.target in ("zygote", "guard")):
        problems.append(f"{kind} raised: {result['message']}\n{result['traceback']}")
    if "final" in result:
        ranks = [rank for _kind, rank in result["later"]]
        if not result["final"] or len(set(ranks)) != len(ranks) or index in ranks:
            problems.append(f"later joins: {result['later']}, ended in True: {result['final']}")
    return problems


def survivors(plan: Plan, watcher: Watcher, folder: Path) -> tuple[list[str], int]:
    """The round's processes still running after PATIENCE_S (then killed),
    and how many daemons the README lets escape (killed too)."""
    exempt_roles = ("daemon",) if plan.method in ("fork", "spawn") else ()
    deadline = time.monotonic() + PATIENCE_S
    while True:
        procs: dict[tuple[int, float], tuple[str, psutil.Process]] = {}
        for key, proc in recorded(folder).items():
            try:
                procs[(proc.pid, proc.create_time())] = (key.rsplit("-", 1)[0], proc)
            except psutil.Error:
                pass
        with watcher.lock:
            for ident, proc in watcher.seen.items():
                procs.setdefault(ident, (_cmdline(proc)[-60:], proc))
        alive = {ident: pair for ident, pair in procs.items() if not _gone(pair[1])}
        escaped = {i: p for i, p in alive.items() if p[0].startswith(exempt_roles)}
        left = {i: p for i, p in alive.items() if i not in escaped}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = []
    for (pid, _ctime), (role, proc) in {**left, **escaped}.items():
        if (pid, _ctime) in left:
            described.append(f"{pid} {role} ({_status(proc)}, parent {_parent(proc)})")
        try:
            proc.kill()
        except psutil.Error:
            pass
    return described, len(escaped)


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.Error:
        return "gone"


def _parent(proc: psutil.Process) -> str:
    try:
        parent = proc.ppid()
        return f"{parent} {_cmdline(psutil.Process(parent))[:40]}"
    except psutil.Error:
        return "?"


# ------------------------------------------------------------- a round


def run_round(plan: Plan, folder: Path) -> Verdict:
    (folder / "pids").mkdir(parents=True)
    config = {
        "method": plan.method,
        "nprocs": plan.nprocs,
        "folder": str(folder),
        "warm": plan.warm,
        "join": plan.join,
        "poll": plan.poll,
        "plans": plan.ranks,
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
    started = time.monotonic()
    with open(folder / "log", "wb") as log:
        driver = subprocess.Popen(
            [sys.executable, str(DRIVER), json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    watcher = Watcher(driver.pid)
    try:
        verdict, kill = _drive(plan, driver, folder, started)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait(30)
        watcher.close()
        left, escaped = survivors(plan, watcher, folder)
    verdict.escaped_daemons = escaped
    verdict.kill = kill
    done, failed = markers(folder, plan.nprocs)
    verdict.ranks_failed = bool(failed) or len(done) < plan.nprocs
    if left:
        verdict.problems.append(f"left running after {PATIENCE_S:.0f} s: {left}")
    if verdict.problems:
        log_tail = (folder / "log").read_text(errors="replace")[-3000:]
        sent = f"sent to {kill.pid} at +{kill.moment:.3f}s" if kill.sent else kill.note
        verdict.problems = [
            f"{plan.name()}, kill {sent}: {problem}\n--- caller's output:\n{log_tail}"
            for problem in verdict.problems
        ]
    return verdict


def _drive(
    plan: Plan, driver: subprocess.Popen[bytes], folder: Path, started: float
) -> tuple[Verdict, Kill]:
    deadline = started + ROUND_LIMIT_S
    while "ready" not in events(folder):
        if driver.poll() is not None or time.monotonic() > deadline:
            return Verdict("no report", ["the caller ended or hung before its launch"]), Kill()
        time.sleep(0.005)
    kill = deliver(plan, driver, folder, events(folder)["ready"]["time"])
    try:
        code = driver.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return Verdict("hang", [f"the caller hung: {hang_report(driver)}"]), kill
    result = events(folder).get("result")
    caller_killed = plan.target == "caller" and kill.sent
    if result is None:
        if caller_killed:
            return Verdict("caller killed"), kill
        return Verdict("no report", [f"the caller exited {code} without a report"]), kill
    problems = judge_result(plan, kill, result, folder)
    after = events(folder).get("after")
    if after is None:
        if not caller_killed:
            problems.append(f"the caller exited {code} before its next launch ended")
    elif after["outcome"] != "returned" and not (kill.sent and kill.landed_after(result["time"])):
        # A helper killed during the launch under test is replaced by the
        # next; one whose death landed after that launch ended (the kill
        # sent before it, the victim not yet run) may fail the next.
        problems.append(f"the next launch raised {after['type']}: {after['message']}")
    if code != 0 and not caller_killed:
        problems.append(f"the caller exited {code} after its report")
    outcome = "returned" if result["outcome"] == "returned" else f"raised {result['type']}"
    return Verdict(outcome, problems), kill


def hang_report(driver: subprocess.Popen[bytes]) -> str:
    """The caller's process tree, and (in its output) its threads' stacks."""
    tree = []
    try:
        for proc in [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(True)]:
            tree.append(f"{proc.pid} {_status(proc)} {_cmdline(proc)[:70]}")
    except psutil.Error:
        pass
    driver.send_signal(signal.SIGUSR1)  # faulthandler writes the stacks to its log
    time.sleep(1.0)
    return f"no exit in {ROUND_LIMIT_S:.0f} s; its processes: {tree}"


# ------------------------------------------------------------- the test


@pytest.mark.timeout(_timeout())
def test_chaos(tmp_path: Path) -> None:
    rounds, seconds, seed, only = _settings()
    indices = [only] if only is not None else list(range(rounds))
    print(f"\nfastspawn chaos: seed {seed}, {len(indices)} round(s), budget {seconds} s")
    began = time.monotonic()
    figures: Counter[tuple[str, str, str]] = Counter()
    problems: list[str] = []
    ran = 0
    for index in indices:
        if seconds is not None and time.monotonic() - began > seconds:
            break
        plan = Plan.draw(seed, index)
        verdict = run_round(plan, tmp_path / f"round{index}")
        ran += 1
        figures[(plan.method, plan.target, verdict.outcome)] += 1
        if verdict.kill.sent:
            figures[(plan.method, plan.target, "kill sent")] += 1
        if verdict.ranks_failed:
            figures[(plan.method, plan.target, "ranks failed")] += 1
        if verdict.escaped_daemons:
            figures[(plan.method, plan.target, "daemons escaped")] += verdict.escaped_daemons
        if verdict.problems:
            figures[(plan.method, plan.target, "PROBLEM")] += 1
            problems.extend(verdict.problems)
    report = summary(seed, ran, time.monotonic() - began, figures)
    print(report)
    assert not problems, report + "\n\n" + "\n\n".join(problems)


def summary(seed: int, ran: int, elapsed: float, figures: Counter[tuple[str, str, str]]) -> str:
    lines = [f"chaos seed {seed}: {ran} round(s) in {elapsed:.1f} s"]
    for method, target in COMBOS:
        cells = {k[2]: v for k, v in figures.items() if k[:2] == (method, target)}
        if cells:
            total = sum(v for k, v in cells.items() if k.startswith(OUTCOMES))
            detail = ", ".join(f"{k} {v}" for k, v in sorted(cells.items()))
            lines.append(f"  {method:10} {target:7} {total:4} round(s): {detail}")
    return "\n".join(lines)
