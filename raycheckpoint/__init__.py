"""raycheckpoint: Ray-native checkpointing for distributed RL post-training of LLMs.

Public API::

    from raycheckpoint import CheckpointConfig, CheckpointManager, CheckpointableWorker

See DESIGN section 6 for the module map.
"""

__version__ = "0.1.0"

from raycheckpoint.config import CheckpointConfig
from raycheckpoint.errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    CommitTimeoutError,
    ConfigMismatchError,
    IncompatibleCheckpointError,
    IntegrityError,
    LightCheckpointError,
    RayCheckpointError,
)
from raycheckpoint.manager import CheckpointManager, LoadResult, SaveHandle
from raycheckpoint.resume import verify_checkpoint
from raycheckpoint.retention import RetentionPolicy
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
    "LightCheckpointError",
    "LoadResult",
    "RayCheckpointError",
    "ResumableSampler",
    "RetentionPolicy",
    "SaveHandle",
    "Storage",
    "StorageSpec",
    "__version__",
    "capture_rng",
    "restore_rng",
    "verify_checkpoint",
]
