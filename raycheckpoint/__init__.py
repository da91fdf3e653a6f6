"""raycheckpoint: Ray-native checkpointing for distributed RL post-training of LLMs.

Public API::

    from raycheckpoint import CheckpointConfig, CheckpointManager, CheckpointableWorker

The module map is ``docs/ARCHITECTURE.md``.
"""

import importlib
from typing import TYPE_CHECKING, Any

from raycheckpoint._version import __version__

# Names are imported on first use, so tools that only read storage (the ``raycheckpoint``
# command) start without importing Ray or torch.
_EXPORTS = {
    "CheckpointConfig": "raycheckpoint.config",
    "CheckpointNotFoundError": "raycheckpoint.errors",
    "CheckpointSaveError": "raycheckpoint.errors",
    "CommitTimeoutError": "raycheckpoint.errors",
    "ConfigMismatchError": "raycheckpoint.errors",
    "IncompatibleCheckpointError": "raycheckpoint.errors",
    "IntegrityError": "raycheckpoint.errors",
    "LightCheckpointError": "raycheckpoint.errors",
    "LeaseHeldError": "raycheckpoint.errors",
    "LeaseLostError": "raycheckpoint.errors",
    "MissingDependencyError": "raycheckpoint.errors",
    "RayCheckpointError": "raycheckpoint.errors",
    "StorageCapabilityError": "raycheckpoint.errors",
    "CheckpointManager": "raycheckpoint.manager",
    "LoadResult": "raycheckpoint.loader",
    "SaveHandle": "raycheckpoint.save_handle",
    "verify_checkpoint": "raycheckpoint.protocol.checkpoint",
    "RetentionPolicy": "raycheckpoint.policy.retention",
    "ResumableSampler": "raycheckpoint.state",
    "capture_rng": "raycheckpoint.state",
    "restore_rng": "raycheckpoint.state",
    "Storage": "raycheckpoint.storage",
    "StorageSpec": "raycheckpoint.storage",
    "CheckpointableWorker": "raycheckpoint.worker",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raycheckpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from raycheckpoint.config import CheckpointConfig
    from raycheckpoint.errors import (
        CheckpointNotFoundError,
        CheckpointSaveError,
        CommitTimeoutError,
        ConfigMismatchError,
        IncompatibleCheckpointError,
        IntegrityError,
        LeaseHeldError,
        LeaseLostError,
        LightCheckpointError,
        RayCheckpointError,
        StorageCapabilityError,
    )
    from raycheckpoint.loader import LoadResult
    from raycheckpoint.manager import CheckpointManager
    from raycheckpoint.policy.retention import RetentionPolicy
    from raycheckpoint.protocol.checkpoint import verify_checkpoint
    from raycheckpoint.save_handle import SaveHandle
    from raycheckpoint.state import ResumableSampler, capture_rng, restore_rng
    from raycheckpoint.storage import Storage, StorageSpec
    from raycheckpoint.worker import CheckpointableWorker

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointableWorker",
    "CommitTimeoutError",
    "ConfigMismatchError",
    "IncompatibleCheckpointError",
    "IntegrityError",
    "LeaseHeldError",
    "LeaseLostError",
    "LightCheckpointError",
    "LoadResult",
    "RayCheckpointError",
    "ResumableSampler",
    "RetentionPolicy",
    "SaveHandle",
    "Storage",
    "StorageCapabilityError",
    "StorageSpec",
    "__version__",
    "capture_rng",
    "restore_rng",
    "verify_checkpoint",
]
