"""MemoryStorage: a root in this process's memory (``memory://``), for tests and tools.

fsspec's memory filesystem is one process's dictionary: other processes (Ray workers,
the coordinator actor) never see what is written, so a job refuses such a root
(``Capabilities.shared`` is False).  Otherwise it is the generic fsspec backend.
"""

from __future__ import annotations

from raycheckpoint.storage.base import Storage
from raycheckpoint.storage.spec import Capabilities


class MemoryStorage(Storage):
    """A root in this process's memory: seen by no other process."""

    caps = Capabilities(shared=False)
