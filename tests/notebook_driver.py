"""Run a notebook in a real Jupyter kernel through nbclient (for test_notebook).

Run as ``python notebook_driver.py SPEC.json RESULT.json``, in a process of
its own, so that nbclient's event loop, zmq sockets and the kernel (its
child) are all gone when it exits.  SPEC holds ``cells`` (code strings),
``timeout`` (seconds a cell may take) and ``triggers``: for a cell index,
``{"when": [texts], "then": "interrupt" | "touch", "path": ...}``: once
every text has appeared in that cell's stream output, the kernel is
interrupted (as the notebook's stop button does, through the kernel
manager) or the file at ``path`` is created.  RESULT gets each cell's
outputs, in order.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import nbformat
from nbclient import NotebookClient


class Client(NotebookClient):
    """A NotebookClient that acts on what a cell prints, while it runs."""

    def __init__(self, nb: Any, triggers: dict[int, list[dict[str, Any]]], **kwargs: Any) -> None:
        super().__init__(nb, **kwargs)
        self.triggers = triggers
        self.printed: dict[int, str] = {}
        self.pending: list[asyncio.Future[Any]] = []

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        if msg["msg_type"] == "stream":
            self.printed[cell_index] = self.printed.get(cell_index, "") + msg["content"]["text"]
            self.fire(cell_index)
        return super().process_message(msg, cell, cell_index)

    def fire(self, cell_index: int) -> None:
        printed = self.printed[cell_index]
        for trigger in self.triggers.get(cell_index, []):
            if trigger.get("fired") or not all(text in printed for text in trigger["when"]):
                continue
            trigger["fired"] = True
            if trigger["then"] == "interrupt":
                self.pending.append(asyncio.ensure_future(self.km.interrupt_kernel()))
            else:
                with open(trigger["path"], "w"):
                    pass


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in spec["cells"]]
    triggers = {int(index): list(found) for index, found in spec.get("triggers", {}).items()}
    client = Client(
        nb,
        triggers,
        timeout=spec["timeout"],
        kernel_name="python3",
        allow_errors=True,
        shutdown_kernel="graceful",
        resources={"metadata": {"path": spec["cwd"]}},
    )
    client.execute()
    with open(sys.argv[2], "w") as f:
        json.dump([cell.outputs for cell in nb.cells], f)


if __name__ == "__main__":
    main()
