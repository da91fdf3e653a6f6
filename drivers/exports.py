"""verl's ``hf_model`` save content: a Hugging Face export of the actor beside each
committed checkpoint, written in the background (training goes on meanwhile).

One daemon thread exports the checkpoints in the order they committed.  A job that stops
early (SIGTERM, preemption) does not wait for an export in flight: it is left without
its ``manifest.json``, which marks it incomplete (``raycheckpoint export`` writes one
from the checkpoint at any time).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from raycheckpoint import Storage
from raycheckpoint.hf_export import export_dir, write_beside
from raycheckpoint.protocol.checkpoint import open_verified


class HFExports:
    def __init__(self, root: str, storage_options: dict[str, Any], role: str = "actor") -> None:
        self.storage = Storage(root, storage_options)
        self.role = role
        self._todo: queue.Queue[str | None] = queue.Queue()
        self._done: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hf-export", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        self._todo.put(name)

    def _run(self) -> None:
        while (name := self._todo.get()) is not None:
            try:
                m = write_beside(open_verified(self.storage, name), self.role)
                self._done.put(f"hf export {name}: {self.role}, {m['tensors']} tensors -> "
                               f"{self.storage.url(export_dir(name))}")
            except Exception as e:  # noqa: BLE001 - the checkpoint stays valid without it
                self._done.put(f"hf export {name} failed: {e}")

    def finished(self) -> list[str]:
        """Events for the exports done since the last call."""
        events = []
        while not self._done.empty():
            events.append(self._done.get())
        return events

    def close(self, timeout_s: float) -> list[str]:
        """Wait (at most ``timeout_s``) for the exports submitted; their events."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        return self.finished()
