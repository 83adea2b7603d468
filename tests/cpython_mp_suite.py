"""CPython's own multiprocessing suite (``Lib/test/_test_multiprocessing.py``,
its "processes" tests), installed for one of fastspawn's contexts as
CPython installs it per start method:
``FASTSPAWN_SUITE_METHOD=fastspawn python cpython_mp_suite.py [unittest
options]``.  tests/test_cpython_suite.py runs it.

The tests are installed at import, as in CPython's own modules: the
processes import this module as their main module, and find the test
classes there; the method comes in the environment, which they inherit.

With the fork context one test is skipped, one that CPython skips for
"fork" (its name is another here).
"""

from __future__ import annotations

import inspect
import os
import unittest

import test._test_multiprocessing as suite

import fastspawn  # registers the contexts' names with multiprocessing

METHOD = os.environ.get("FASTSPAWN_SUITE_METHOD", "fastspawn")
if METHOD not in fastspawn.get_all_start_methods():
    raise SystemExit(
        f"FASTSPAWN_SUITE_METHOD={METHOD!r}: one of {fastspawn.get_all_start_methods()}"
    )

SKIP: dict[str, str] = {}

if METHOD == "fastspawn-fork":
    # A forked child inherits the caller's fds, those of the processes it
    # started before included: CPython skips this test for "fork", "by
    # design".
    SKIP["test_child_fd_inflation"] = "fork: children inherit the caller's fds (as CPython's)"

if "only_type" in inspect.signature(suite.install_tests_in_module_dict).parameters:
    suite.install_tests_in_module_dict(globals(), METHOD, only_type="processes")
else:  # Python 3.10: every type installed; keep the processes tests, as only_type does
    suite.install_tests_in_module_dict(globals(), METHOD)
    for _name, _case in list(globals().items()):
        if isinstance(_case, type) and issubclass(_case, unittest.TestCase):
            if not _name.startswith("WithProcesses"):
                del globals()[_name]
for _case in list(globals().values()):
    if isinstance(_case, type) and issubclass(_case, unittest.TestCase):
        for _name, _why in SKIP.items():
            if hasattr(_case, _name):
                setattr(_case, _name, unittest.skip(_why)(getattr(_case, _name)))

if __name__ == "__main__":
    unittest.main()
