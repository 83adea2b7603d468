"""TorchElastic-style launching: N copies of a function or a binary, with
per-rank args and envs, log files, tee and error files.

The surface follows ``torch.distributed.elastic.multiprocessing``
(``start_processes``, ``Std``, ``RunProcsResult``, ``ProcessFailure``,
``SignalException``, the ``{rank}/stdout.log|stderr.log|error.json`` layout
and ``TORCHELASTIC_ERROR_FILE``).  Underneath, every rank is a fastspawn
worker: orphan-safe (a rank and its children die with the launcher), waited
on through pidfds, tee'd by one event loop.

This package is that public face; its modules: ``api`` (the public types),
``logs`` (the log-file layout, ``LogsSpecs``), ``pcontext`` (``PContext``),
``start`` (``start_processes``), ``tee`` (the ranks' lines to the console).
"""

from __future__ import annotations

from fastspawn.elastic.api import ProcessFailure, RunProcsResult, SignalException, Std, to_map
from fastspawn.elastic.logs import DefaultLogsSpecs, LogsDest, LogsSpecs
from fastspawn.elastic.pcontext import PContext
from fastspawn.elastic.start import start_processes

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "start_processes",
    "to_map",
]
