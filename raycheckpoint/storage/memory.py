"""MemoryStorage: a root in this process's memory (``memory://``), for tests and tools.

fsspec's memory filesystem is one process's dictionary: other processes (Ray workers,
the coordinator actor) never see what is written, so a job refuses such a root
(``Capabilities.shared`` is False).  Its exclusive create is atomic: the check and the
write happen under one lock, and nothing outside this process can write in between.
Otherwise it is the generic fsspec backend.
"""

from __future__ import annotations

import threading

from raycheckpoint.storage.base import Storage
from raycheckpoint.storage.spec import Capabilities

_CREATE_LOCK = threading.Lock()  # every memory:// root of this process: one dictionary


class MemoryStorage(Storage):
    """A root in this process's memory: seen by no other process."""

    caps = Capabilities(shared=False, atomic_create=True)

    def _create_once(self, full: str, data: bytes) -> None:
        with _CREATE_LOCK:
            if self.fs.exists(full):
                raise FileExistsError(full)
            self.fs.pipe_file(full, data)
