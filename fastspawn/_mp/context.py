"""The contexts: one per built-in fastspawn start method, each a real
``multiprocessing.context.BaseContext`` whose ``Process`` fastspawn starts,
registered under its name with multiprocessing ("fastspawn" for the
default method, "fastspawn-<method>" for the others), so that
``multiprocessing.set_start_method("fastspawn")`` (or
``get_context("fastspawn-spawn")``) reaches it as it reaches "spawn".

This module is what a process's pickle names (its class), so the workers
import it: it imports only multiprocessing's context module, the table
of method names and the signal mask's helper; the launcher side
(``popen``) is imported at the first start.
"""

from __future__ import annotations

from multiprocessing import context as mp_context
from multiprocessing import process as mp_process

from fastspawn._launch.methods import names
from fastspawn._os.held import held_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from fastspawn._mp.popen import Popen


_launcher: type[Popen] | None = None  # fastspawn._mp.popen.Popen, once imported


def _popen_class() -> type[Popen]:
    """The launcher, imported at the first start (this module stays light
    for the workers) with signals held, as held.import_held says why."""
    global _launcher
    if _launcher is None:
        with held_signals():
            from fastspawn._mp.popen import Popen

        _launcher = Popen
    return _launcher


def _after_fork() -> None:
    """What a forked process's ``_bootstrap`` runs first
    (``BaseProcess._after_fork``, as multiprocessing's fork and forkserver
    processes have it): multiprocessing's finalizers forgotten and its
    after-fork callables run, each once in a process: a worker forked by
    fastspawn ran those registered before its set-up (see
    runner.run_after_forkers), and multiprocessing's own would run them a
    second time."""
    from multiprocessing import util

    from fastspawn._worker.runner import run_after_forkers

    util._finalizer_registry.clear()  # type: ignore[attr-defined]
    run_after_forkers()


def _spawned_after_fork() -> None:
    """A spawned process's: nothing, as multiprocessing's spawn processes
    have it (a new interpreter inherited no state to reset)."""


def _process_class(method: str) -> type[mp_process.BaseProcess]:
    """The Process class of ``method``'s context ("ZygoteProcess", ...):
    a module attribute, so that its instances pickle by reference."""

    def _Popen(process_obj: mp_process.BaseProcess) -> Popen:
        return _popen_class()(process_obj, method)

    name = f"{method.capitalize()}Process"
    cls = type(
        name,
        (mp_process.BaseProcess,),
        {
            "__doc__": f"A multiprocessing Process started by fastspawn's {method!r} method.",
            "__module__": __name__,
            "_start_method": names.context_name(method),
            "_Popen": staticmethod(_Popen),
            "_after_fork": staticmethod(
                _spawned_after_fork if method in names.SPAWNED else _after_fork
            ),
        },
    )
    globals()[name] = cls
    return cls


class FastspawnContext(mp_context.BaseContext):
    """A multiprocessing context whose processes fastspawn starts with one
    start method; every object made from it (Queue, Lock, Pool, Manager,
    ...) is multiprocessing's own."""

    def __init__(self, method: str) -> None:
        self._name = names.context_name(method)
        self.Process = _process_class(method)

    def get_context(self, method: str | None = None) -> Any:
        """This context (None), or fastspawn's called ``method`` (see
        ``fastspawn.get_context``), as multiprocessing's contexts give one
        another.

        Raises:
            ValueError: an unknown method; the message lists the valid ones.
        """
        return self if method is None else context_for(method)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return context_for, (self._name,)

    def __repr__(self) -> str:
        return f"<fastspawn context {self._name!r}>"


CONTEXTS: dict[str, FastspawnContext] = {
    names.context_name(method): FastspawnContext(method) for method in names.BUILTIN
}


def valid_names() -> list[str]:
    """What fastspawn's ``get_context`` and ``set_start_method`` take."""
    return [*CONTEXTS, *names.BUILTIN]


def context_for(method: str) -> FastspawnContext:
    """The context called ``method``: a fastspawn method's name ("spawn")
    or its context's ("fastspawn-spawn").

    Raises:
        ValueError: neither; the message lists the valid names.
    """
    ctx = None
    if isinstance(method, str):
        ctx = CONTEXTS.get(method) or CONTEXTS.get(names.context_name(method))
    if ctx is None:
        raise ValueError(
            f"cannot find context for {method!r}: fastspawn's start methods are "
            + ", ".join(repr(known) for known in valid_names())
        )
    return ctx


class Process(mp_process.BaseProcess):
    """``fastspawn.Process``: a multiprocessing Process started the way
    fastspawn's default context says (the zygote unless
    ``fastspawn.set_start_method`` chose another), as
    ``multiprocessing.Process`` follows multiprocessing's default."""

    _start_method = None  # the child keeps multiprocessing's default as the caller's

    @staticmethod
    def _Popen(process_obj: mp_process.BaseProcess) -> Popen:
        return DEFAULT.get_context().Process._Popen(process_obj)  # type: ignore[no-any-return]

    @staticmethod
    def _after_fork() -> None:
        return DEFAULT.get_context().Process._after_fork()  # type: ignore[no-any-return]


class DefaultContext(mp_context.DefaultContext):
    """fastspawn's default context (the module functions of ``fastspawn``):
    multiprocessing's DefaultContext over fastspawn's contexts, the default
    method's unless ``set_start_method`` chose another."""

    Process = Process  # type: ignore[assignment]

    def get_context(self, method: str | None = None) -> Any:
        """``fastspawn.get_context()``: a multiprocessing context whose
        processes fastspawn starts, for whatever takes one
        (``DataLoader(multiprocessing_context=...)``,
        ``ProcessPoolExecutor(mp_context=...)``), or to make a Pool, a
        Manager, queues and locks from.

        Args:
            method: None for the default (the zygote's, "fastspawn", unless
                ``fastspawn.set_start_method`` chose another); a fastspawn
                start method ("zygote", "spawn", "fork", "forkserver") or its
                context's name ("fastspawn", "fastspawn-spawn", ...).

        Returns:
            A ``multiprocessing.context.BaseContext``; its
            ``get_start_method()`` is the context's name, which
            ``multiprocessing.get_context`` and
            ``multiprocessing.set_start_method`` take too.

        Raises:
            ValueError: an unknown method; the message lists the valid ones.
        """
        if method is None:
            if self._actual_context is None:  # type: ignore[has-type]
                self._actual_context = self._default_context  # type: ignore[attr-defined]
            return self._actual_context
        return context_for(method)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        """Make ``method`` (a name of ``get_all_start_methods()``, or a
        fastspawn method's short name) the default; None, with ``force``,
        forgets the choice.  Only ``fastspawn``'s own names follow it; to
        make all of a program's multiprocessing use fastspawn, call
        ``multiprocessing.set_start_method("fastspawn")``.

        Raises:
            RuntimeError: a method was chosen already (and ``force`` is False).
            ValueError: an unknown method; the message lists the valid ones.
        """
        if self._actual_context is not None and not force:
            raise RuntimeError("context has already been set")
        if method is None and force:
            self._actual_context = None
            return
        self._actual_context = self.get_context(method)

    def get_all_start_methods(self) -> list[str]:
        return list(CONTEXTS)

    def __repr__(self) -> str:
        return f"<fastspawn default context ({self.get_context()._name!r})>"


DEFAULT = DefaultContext(CONTEXTS[names.context_name(names.DEFAULT)])


def register() -> None:
    """Make multiprocessing know fastspawn's contexts by name (idempotent)."""
    for name, ctx in CONTEXTS.items():
        mp_context._concrete_contexts.setdefault(name, ctx)  # type: ignore[attr-defined]


register()
