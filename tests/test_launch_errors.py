"""A failed launch names what failed; the C API cffi binds is the header's."""

from __future__ import annotations

import re
from pathlib import Path

from fastspawn._core import ffi, lib

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
