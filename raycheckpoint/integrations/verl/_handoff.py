"""The data loader's state, handed from verl's trainer to the actor role's rank 0, so that
it is committed inside the actor's checkpoint of the same step.

verl's trainer holds the data loader in its own process and saves each role through the
role's ranks; the role's rank 0 begins the save with the coordinator.  Before verl's
``_save_checkpoint`` runs, the switch's trainer side (:mod:`.trainer`) puts the loader's
state for step ``N`` into a small Ray actor of its own, named after the actor role's
root; rank 0 takes it when it begins that role's save of step ``N``
(:meth:`RoleRoot.begin <raycheckpoint.integrations.verl._root.RoleRoot.begin>`), and
the coordinator writes it into ``trainer_state.json``, listed and checksummed in the
manifest like every file of the checkpoint.  The actor lives as long as the trainer's
process; where there is none (verl's trainer without the switch, verl's own tests), a
save carries no loader state and the resume falls back to verl's ``data.pt``.
"""

from __future__ import annotations

from typing import Any

from raycheckpoint.protocol import coordinator_actor
from raycheckpoint.protocol.paths import root_id

TIMEOUT_S = 60.0
_HOLDERS: dict[str, Any] = {}  # the trainer's handles, one per root


def actor_name(url: str) -> str:
    return "verl-data-" + root_id(url)


class _Pending:
    """The newest published state: ``(step, state)``."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.state: Any = None

    def put(self, step: int, state: Any) -> None:
        self.step, self.state = step, state

    def take(self, step: int) -> Any:
        return self.state if step == self.step else None


def publish(url: str, step: int, state: Any, timeout: float = TIMEOUT_S) -> None:
    """The trainer: ``state`` (JSON-safe, see ``encode_loader_state``) is the loader's
    position at ``step``, for the save of ``step`` into the root at ``url``."""
    import ray

    holder = _HOLDERS.pop(url, None)
    if holder is not None:
        try:
            ray.get(holder.put.remote(step, state), timeout=timeout)
        except Exception:  # noqa: BLE001 - gone (with the Ray instance it was made in): anew
            holder = None
    if holder is None:
        holder = ray.remote(num_cpus=0)(_Pending).options(
            name=actor_name(url), namespace=coordinator_actor.NAMESPACE, get_if_exists=True).remote()
        ray.get(holder.put.remote(step, state), timeout=timeout)
    _HOLDERS[url] = holder  # Ray ends an actor (named or not) once no handle to it is left


def take(url: str, step: int, timeout: float = TIMEOUT_S) -> Any:
    """Rank 0 of the role at ``url``: the state published for ``step``, or None."""
    import ray

    try:
        holder = ray.get_actor(actor_name(url), namespace=coordinator_actor.NAMESPACE)
    except ValueError:  # no trainer publishes: verl's own trainer, or verl's tests
        return None
    return ray.get(holder.take.remote(step), timeout=timeout)
