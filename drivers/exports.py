"""verl's ``hf_model`` save content: a Hugging Face export of the actor beside each
committed checkpoint, written in the background (training goes on meanwhile)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raycheckpoint import Storage
from raycheckpoint.hf_export import export_dir, write_beside
from raycheckpoint.protocol.checkpoint import open_verified


class HFExports:
    """Exports committed checkpoints one at a time, in the order they committed."""

    def __init__(self, root: str, storage_options: dict[str, Any], role: str = "actor") -> None:
        self.storage = Storage(root, storage_options)
        self.role = role
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-export")
        self._pending: list[tuple[str, Future]] = []

    def submit(self, name: str) -> None:
        self._pending.append((name, self._pool.submit(self._export, name)))

    def _export(self, name: str) -> dict[str, Any]:
        return write_beside(open_verified(self.storage, name), self.role)

    def finished(self) -> list[str]:
        """Events for the exports done since the last call."""
        done = [(n, f) for n, f in self._pending if f.done()]
        self._pending = [(n, f) for n, f in self._pending if not f.done()]
        events = []
        for name, future in done:
            error = future.exception()
            if error is None:
                m = future.result()
                events.append(f"hf export {name}: {self.role}, {m['tensors']} tensors -> "
                              f"{self.storage.url(export_dir(name))}")
            else:  # the checkpoint stays valid without it (retention may have removed it first)
                events.append(f"hf export {name} failed: {error}")
        return events

    def close(self, timeout_s: float) -> list[str]:
        """Wait for the exports still running (at most ``timeout_s`` each); their events."""
        for _, future in self._pending:
            try:
                future.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - reported by finished()
                pass
        events = self.finished()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return events
