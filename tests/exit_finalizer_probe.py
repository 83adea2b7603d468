"""A weakref.finalize made when this module is imported, marked to run at
exit, as torch makes many: a zygote that preloads it has weakref's exit
hook registered with atexit already, so a finalizer one of its workers
makes registers nothing more, and only the worker's exit runs it
(test_robustness.py)."""

from __future__ import annotations

import weakref


class _Held:
    """What the finalizer watches (kept alive: it runs at exit, if at all)."""


HELD = _Held()
FINALIZER = weakref.finalize(HELD, int)  # does nothing
