"""cffi build script for fastspawn._os._core (API mode, compiled at install)."""

import re
from pathlib import Path

from cffi import FFI

HEADER = Path(__file__).with_name("fastspawn.h")


def declarations(header: str) -> str:
    """The header as cffi's cdef takes it: no comments, no preprocessor lines.

    cdef parses declarations only (no #include, no #ifndef guard), and the
    system types it does not know are declared up front: pid_t as an integer
    type whose size the C compiler settles (``int...``).
    """
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header, flags=re.DOTALL)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.MULTILINE)
    return "typedef int... pid_t;\n" + text


ffibuilder = FFI()
# The header is the one definition of the C API: the declarations cffi binds
# are read from it, never copied by hand.
ffibuilder.cdef(declarations(HEADER.read_text()))
ffibuilder.set_source(
    "fastspawn._os._core",
    '#include "fastspawn.h"',
    # setuptools wants paths relative to the project root.
    sources=[
        f"csrc/{name}"
        for name in (
            "pdeathsig.c",
            "pidfd.c",
            "waiter.c",
            "memory.c",
            "arena.c",
            "launch.c",
            "group.c",
            "fdidentity.c",
            "stacks.c",
            "forkloop.c",
        )
    ],
    include_dirs=["csrc"],
    extra_compile_args=["-Wall", "-Wextra", "-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
