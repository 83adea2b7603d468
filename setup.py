import shutil

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError


class BuildExtNamingTheCompiler(build_ext):  # type: ignore[misc]
    """Says plainly when there is no C compiler, and what to do instead
    (setuptools' own error is a bare ENOENT for 'gcc')."""

    def build_extension(self, ext: object) -> None:
        command = getattr(self.compiler, "compiler_so", None) or ["cc"]
        if shutil.which(command[0]) is None:
            raise CompileError(
                f"fastspawn: building its C extension needs a C compiler, and {command[0]!r} "
                "is not on PATH (or CC names none). Install one (Debian and Ubuntu: "
                "apt-get install gcc; Fedora: dnf install gcc; Alpine: apk add gcc musl-dev), "
                "or install a prebuilt wheel rather than this source distribution: "
                "pip install --only-binary fastspawn fastspawn"
            )
        super().build_extension(ext)


# Everything declarative lives in pyproject.toml; cffi_modules cannot, nor
# the wheel's tag: the extension uses the limited API (cffi builds
# _core.abi3.so), so one wheel serves every CPython from 3.10 on.
setup(
    cffi_modules=["csrc/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExtNamingTheCompiler},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
