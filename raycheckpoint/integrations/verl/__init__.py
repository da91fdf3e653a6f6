"""raycheckpoint for verl jobs.

* :class:`FSDPCheckpointManager` (:mod:`.manager`): a drop-in for verl's manager of the
  same name, saving and loading through raycheckpoint;
* :func:`read_role` (:mod:`.checkpoint_files`): a role that verl's own manager wrote,
  read whole and without running code.

Importing this package does not import verl.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDPCheckpointManager", "VerlCheckpointError", "read_role"]


def __getattr__(name: str) -> Any:  # torch and Ray load only when a name is used
    if name == "FSDPCheckpointManager":
        from raycheckpoint.integrations.verl.manager import FSDPCheckpointManager

        return FSDPCheckpointManager
    if name in ("read_role", "VerlCheckpointError"):
        from raycheckpoint.integrations.verl import checkpoint_files

        return getattr(checkpoint_files, name)
    raise AttributeError(name)
