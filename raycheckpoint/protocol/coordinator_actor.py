"""The job's coordinator as a named Ray actor: its name, its namespace, and starting it.

One coordinator per checkpoint root (:class:`~raycheckpoint.protocol.coordinator.CheckpointCoordinator`),
named after the root (:func:`actor_name`, in :data:`NAMESPACE`), so that a second job on
the same root, or ``python -m raycheckpoint.request``, finds it.  The manager calls
:func:`start`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raycheckpoint.protocol.coordinator import CheckpointCoordinator
from raycheckpoint.protocol.paths import root_id
from raycheckpoint.storage import Storage, StorageSpec

if TYPE_CHECKING:  # the job's config, handed down by the manager
    from raycheckpoint.config import CheckpointConfig

NAMESPACE = "raycheckpoint"  # the Ray namespace of every job's coordinator actor


def actor_name(storage: Storage) -> str:
    """The Ray actor name of the coordinator of the job writing to ``storage``'s root."""
    return "coordinator-" + root_id(storage.url())


def start(spec: StorageSpec, config: CheckpointConfig, lease_job_id: str | None,
          verifier: Callable[[StorageSpec], Any] | None = None, *,
          durable: StorageSpec | None = None, durable_lease_job_id: str | None = None,
          memory: StorageSpec | None = None) -> Any:
    """Start the coordinator of ``spec``'s root as a named, threaded Ray actor;
    ``verifier(spec)`` starts the background verifier when a verification is due.
    ``durable``: a tiered job's durable root, where committed checkpoints of ``spec``
    (the local tier) are replicated; the actor is then named after it.  ``memory``: its
    memory tier (``checkpoint.memory_replicas``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = actor_name((durable or spec).open())
    # on the driver's node where it can: a coordinator on a worker node dies with that node
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            return ray.remote(CheckpointCoordinator).options(
                name=name, namespace=NAMESPACE, max_concurrency=64, num_cpus=0,
                scheduling_strategy=here).remote(spec, config, lease_job_id=lease_job_id, verifier=verifier,
                                   durable=durable, durable_lease_job_id=durable_lease_job_id,
                                   memory=memory)
        except ValueError as e:  # the name is held: a previous coordinator still shutting down
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"another checkpoint coordinator ({name}) is running for {config.save_dir}; "
                    "one job per checkpoint root") from e
            time.sleep(0.5)
