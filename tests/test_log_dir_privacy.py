"""A run's logs stay the caller's: a log directory another user owns, or
may write in, is refused before anything starts (``fastspawn run``,
``fastspawn.elastic``); the directories a run makes are 0700 and its own;
a rank writes its error file only into a file of its own, readable by no
one else; the launcher trusts no error file another user wrote.  Where a
second user is needed, it is the unprivileged one of test_limits."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import test_limits

from fastspawn import elastic
from fastspawn._cli import logdir
from fastspawn._worker import elastic_rank

# Long, and the same on every CPython: CI runs them on one version (.ci/run).
pytestmark = pytest.mark.version_neutral

# The second user, and a directory of its own (test_limits' fixtures).
unprivileged = test_limits.unprivileged
private_dir = test_limits.private_dir
NOGROUP = test_limits.NOGROUP

SECRET = "token_5ec7e7"

# Rank 0 fails with the secret in its message (error.json); rank 1 sleeps
# in a function named by it (its stack, written to stacks.log at the failure).
PROGRAM = f"""
import os, time
def {SECRET}():
    time.sleep(60)
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(0.5)
    raise RuntimeError("cannot log in: {SECRET}")
{SECRET}()
"""

# Run as the other user while the run goes on: try to swap the run's
# attempt_0 for a world-writable tree of 0666 files, to move the log
# directory away, and to move attempt_0 away; then read whatever it can.
ATTACKER = """
import os, sys
base, log_dir = sys.argv[1], sys.argv[2]
evil = os.path.join(base, "evil")
os.mkdir(evil, 0o777)
os.mkdir(os.path.join(evil, "0"), 0o777)
for rank in ("0", "1"):
    os.makedirs(os.path.join(evil, rank), 0o777, exist_ok=True)
    for name in ("error.json", "stacks.log", "stdout.log", "stderr.log"):
        fd = os.open(os.path.join(evil, rank, name), os.O_CREAT | os.O_WRONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
done = {}
print("ready", flush=True)
while not os.path.exists(os.path.join(base, "stop")):
    for what, (src, dst) in {
        "swap": (evil, os.path.join(log_dir, "attempt_0")),
        "take": (os.path.join(log_dir, "attempt_0"), os.path.join(base, "taken")),
        "move": (log_dir, os.path.join(base, "moved")),
    }.items():
        try:
            os.rename(src, dst)
            done[what] = "done"
        except OSError as exc:
            done.setdefault(what, exc.strerror)
found = []
for root, dirs, files in os.walk(base):
    for name in files:
        try:
            with open(os.path.join(root, name)) as f:
                if sys.argv[3] in f.read():
                    found.append(os.path.join(root, name))
        except OSError:
            pass
print("tries:", sorted(done.items()))
print("found:", found)
"""


def fastspawn_run(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastspawn", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def _line(output: str, key: str) -> str:
    for line in output.splitlines():
        if line.startswith(key + ":"):
            return line[len(key) + 1 :].strip()
    raise AssertionError(f"no {key!r} line in:\n{output}")


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(PROGRAM))
    return path


def test_a_log_dir_another_user_made_is_refused_and_gets_nothing(
    unprivileged, private_dir, program
):
    uid = unprivileged[0]
    shared = private_dir / "logs"
    shared.mkdir()
    os.chown(shared, uid, NOGROUP)
    shared.chmod(0o777)
    done = fastspawn_run("--nprocs-per-node", "2", "--log-dir", str(shared), str(program))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"fastspawn run: cannot use --log-dir {shared}: it belongs ")
    assert f"uid {uid}" in done.stderr and "mode 0777" in done.stderr
    assert "mkdir -m 700" in done.stderr and len(done.stderr.splitlines()) == 1
    assert os.listdir(shared) == []
    # fastspawn.elastic, either way it takes a log directory.
    with pytest.raises(PermissionError, match=rf"belongs to uid {uid}.*mode 0777"):
        elastic.start_processes("x", "/bin/true", {0: ()}, {0: {}}, str(shared))
    with pytest.raises(PermissionError, match=rf"belongs to uid {uid}"):
        elastic.DefaultLogsSpecs(str(shared))
    assert os.listdir(shared) == []


def test_swapping_attempt_0_finds_nothing_of_the_run_readable(
    unprivileged, private_tmpdir, program
):
    uid, python, _path = unprivileged
    # Sticky and world-writable, as /tmp: the other user may make things
    # beside the log directory, not move it.
    base = tempfile.mkdtemp(prefix="fastspawn-logs-", dir=os.path.dirname(private_tmpdir))
    attacker = None
    try:
        os.chmod(base, 0o1777)
        log_dir = os.path.join(base, "logs")
        script = os.path.join(base, "attacker.py")
        with open(script, "w") as f:
            f.write(ATTACKER)
        os.chmod(script, 0o644)
        attacker = subprocess.Popen(
            [python, script, base, log_dir, SECRET],
            user=uid,
            group=NOGROUP,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert attacker.stdout is not None
        assert attacker.stdout.readline() == "ready\n"
        done = fastspawn_run("--nprocs-per-node", "2", "--log-dir", log_dir, str(program))
        open(os.path.join(base, "stop"), "w").close()
        out, _ = attacker.communicate(timeout=60)
        assert done.returncode == 1, done.stderr
        assert f"RuntimeError: cannot log in: {SECRET}" in done.stderr
        # The run wrote the secret, in files of its own, in directories
        # of its own that no one else may enter...
        attempt = os.path.join(log_dir, "attempt_0")
        with open(os.path.join(attempt, "0", "error.json")) as f:
            assert SECRET in json.load(f)["message"]["message"]
        with open(os.path.join(attempt, "1", "stacks.log")) as f:
            assert SECRET in f.read()
        for path in (log_dir, attempt, os.path.join(attempt, "0"), os.path.join(attempt, "1")):
            st = os.stat(path)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o700), path
        # ... which the other user could neither swap nor move, nor read.
        assert "'done'" not in _line(out, "tries"), out
        assert _line(out, "found") == "[]", out
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.communicate(timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def test_a_log_dir_others_may_write_in_is_refused(tmp_path, program):
    for mode, who in [(0o777, "its group and others"), (0o757, "others"), (0o770, "its group")]:
        shared = tmp_path / f"logs{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        done = fastspawn_run("--nprocs-per-node", "1", "--log-dir", str(shared), "/bin/true")
        assert done.returncode == 2, done.stderr
        assert f"{who} may write in it (mode {mode:04o})" in done.stderr
        assert os.listdir(shared) == []
        with pytest.raises(PermissionError, match=rf"{who} may write in it"):
            elastic.start_processes("x", "/bin/true", {0: ()}, {0: {}}, str(shared))
    # Readable by others is the caller's choice: only writing is refused.
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    done = fastspawn_run("--nprocs-per-node", "1", "--log-dir", str(mine), "/bin/true")
    assert done.returncode == 0, done.stderr


def test_an_attempt_is_not_made_in_a_log_dir_put_in_place_of_the_first(tmp_path):
    args = argparse.Namespace(
        log_dir=str(tmp_path / "logs"),
        redirects=elastic.Std.NONE,
        tee=elastic.Std.NONE,
        duplicate_stdout_filters=None,
        duplicate_stderr_filters=None,
    )
    log_dir = logdir.open_log_dir(args)
    assert log_dir is not None
    assert log_dir.make_attempt_dir(0) == str(tmp_path / "logs" / "attempt_0")
    os.rename(tmp_path / "logs", tmp_path / "moved")
    (tmp_path / "logs").mkdir(mode=0o700)
    with pytest.raises(logdir.LogDirError, match="no longer the directory the run started with"):
        log_dir.make_attempt_dir(1)
    assert os.listdir(tmp_path / "logs") == []


def test_a_rank_writes_its_error_only_into_a_file_of_its_own(tmp_path, monkeypatch, capfd):
    path = tmp_path / "error.json"
    monkeypatch.setenv(elastic_rank.ERROR_FILE_ENV, str(path))
    # One of its own, left readable by others (torch writes it with the
    # umask's mode): made private before the traceback goes in.
    path.write_text("old")
    path.chmod(0o644)
    elastic_rank.write_error_file(RuntimeError(SECRET))
    assert SECRET in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600
    if os.geteuid() != 0:
        return  # the rest plants another user's file: root alone can
    # Another user's, world-writable: not written, and said so.
    path.write_text("")
    os.chown(path, 65534, NOGROUP)
    path.chmod(0o666)
    elastic_rank.write_error_file(RuntimeError(SECRET))
    assert path.read_text() == ""
    assert "belongs to uid 65534" in capfd.readouterr().err
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        elastic_rank.open_private(str(path), append=True)


def test_a_file_of_its_own_is_appended_to_and_made_private(tmp_path):
    # What stacks.log is written through: one dump after another.
    path = tmp_path / "stacks.log"
    path.write_text("first\n")
    path.chmod(0o644)
    fd = elastic_rank.open_private(str(path), append=True)
    os.write(fd, b"second\n")
    os.close(fd)
    assert path.read_text() == "first\nsecond\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.symlink(path, tmp_path / "link")
    with pytest.raises(OSError, match="symbolic link|Too many levels"):
        elastic_rank.open_private(str(tmp_path / "link"), append=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="plants another user's file: needs root")
def test_the_launcher_trusts_no_error_file_another_user_wrote(tmp_path, caplog):
    path = tmp_path / "error.json"
    forged = {"message": {"message": "forged", "extraInfo": {"timestamp": "1"}}}
    path.write_text(json.dumps(forged))
    os.chown(path, 65534, NOGROUP)
    failure = elastic.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message != "forged"
    assert "belongs to uid 65534" in caplog.text
