"""Where the RL job's worker groups run: devices, resources and placement.

``trainer.device`` decides what each rank asks Ray for: ``cuda`` (or ``auto`` on a cluster
that has or can start GPU nodes) asks for one GPU per rank, ``cpu`` for none.  Each role
gets its own placement group (``trainer.placement_strategy``), or with
``trainer.colocate=true`` one placement group holds rank i of every role in bundle i,
sharing its GPU with fractional GPU resources, as verl's hybrid engine does.  Before any
placement group, :func:`drivers.capacity.check_capacity` refuses a job the cluster can
never hold (it would wait out the placement timeout).
"""

from __future__ import annotations

import json
from typing import Any

import ray

from drivers.capacity import cluster_capacity, job_asks, shortfall
from drivers.config import section
from drivers.verl_keys import fail
from workers.device import DEVICES
from workers.group import Placement, place_ranks, start_ranks
from workers.roles import CriticWorker, PolicyWorker, RewardWorker
from workers.rollout import RolloutWorker

RPC = 600.0


def cluster_gpus() -> float:
    """GPUs the cluster has now, or failing that, can start: the node types its autoscaler
    reports (Ray's v2 autoscaler does; with the v1 autoscaler a cluster that has no GPU
    node yet counts as none: give ``trainer.device=cuda`` there)."""
    now = float(ray.cluster_resources().get("GPU", 0))
    if now:
        return now
    try:  # the autoscaler publishes its node types to the GCS
        from ray._private.state import state

        return float((state.get_max_resources_from_cluster_config() or {}).get("GPU", 0))
    except Exception:  # noqa: BLE001 - no autoscaler (a local instance): none to start
        return 0.0


def job_device(opts: dict[str, Any]) -> str:
    """``cuda`` when the ranks get GPUs, else ``cpu`` (raises, one line, for ``cuda`` on a
    cluster without any)."""
    requested = opts["trainer.device"]
    if requested not in DEVICES:
        fail(f"trainer.device must be auto, cuda or cpu, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    gpus = cluster_gpus()
    if requested == "cuda" and not gpus:
        fail("trainer.device=cuda but no GPU is visible: this Ray cluster has no GPU resources "
             "and none to start (use trainer.device=cpu or auto)")
    return "cuda" if gpus else "cpu"


def rank_resources(opts: dict[str, Any], device: str) -> dict[str, float]:
    res = opts["trainer.worker_resources"]
    res = json.loads(res) if isinstance(res, str) else dict(res or {})
    if device == "cuda":
        res.setdefault("GPU", 1)
    return res


def role_specs(opts: dict[str, Any], roles: list[str], total_steps: int) -> dict[str, tuple[Any, dict]]:
    """Each role's worker class and arguments."""
    model = section(opts, "actor_rollout_ref.model.")
    seed = opts["trainer.seed"]
    common = {"device": opts["trainer.device"]}

    def value_model(key: str) -> dict[str, Any]:
        path = opts[key]
        spec = {**model, "path": path or model.get("path"), "key": key if path else
                "actor_rollout_ref.model.path"}
        return {**spec, "tokenizer_path": model.get("path")}

    specs: dict[str, tuple[Any, dict[str, Any]]] = {
        "actor": (PolicyWorker, {"model": model, "seed": seed, "trainable": True,
                                 "rollout_weights": rollout_lags(opts),
                                 "optim": {"lr": opts["actor_rollout_ref.actor.optim.lr"],
                                           "end_factor": opts["actor_rollout_ref.actor.optim.end_factor"],
                                           "total_steps": total_steps}}),
        "reference": (PolicyWorker, {"model": model, "seed": seed, "trainable": False}),
        "reward": (RewardWorker, {"model": value_model("reward_model.model.path"), "seed": seed + 1000,
                                  "trainable": False, "value_model": True}),
        "rollout": (RolloutWorker, {
            "model": model, "seed": seed, "engine": opts["actor_rollout_ref.rollout.name"],
            "temperature": opts["actor_rollout_ref.rollout.temperature"],
            "max_new_tokens": opts["actor_rollout_ref.rollout.response_length"],
            "engine_options": section(opts, "actor_rollout_ref.rollout.")}),
        "critic": (CriticWorker, {"model": value_model("critic.model.path"), "seed": seed + 2000,
                                  "trainable": True, "value_model": True,
                                  "optim": {"lr": opts["critic.optim.lr"], "total_steps": total_steps}}),
    }
    return {role: (cls, {**kwargs, **common}) for role, (cls, kwargs) in specs.items() if role in roles}


def rollout_lags(opts: dict[str, Any]) -> bool:
    """Whether the rollout samples with weights older than the actor's between two syncs
    (the asynchronous mode with ``trigger_parameter_sync_step > 1``): the actor keeps them."""
    return bool(opts.get("async_training.enable")
                and int(opts.get("async_training.trigger_parameter_sync_step") or 1) > 1)


def placements(opts: dict[str, Any], roles: list[str], worlds: dict[str, int],
               device: str) -> dict[str, Placement]:
    """One placement per role: its own, or (colocate) one shared by every role."""
    res = rank_resources(opts, device)
    cpus, strategy = opts["trainer.cpus_per_worker"], opts["trainer.placement_strategy"]
    if not opts["trainer.colocate"]:
        return {role: place_ranks(worlds[role], resources=res, num_cpus=cpus, strategy=strategy,
                                  timeout_s=RPC) for role in roles}
    if not res:
        fail("trainer.colocate=true shares each rank's GPU among the roles: it needs GPUs "
             "(trainer.device=cuda or auto with GPUs) or trainer.worker_resources")
    if len(set(worlds.values())) > 1:
        fail(f"trainer.colocate=true puts rank i of every role on GPU i: the roles' ranks must "
             f"be as many, got {worlds}")
    shared = place_ranks(worlds[roles[0]], resources=res, num_cpus=cpus, strategy=strategy, timeout_s=RPC,
                         share=len(roles))
    return {role: shared if i == 0 else shared.another_group(RPC) for i, role in enumerate(roles)}


def check_capacity(opts: dict[str, Any], roles: list[str], world: int | dict[str, int],
                   device: str) -> None:
    """Refuse (one line, naming what the job asks for and what the cluster has) a job
    the cluster can never hold, before any placement group waits for it."""
    why = shortfall(job_asks(opts, roles, world, rank_resources(opts, device)), cluster_capacity(), opts)
    if why:
        fail(why)


def start_groups(opts: dict[str, Any], roles: list[str], world: int | dict[str, int],
                 total_steps: int) -> tuple[dict[str, list[Any]], str]:
    """Start every role's ranks (``world``: as many for every role, or each role's number;
    all actors first, then wait for all); the job's device."""
    worlds = world if isinstance(world, dict) else dict.fromkeys(roles, world)
    device = job_device(opts)
    check_capacity(opts, roles, worlds, device)
    specs = role_specs(opts, roles, total_steps)
    places = placements(opts, roles, worlds, device)
    groups = {role: start_ranks(cls, places[role], role=role, world_size=worlds[role], timeout_s=RPC,
                                num_cpus=opts["trainer.cpus_per_worker"], **kwargs)
              for role, (cls, kwargs) in specs.items()}
    ready = ray.get([w.ready.remote() for ws in groups.values() for w in ws], timeout=RPC)
    nodes = sorted({r["node_id"] for r in ready})
    print(f"worker groups placed on {len(nodes)} node(s): " + "; ".join(
        f"{role}: " + ",".join(str(nodes.index(r["node_id"])) for r in ready if r["role"] == role)
        for role in groups), flush=True)
    if any(r.get("gpu_ids") for r in ready):
        print("GPUs per rank: " + "; ".join(
            f"{role}: " + ",".join("+".join(r["gpu_ids"]) for r in ready if r["role"] == role)
            for role in groups), flush=True)
    devices = sorted({r["device"] for r in ready})
    print(f"ranks compute on {', '.join(devices)} (trainer.device={opts['trainer.device']}, "
          f"{'one GPU per rank' if device == 'cuda' else 'no GPU requested'}"
          f"{', roles colocated' if opts['trainer.colocate'] else ''})", flush=True)
    return groups, device
