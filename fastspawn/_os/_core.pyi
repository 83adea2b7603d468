# The cffi extension built from csrc/ (see csrc/build.py); typed loosely.
from typing import Any

ffi: Any
lib: Any
