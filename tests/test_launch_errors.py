"""A failed launch names what failed; the C API cffi binds is the header's."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from fastspawn import elastic
from fastspawn._os import oscall
from fastspawn._os._core import ffi, lib

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "fastspawn.h"


def header_text() -> str:
    return re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.DOTALL)


# ------------------------------------------------- the header is the API


def test_every_function_of_the_header_is_bound():
    names = re.findall(r"\b(fs_\w+)\s*\(", header_text())
    assert len(names) >= 10, names  # the pattern still matches the header
    missing = [name for name in names if not hasattr(lib, name)]
    assert missing == []


def test_launch_spec_fields_are_the_headers():
    body = re.search(r"struct fs_launch_spec\s*\{(.*?)\};", header_text(), re.DOTALL)
    assert body is not None
    declared = re.findall(r"(\w+)\s*;", body.group(1))
    bound = [name for name, _ in ffi.typeof("struct fs_launch_spec").fields]
    assert bound == declared


# ------------------------------------------------- which step failed


def closed_fd() -> int:
    """A number >= 3 that is no open fd of this process (for the moment)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    assert fd >= 3
    return fd


def test_missing_cwd_names_the_directory_not_the_binary(tmp_path):
    cwd = str(tmp_path / "no-such-dir")
    with pytest.raises(FileNotFoundError) as info:
        oscall.launch("/bin/true", ["true"], {}, cwd=cwd)
    assert info.value.filename == cwd
    assert "from chdir to the launch's cwd" in str(info.value)
    assert "/bin/true" not in str(info.value)


def test_cwd_that_is_a_file_is_not_a_directory(tmp_path):
    cwd = tmp_path / "a-file"
    cwd.write_text("")
    with pytest.raises(NotADirectoryError) as info:
        oscall.launch("/bin/true", ["true"], {}, cwd=str(cwd))
    assert info.value.filename == str(cwd)
    assert "from chdir" in str(info.value)


def test_missing_binary_names_the_binary(tmp_path):
    # The cwd exists: the exec, not the chdir, fails, and the error says so.
    path = str(tmp_path / "no-such-binary")
    with pytest.raises(FileNotFoundError) as info:
        oscall.launch(path, ["x"], {}, cwd=str(tmp_path))
    assert info.value.filename == path
    assert str(info.value) == f"[Errno 2] No such file or directory (from fs_launch): {path!r}"
    assert "chdir" not in str(info.value)


def test_binary_relative_to_the_cwd_is_found_there(tmp_path):
    # execve resolves a relative path after the chdir: in the launch's cwd.
    os.symlink("/bin/true", tmp_path / "true-here")
    pid, pidfd = oscall.launch("./true-here", ["true-here"], {}, cwd=str(tmp_path))
    try:
        assert oscall.pidfd_wait(pidfd, nohang=False) == 0
    finally:
        os.close(pidfd)


def test_bad_stdio_fd_names_dup2():
    with pytest.raises(OSError) as info:
        oscall.launch("/bin/true", ["true"], {}, stdout=closed_fd())
    assert info.value.errno == errno.EBADF
    assert "(from dup2 of the launch's stdin, stdout or stderr)" in str(info.value)
    assert info.value.filename is None


def test_bad_keep_fd_names_keep_fds():
    with pytest.raises(OSError) as info:
        oscall.launch("/bin/true", ["true"], {}, keep_fds=[closed_fd()])
    assert info.value.errno == errno.EBADF
    assert "(from fcntl(F_SETFD) on the launch's keep_fds)" in str(info.value)
    assert info.value.filename is None


def test_joining_a_missing_group_names_setpgid():
    # No group has an id above any pid_max: setpgid(2) says EPERM.
    group = 2**22 + 12345
    with pytest.raises(PermissionError) as info:
        oscall.launch("/bin/true", ["true"], {}, process_group=group)
    assert f"(from setpgid to join process group {group})" in str(info.value)
    assert info.value.filename is None


def test_bad_pdeathsig_names_prctl():
    with pytest.raises(OSError) as info:
        oscall.launch("/bin/true", ["true"], {}, pdeathsig=999)
    assert info.value.errno == errno.EINVAL
    assert "(from prctl(PR_SET_PDEATHSIG) in the launched child)" in str(info.value)
    assert info.value.filename is None


# Each step of enum fs_launch_step, and what its error says.  setsid, the
# signal mask and clone do not fail on demand: their messages are checked
# on the error alone.
STEP_MESSAGES = {
    "FS_STEP_CLONE": "Resource temporarily unavailable (from clone); the limit on processes",
    "FS_STEP_PDEATHSIG": "(from prctl(PR_SET_PDEATHSIG) in the launched child)",
    "FS_STEP_SETSID": "(from setsid in the launched child)",
    "FS_STEP_SETPGID": "(from setpgid to a new process group)",
    "FS_STEP_STDIO": "(from dup2 of the launch's stdin, stdout or stderr)",
    "FS_STEP_KEEP_FDS": "(from fcntl(F_SETFD) on the launch's keep_fds)",
    "FS_STEP_CHDIR": "(from chdir to the launch's cwd)",
    "FS_STEP_SIGMASK": "(from sigprocmask in the launched child)",
    "FS_STEP_EXEC": "(from fs_launch)",
}


def test_every_step_has_a_message():
    steps = {name for name in dir(lib) if name.startswith("FS_STEP_")}
    assert steps - {"FS_STEP_NONE"} == set(STEP_MESSAGES)


@pytest.mark.parametrize("name", sorted(STEP_MESSAGES))
def test_step_message(name):
    error = oscall._launch_error(
        errno.EAGAIN if name == "FS_STEP_CLONE" else errno.EPERM,
        getattr(lib, name),
        "/the/binary",
        "/the/cwd",
        True,
        0,
    )
    assert STEP_MESSAGES[name] in str(error)
    expected = {"FS_STEP_EXEC": "/the/binary", "FS_STEP_CHDIR": "/the/cwd"}.get(name)
    assert error.filename == expected


# ------------------------------------------------- through the public API


def test_binary_ranks_start_in_the_callers_cwd(tmp_path, monkeypatch):
    # elastic takes no cwd: a binary rank starts where its caller is.
    monkeypatch.chdir(tmp_path)
    ctx = elastic.start_processes("x", "/bin/sh", {0: ("-c", "pwd > where")}, {0: {}}, os.devnull)
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed()
    assert (tmp_path / "where").read_text().strip() == str(tmp_path)


def test_binary_ranks_true_and_a_missing_binary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = elastic.start_processes("x", "/bin/true", {0: (), 1: ()}, {0: {}, 1: {}}, os.devnull)
    result = ctx.wait(timeout=60)
    assert result is not None and result.return_values == {0: None, 1: None}
    missing = str(tmp_path / "no-such-binary")
    with pytest.raises(FileNotFoundError) as info:
        elastic.start_processes("x", missing, {0: ()}, {0: {}}, os.devnull)
    assert info.value.filename == missing
    assert str(info.value).count(str(tmp_path)) == 1
