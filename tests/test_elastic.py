"""fastspawn.elastic: SPEC.md section 3."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import workers
from helpers import KILL_BOUND_S, alive_after, gone, kill_driver

from fastspawn import elastic
from fastspawn.elastic import Std

TESTS = os.path.dirname(os.path.abspath(__file__))
# torch's ProcessFailure.message for a rank that exited without an error file.
NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)


def empty(n: int) -> dict[int, dict[str, str]]:
    return {rank: {} for rank in range(n)}


def start(entrypoint, args, log_dir, **kwargs):
    return elastic.start_processes(
        name="trainer",
        entrypoint=entrypoint,
        args=args,
        envs=empty(len(args)),
        log_dir=str(log_dir),
        **kwargs,
    )


# ------------------------------------------------------------------ Std


@pytest.mark.parametrize(
    "text, value",
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        ("0:1,1:2", {0: Std.OUT, 1: Std.ERR}),
        ("0:3", {0: Std.ALL}),
        ("12:1", {12: Std.OUT}),
    ],
)
def test_std_from_str(text, value):
    assert Std.from_str(text) == value


@pytest.mark.parametrize("text", ["0:1,", "11", "0:1,1", "1,0:1", "4", "", "a", "0:4"])
def test_std_from_str_rejects(text):
    with pytest.raises(ValueError, match="is not a Std spec"):
        Std.from_str(text)


def test_to_map():
    assert elastic.to_map(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}
    assert elastic.to_map({1: Std.ERR}, 3) == {0: Std.NONE, 1: Std.ERR, 2: Std.NONE}


# ------------------------------------------------------------- arguments


def test_args_envs_must_cover_every_rank(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"args, local rank mapping mismatch, expected: \[0, 1\]"
    ):
        elastic.start_processes(
            "t", workers.elastic_add, {0: (1, 2), 2: (3, 4)}, empty(2), str(tmp_path)
        )
    with pytest.raises(RuntimeError, match=r"envs, local rank mapping mismatch"):
        elastic.start_processes(
            "t", workers.elastic_add, {0: (1, 2), 1: (3, 4)}, {0: {}}, str(tmp_path)
        )


def test_log_dir_must_be_empty_directory(tmp_path):
    (tmp_path / "junk").write_text("x")
    with pytest.raises(RuntimeError, match="is not empty, please provide an empty log_dir"):
        start(workers.elastic_add, {0: (1, 2)}, tmp_path)
    with pytest.raises(NotADirectoryError):
        start(workers.elastic_add, {0: (1, 2)}, tmp_path / "junk")
    with pytest.raises(FileNotFoundError):
        start(workers.elastic_add, {0: (1, 2)}, tmp_path / "missing")


def test_missing_binary_fails_at_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="fs-no-such-binary"):
        start("fs-no-such-binary", {0: ()}, tmp_path)
    with pytest.raises(FileNotFoundError, match="/no/such/bin"):
        elastic.start_processes("t", "/no/such/bin", {0: ()}, {0: {}}, os.devnull)


def test_not_executable_binary(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(PermissionError, match="not an executable file"):
        start(str(script), {0: ()}, logs)


# ------------------------------------------------------------- functions


def test_function_return_values_and_redirects(tmp_path):
    ctx = start(workers.elastic_add, {0: (1, 2), 1: (3, 4)}, tmp_path, redirects=Std.ALL)
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: 3, 1: 7}
    assert result.stdouts == {r: str(tmp_path / str(r) / "stdout.log") for r in (0, 1)}
    assert (tmp_path / "1" / "stdout.log").read_text() == "out 3 4\n"
    assert (tmp_path / "1" / "stderr.log").read_text() == "err 3 4\n"
    mode = stat.S_IMODE(os.stat(tmp_path / "1" / "stdout.log").st_mode)
    assert mode == 0o600


def test_function_large_return_value_and_exit_zero(tmp_path):
    size = 10 * 1024 * 1024
    ctx = start(workers.elastic_big, {0: (size,), 1: (size,)}, tmp_path)
    result = ctx.wait(timeout=120)
    assert result.return_values[1] == b"x" * size
    ctx = elastic.start_processes("t", workers.elastic_exit_zero, {0: ()}, {0: {}}, os.devnull)
    assert ctx.wait(timeout=60).return_values == {0: None}


def test_error_file_env_per_rank(tmp_path):
    ctx = start(workers.elastic_env, {0: (), 1: ()}, tmp_path)
    assert ctx.wait(timeout=60).return_values == {
        r: str(tmp_path / str(r) / "error.json") for r in (0, 1)
    }
    ctx = elastic.start_processes("t", workers.elastic_env, {0: ()}, {0: {}}, os.devnull)
    assert ctx.wait(timeout=60).return_values == {0: ""}


def test_function_failure_writes_error_json(tmp_path):
    ctx = start(workers.elastic_raise, {0: ("boom",)}, tmp_path)
    result = ctx.wait(timeout=60)
    failure = result.failures[0]
    assert failure.exitcode == 1
    assert failure.error_file == str(tmp_path / "0" / "error.json")
    assert failure.message == "ValueError: boom"
    data = json.loads((tmp_path / "0" / "error.json").read_text())
    assert data["message"]["message"] == "ValueError: boom"
    assert "Traceback" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) == failure.timestamp
    assert failure.signal_name() == "<N/A>"
    assert stat.S_IMODE(os.stat(failure.error_file).st_mode) == 0o600


def test_error_file_symlink_is_not_followed(tmp_path, caplog):
    victim = tmp_path / "victim.json"
    planted = '{"message": {"message": "planted", "extraInfo": {"timestamp": "1"}}}'
    victim.write_text(planted)
    logs = tmp_path / "logs"
    logs.mkdir()
    ctx = start(
        workers.elastic_link_error_file_and_raise,
        {0: (str(victim),)},
        logs,
        redirects=Std.ERR,
    )
    failure = ctx.wait(timeout=60).failures[0]
    # The rank's failure still comes through, by its exit code; the file
    # the link points to is neither written by the rank nor read here.
    assert victim.read_text() == planted
    assert failure.exitcode == 1
    assert failure.error_file == "<N/A>"
    assert "planted" not in failure.message
    error_file = str(logs / "0" / "error.json")
    assert f"{error_file} is a symbolic link" in caplog.text
    stderr = (logs / "0" / "stderr.log").read_text()
    assert f"cannot write the error file {error_file}: it is a symbolic link" in stderr


# ------------------------------------------------------------ logs_specs


def test_default_logs_specs_layout_env_and_attempts(tmp_path):
    root = tmp_path / "logs"  # created by the spec
    specs = elastic.DefaultLogsSpecs(str(root), redirects=Std.ALL)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    envs = {r: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0"} for r in (0, 1)}
    ctx = elastic.start_processes("t", workers.elastic_add, {0: (1, 2), 1: (3, 4)}, envs, specs)
    result = ctx.wait(timeout=60)
    assert result.return_values == {0: 3, 1: 7}
    (run_dir,) = root.iterdir()
    assert run_dir.name.startswith("job7_")
    attempt = run_dir / "attempt_0"
    assert result.stdouts == {r: str(attempt / str(r) / "stdout.log") for r in (0, 1)}
    assert (attempt / "1" / "stdout.log").read_text() == "out 3 4\n"
    assert (attempt / "1" / "stderr.log").read_text() == "err 3 4\n"
    assert stat.S_IMODE(os.stat(attempt / "1" / "stdout.log").st_mode) == 0o600
    # The next attempt, from the same spec, lands beside the first one; the
    # error file variable follows it.
    envs = {r: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"} for r in (0, 1)}
    ctx = elastic.start_processes("t", workers.elastic_env, {0: (), 1: ()}, envs, logs_specs=specs)
    assert ctx.wait(timeout=60).return_values == {
        r: str(run_dir / "attempt_1" / str(r) / "error.json") for r in (0, 1)
    }
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1"]


def test_logs_specs_failure_reads_its_error_file(tmp_path):
    specs = elastic.DefaultLogsSpecs(str(tmp_path))
    ctx = elastic.start_processes("t", workers.elastic_raise, {0: ("boom",)}, empty(1), specs)
    failure = ctx.wait(timeout=60).failures[0]
    assert failure.message == "ValueError: boom"
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("test_run_id_")
    assert failure.error_file == str(run_dir / "attempt_0" / "0" / "error.json")


def test_logs_specs_tee_and_local_ranks_filter(tmp_path, capfd):
    specs = elastic.DefaultLogsSpecs(str(tmp_path), tee=Std.OUT, local_ranks_filter={0})
    ctx = elastic.start_processes("trainer", workers.elastic_stdio, {0: (), 1: ()}, empty(2), specs)
    result = ctx.wait(timeout=60)
    (run_dir,) = tmp_path.iterdir()
    attempt = run_dir / "attempt_0"
    # Rank 0 is shown: its stdout is tee'd (a pipe to the console, and its
    # file).  Rank 1 is filtered out: its stdout goes to its file only, its
    # stderr (not redirected) nowhere.
    assert result.return_values[0][0].startswith("pipe:")
    assert result.return_values[1] == (str(attempt / "1" / "stdout.log"), os.devnull)
    assert capfd.readouterr().out.splitlines() == ["[trainer0]:out"]
    assert (attempt / "0" / "stdout.log").read_text() == "out\n"
    assert (attempt / "1" / "stdout.log").read_text() == "out\n"
    assert not (attempt / "1" / "stderr.log").exists()


def test_logs_specs_devnull(tmp_path):
    specs = elastic.DefaultLogsSpecs(os.devnull, redirects=Std.ALL)
    ctx = elastic.start_processes("t", workers.elastic_env, {0: ()}, empty(1), specs)
    assert ctx.wait(timeout=60).return_values == {0: ""}


class _OneFileSpecs(elastic.LogsSpecs):
    """Every rank's stdout to one named file each, no error files."""

    def __init__(self, directory, tee_from=None):
        super().__init__(str(directory))
        self.tee_from = tee_from

    @property
    def root_log_dir(self):
        return str(self._root_log_dir)

    def reify(self, envs):
        out = {r: os.path.join(self.root_log_dir, f"out{r}") for r in envs}
        tee = {r: self.tee_from for r in envs} if self.tee_from else {}
        return elastic.LogsDest(stdouts=out, tee_stdouts=tee)


def test_custom_logs_specs(tmp_path):
    ctx = elastic.start_processes(
        "t", workers.elastic_env, {0: (), 1: ()}, empty(2), _OneFileSpecs(tmp_path)
    )
    # No error file named: ranks get an empty TORCHELASTIC_ERROR_FILE.
    assert ctx.wait(timeout=60).return_values == {0: "", 1: ""}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out0", "out1"]
    # The files exist now: a second run refuses to overwrite them, starts
    # nothing and leaves them as they were.
    with pytest.raises(FileExistsError, match="log file exists already.*out0"):
        elastic.start_processes(
            "t", workers.elastic_env, {0: (), 1: ()}, empty(2), _OneFileSpecs(tmp_path)
        )
    # A tee from another file than the one written cannot be honoured.
    other = tmp_path / "sub"
    other.mkdir()
    with pytest.raises(ValueError, match="tee_stdouts must name the same file"):
        elastic.start_processes(
            "t", workers.elastic_env, {0: ()}, empty(1), _OneFileSpecs(other, tee_from="/x")
        )
    assert list(other.iterdir()) == []


def test_log_file_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "out0").symlink_to(victim)
    with pytest.raises(FileExistsError, match="log file is a symbolic link.*out0"):
        elastic.start_processes("t", workers.elastic_env, {0: ()}, empty(1), _OneFileSpecs(logs))
    assert victim.read_text() == "keep"
    assert os.listdir(logs) == ["out0"]


def test_log_dir_and_logs_specs_arguments(tmp_path):
    specs = elastic.DefaultLogsSpecs(str(tmp_path / "a"))
    run = (workers.elastic_add, {0: (1, 2)}, empty(1))
    with pytest.raises(TypeError, match="give exactly one"):
        elastic.start_processes("t", *run)
    with pytest.raises(TypeError, match="give exactly one"):
        elastic.start_processes("t", *run, str(tmp_path), logs_specs=specs)
    with pytest.raises(TypeError, match="give exactly one"):
        elastic.start_processes("t", *run, specs, logs_specs=specs)
    with pytest.raises(TypeError, match="redirects and tee are part of logs_specs"):
        elastic.start_processes("t", *run, logs_specs=specs, redirects=Std.OUT)
    with pytest.raises(TypeError, match="must be a LogsSpecs"):
        elastic.start_processes("t", *run, logs_specs=object())
    with pytest.raises(NotADirectoryError, match="is a file"):
        elastic.DefaultLogsSpecs(__file__)
    assert list((tmp_path / "a").iterdir()) == []


def test_torch_default_logs_specs(tmp_path):
    torch_api = pytest.importorskip("torch.distributed.elastic.multiprocessing.api")
    specs = torch_api.DefaultLogsSpecs(log_dir=str(tmp_path), redirects=torch_api.Std.ALL)
    ctx = elastic.start_processes("t", workers.elastic_add, {0: (1, 2)}, empty(1), logs_specs=specs)
    result = ctx.wait(timeout=60)
    assert result.return_values == {0: 3}
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text() == "out 1 2\n"


# --------------------------------------------------------------- binaries


def test_binary_ranks_with_redirect_and_tee(tmp_path, capfd):
    ctx = start(
        "/bin/sh",
        {0: ("-c", "echo a0; echo b0; echo e0 >&2"), 1: ("-c", "echo a1; echo b1")},
        tmp_path,
        redirects={0: Std.ERR},
        tee={0: Std.OUT, 1: Std.OUT},
    )
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    out = capfd.readouterr().out
    lines = out.splitlines()
    assert [x for x in lines if x.startswith("[trainer0]:")] == ["[trainer0]:a0", "[trainer0]:b0"]
    assert [x for x in lines if x.startswith("[trainer1]:")] == ["[trainer1]:a1", "[trainer1]:b1"]
    assert (tmp_path / "0" / "stdout.log").read_text() == "a0\nb0\n"
    assert (tmp_path / "0" / "stderr.log").read_text() == "e0\n"
    assert result.stderrs[1] == ""


def test_binary_args_are_converted_with_str(tmp_path):
    ctx = start("/bin/echo", {0: (1, [2, 3], 4.5)}, tmp_path, redirects=Std.OUT)
    ctx.wait(timeout=60)
    assert (tmp_path / "0" / "stdout.log").read_text() == "1 [2, 3] 4.5\n"


def test_binary_exit_138(tmp_path):
    ctx = start("/bin/sh", {0: ("-c", "exit 138")}, tmp_path)
    result = ctx.wait(timeout=60)
    failure = result.failures[0]
    assert failure.exitcode == 138
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data["message"] == "<NONE>"
    assert failure.message == NO_ERROR_FILE_MESSAGE
    assert failure.signal_name() == "<N/A>"


@pytest.mark.parametrize("content", ['{"message": {"mess', "[1, 2]", '{"message": {}}'])
def test_unreadable_error_file_falls_back_to_the_exit_code(tmp_path, content, caplog):
    # A rank killed while writing its error file (or writing a foreign one)
    # must not make wait() raise.
    script = f"printf '%s' '{content}' > \"$TORCHELASTIC_ERROR_FILE\"; exit 3"
    ctx = start("/bin/sh", {0: ("-c", script)}, tmp_path)
    result = ctx.wait(timeout=60)
    failure = result.failures[0]
    assert failure.exitcode == 3
    assert failure.error_file_data["message"] == "<NONE>"
    assert failure.message == NO_ERROR_FILE_MESSAGE
    assert "could not be read" in caplog.text


def test_binary_killed_by_sigsegv_keeps_last_lines(tmp_path, capfd):
    ctx = start("/bin/sh", {0: ("-c", "echo last words; kill -SEGV $$")}, tmp_path, tee=Std.ALL)
    result = ctx.wait(timeout=60)
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGSEGV
    assert failure.signal_name() == "SIGSEGV"
    assert failure.message == f"Signal 11 (SIGSEGV) received by PID {failure.pid}"
    assert "[trainer0]:last words" in capfd.readouterr().out
    assert (tmp_path / "0" / "stdout.log").read_text() == "last words\n"


def test_wait_timeout_and_close_reaches_grandchildren(tmp_path):
    ctx = start("/bin/sh", {0: ("-c", f"sleep 600 & echo $! > {tmp_path}/child; wait")}, tmp_path)
    assert ctx.wait(timeout=0) is None
    assert ctx.wait(timeout=0.2) is None
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int((tmp_path / "child").read_text())
    (rank_pid,) = ctx.pids().values()
    assert not gone(grandchild)
    ctx.close(signal.SIGTERM, timeout=10)
    deadline = time.monotonic() + 10
    while not (gone(grandchild) and gone(rank_pid)):
        assert time.monotonic() < deadline, "close() missed the rank's child"
        time.sleep(0.05)


def test_signal_exception_handlers(tmp_path):
    ctx = start("/bin/sleep", {0: ("600",)}, tmp_path)
    try:
        with pytest.raises(elastic.SignalException) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert info.value.sigval == signal.SIGTERM
        assert str(info.value) == f"Process {os.getpid()} got signal: {signal.SIGTERM}"
    finally:
        ctx.close(signal.SIGKILL, timeout=10)


def test_sigkill_of_parent_kills_ranks_and_their_children(tmp_path):
    driver_code = textwrap.dedent(
        """
        import os, sys, time
        from fastspawn import elastic
        d = sys.argv[1]
        ctx = elastic.start_processes(
            "t", "/bin/sh",
            {r: ("-c", "sleep 600 & echo $$ $! > " + d + "/pids." + str(r) + "; wait")
              for r in range(4)},
            {r: {} for r in range(4)}, os.devnull)
        print("started", flush=True)
        ctx.wait()
        """
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", driver_code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        pids = []
        while len(pids) < 8:
            assert time.monotonic() < deadline
            pids = [int(p) for f in tmp_path.glob("pids.*") for p in f.read_text().split()]
            time.sleep(0.05)
        assert not any(gone(pid) for pid in pids)
    finally:
        kill_driver(driver)
    alive = alive_after(pids)
    assert alive == [], f"alive {KILL_BOUND_S:g} s after SIGKILL of the launcher: {alive}"


# ------------------------------------------------------- close, then wait


def wait_gone(pids, seconds=30):
    deadline = time.monotonic() + seconds
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.05)


@pytest.mark.parametrize("entrypoint", [time.sleep, "/bin/sleep"], ids=["function", "binary"])
def test_wait_after_close_reports_the_stopped_ranks(tmp_path, entrypoint):
    # Three ranks: after the first failure the core's join raises once more
    # for each other rank that ended badly; close() must swallow them all.
    ctx = start(entrypoint, {r: (60,) for r in range(3)}, tmp_path)
    pids = ctx.pids()
    ctx.close()
    result = ctx.wait(timeout=0)
    assert result is not None and result.is_failed()
    assert sorted(result.failures) == [0, 1, 2]
    assert result.return_values == {}
    for rank, failure in result.failures.items():
        assert failure.pid == pids[rank]
        assert failure.exitcode == -signal.SIGTERM
        assert failure.signal_name() == "SIGTERM"
        assert failure.message == f"Signal 15 (SIGTERM) received by PID {pids[rank]}"
    assert ctx.wait(timeout=-1) is result
    ctx.close()  # again: no error, same result
    assert ctx.wait(timeout=0) is result


def test_wait_after_close_keeps_a_rank_that_had_succeeded_out_of_failures(tmp_path):
    ctx = start("/bin/sh", {0: ("-c", "exit 0"), 1: ("-c", "exec sleep 60")}, tmp_path)
    wait_gone([ctx.pids()[0]])
    ctx.close()
    result = ctx.wait(timeout=0)
    assert result is not None and result.is_failed()
    assert list(result.failures) == [1]
    assert result.failures[1].signal_name() == "SIGTERM"


def test_wait_after_close_of_finished_ranks_is_a_success(tmp_path):
    ctx = start(workers.elastic_add, {0: (1, 2), 1: (3, 4)}, tmp_path, redirects=Std.ALL)
    wait_gone(ctx.pids().values())
    ctx.close()
    result = ctx.wait(timeout=0)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: 3, 1: 7}


def test_close_after_a_failure_keeps_the_failure(tmp_path):
    ctx = start(
        "/bin/sh",
        {0: ("-c", "exit 3"), 1: ("-c", "exec sleep 60"), 2: ("-c", "exec sleep 60")},
        tmp_path,
    )
    result = ctx.wait(timeout=60)
    # As torch's SubprocessContext: the ranks stopped after the failure too.
    assert result is not None and list(result.failures) == [0, 1, 2]
    assert [f.exitcode for f in result.failures.values()] == [3, -signal.SIGTERM, -signal.SIGTERM]
    ctx.close()  # the core's join raises for ranks 1 and 2 here: not out of close()
    assert ctx.wait(timeout=0) is result


# ------------------------------------------- a SignalException left uncaught


@pytest.mark.parametrize("entrypoint", ["time.sleep", "'/bin/sleep'"], ids=["function", "binary"])
def test_uncaught_signal_exception_stops_the_ranks(entrypoint):
    driver_code = textwrap.dedent(
        f"""
        import os, time
        from fastspawn import elastic
        ctx = elastic.start_processes(
            "t", {entrypoint}, {{0: (60,), 1: (60,)}}, {{0: {{}}, 1: {{}}}}, os.devnull)
        print(*ctx.pids().values(), flush=True)
        ctx.wait()
        """
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", driver_code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        driver.send_signal(signal.SIGTERM)
        try:
            _, err = driver.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher outlived SIGTERM, waiting for its ranks")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert "SignalException" in err
    wait_gone(pids, seconds=5)


# ------------------------------------------------------ a failed start


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_missing_binary_leaves_no_fd_or_file(tmp_path):
    before = open_fds()
    for _ in range(3):
        with pytest.raises(FileNotFoundError) as info:
            elastic.start_processes(
                "x", "/no/such/binary", {0: (), 1: ()}, empty(2), str(tmp_path), tee=Std.ALL
            )
        assert str(info.value).count("/no/such/binary") == 1
        assert info.value.filename == "/no/such/binary"
        assert "check the path" in str(info.value)
    assert open_fds() == before
    assert os.listdir(tmp_path) == []


def test_not_executable_names_the_path_once(tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError) as info:
        elastic.start_processes("x", str(script), {0: ()}, {0: {}}, os.devnull)
    assert str(info.value).count(str(script)) == 1


def test_failed_launch_removes_its_log_files_and_pipes(tmp_path):
    # The files and pipes exist by the time the launch fails: a function a
    # "spawn" worker cannot import.
    logs = tmp_path / "logs"
    logs.mkdir()
    before = open_fds()
    with pytest.raises(Exception, match="pickle|local object"):
        start(lambda: None, {0: (), 1: ()}, logs, start_method="spawn", tee=Std.ALL)
    assert open_fds() == before
    assert os.listdir(logs) == []
