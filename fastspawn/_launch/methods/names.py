"""The built-in start methods' names and the default, for the modules that
must stay light and cannot import the registry: fastspawn._mp.context,
which every process of a multiprocessing context imports.  Also how a
method's multiprocessing context is called."""

from __future__ import annotations

BUILTIN = ("zygote", "spawn", "fork", "forkserver")
DEFAULT = "zygote"
# Those whose workers are new interpreters, not forks: nothing inherited
# to reset in them (a multiprocessing Process's _after_fork does nothing).
SPAWNED = ("spawn",)


def context_name(method: str) -> str:
    """The name multiprocessing knows a method's context by: "fastspawn"
    for the default method, "fastspawn-<method>" for the others."""
    return "fastspawn" if method == DEFAULT else f"fastspawn-{method}"


def method_of_context(name: str) -> str:
    """The method a context name (``context_name``) stands for; ``name``
    itself when it is none."""
    if name == "fastspawn":
        return DEFAULT
    return name.removeprefix("fastspawn-")
