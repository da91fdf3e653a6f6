"""Ray actor workers that hold a role's FSDP2 shard and checkpoint it with raycheckpoint."""

from workers.fsdp_worker import FSDPTrainWorker, TinyLMConfig
from workers.group import create_worker_group, free_port

__all__ = ["FSDPTrainWorker", "TinyLMConfig", "create_worker_group", "free_port"]
