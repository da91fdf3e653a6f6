"""Whether the cluster can ever hold what the RL job asks for: checked before any placement group.

A placement group the cluster can never place waits out its whole timeout (600 s) before
it fails.  :func:`check_capacity` refuses such a job at once, naming what the job asks for
(per resource, in total and per rank's bundle, with the keys that decide it) and what the
cluster has, and says which settings fit.  It compares:

* the total of every resource the job's bundles ask for with the cluster's total: the
  alive nodes', or the most an autoscaler can start (Ray's v2 autoscaler publishes its
  node types; the v1 autoscaler of ``ray up`` / ``cluster.yaml`` does not, so a cluster it
  can grow is never refused: the job waits for its nodes, as before);
* each bundle with the largest node (one bundle always lands on one node), the whole
  group with one node for ``STRICT_PACK``, and the bundles with the number of nodes that
  fit one for ``STRICT_SPREAD``.

A job that fits the cluster's totals but not what is free now (another job holds the
GPUs) keeps the bounded wait of :func:`workers.group.place_ranks`.
Called by :func:`drivers.groups.start_groups`; :func:`job_asks` mirrors
:func:`drivers.groups.placements`, and :func:`shortfall` is pure (the tests call it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.group import bundle_of


@dataclass(frozen=True)
class Ask:
    """One placement group (or, without per-rank resources, a role's plain actors)."""

    roles: tuple[str, ...]       # the roles whose ranks it holds (several: colocated)
    ranks: int                   # bundles (one per rank)
    bundle: dict[str, float]     # what each bundle asks for
    strategy: str = "PACK"


@dataclass(frozen=True)
class Capacity:
    """What the cluster has: its alive nodes' resources and what an autoscaler can add."""

    nodes: tuple[dict[str, float], ...]
    autoscaling: bool = False                     # an autoscaler can start nodes
    node_types: tuple[dict[str, float], ...] = ()  # the node types it starts (when it says)
    max_total: dict[str, float] | None = None      # the most it can reach (None: it does not say)

    def total(self, resource: str) -> float:
        now = sum(n.get(resource, 0.0) for n in self.nodes)
        return max(now, float((self.max_total or {}).get(resource, 0.0)))


def job_asks(opts: dict[str, Any], roles: list[str], world: int | dict[str, int],
             resources: dict[str, float]) -> list[Ask]:
    """What :func:`drivers.groups.placements` will ask Ray for, one :class:`Ask` per group
    (``world``: every role's ranks, or each role's)."""
    worlds = world if isinstance(world, dict) else dict.fromkeys(roles, world)
    cpus, strategy = opts["trainer.cpus_per_worker"], opts["trainer.placement_strategy"]
    if not resources:  # plain actors, each asking for its CPUs
        return [Ask((role,), worlds[role], {"CPU": float(cpus)} if cpus else {}) for role in roles]
    if not opts["trainer.colocate"]:
        return [Ask((role,), worlds[role], bundle_of(resources, cpus), strategy) for role in roles]
    return [Ask(tuple(roles), worlds[roles[0]], bundle_of(resources, cpus, len(roles)), strategy)]


def _n(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _amount(x: float, resource: str) -> str:
    return f"{_n(x)} {resource}" + ("s" if resource in ("GPU", "CPU") and x != 1 else "")


def _what(asks: list[Ask], resource: str, opts: dict[str, Any]) -> str:
    """How the job's total of ``resource`` adds up, with the keys behind it."""
    per_rank = {a.bundle.get(resource, 0.0) for a in asks}
    rank = _n(per_rank.pop()) if len(per_rank) == 1 else "varying"
    if len(asks) == 1 and len(asks[0].roles) > 1:
        parts = f"{', '.join(asks[0].roles)} colocated: {asks[0].ranks} ranks"
    else:
        parts = " + ".join(f"{'/'.join(a.roles)} {a.ranks}" for a in asks)
    keys = (f"trainer.n_gpus_per_node={opts['trainer.n_gpus_per_node']} x "
            f"trainer.nnodes={opts['trainer.nnodes']} ranks per role")
    if resource == "CPU":
        keys += f", trainer.cpus_per_worker={opts['trainer.cpus_per_worker']}"
    elif resource != "GPU" or opts["trainer.worker_resources"]:
        keys += f", trainer.worker_resources={opts['trainer.worker_resources']}"
    return f"({parts}, {rank} {resource} per rank; {keys})"


def _fix(resource: str, have: float) -> str:
    if resource == "GPU":
        if have < 1:
            return ("this cluster has no GPU: run with trainer.device=cpu (and no GPU in "
                    "trainer.worker_resources)")
        if have < 2:
            return "on one GPU run with trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.colocate=true"
        return (f"with trainer.colocate=true the roles share each rank's GPU: make "
                f"trainer.n_gpus_per_node x trainer.nnodes at most {int(have)}")
    if resource == "CPU":
        return "lower trainer.cpus_per_worker (or the ranks per role)"
    return "change trainer.worker_resources, or add nodes that have it"


def _fits(node: dict[str, float], need: dict[str, float]) -> bool:
    return all(node.get(r, 0.0) >= v for r, v in need.items() if v > 0)


def shortfall(asks: list[Ask], cap: Capacity, opts: dict[str, Any]) -> str | None:
    """Why the cluster can never hold ``asks`` (one line), or None when it can or might."""
    if cap.autoscaling and cap.max_total is None:
        return None  # an autoscaler that does not say how far it grows: wait for it
    resources = sorted({r for a in asks for r, v in a.bundle.items() if v > 0},
                       key=lambda r: (r != "GPU", r != "CPU", r))
    for r in resources:
        need = sum(a.ranks * a.bundle.get(r, 0.0) for a in asks)
        have = cap.total(r)
        if need > have + 1e-9:
            grow = " (its autoscaler included)" if cap.autoscaling else ""
            return (f"the job asks for {_amount(need, r)} {_what(asks, r, opts)} but the cluster "
                    f"has {_amount(have, r)}{grow}; {_fix(r, have)}")
    places = cap.nodes + cap.node_types
    for a in asks:
        need = {r: v for r, v in a.bundle.items() if v > 0}
        label = "/".join(a.roles)
        if not any(_fits(n, need) for n in places):
            biggest = ", ".join(f"{_n(max((n.get(r, 0.0) for n in places), default=0))} {r}"
                                for r in sorted(need))
            return (f"each {label} rank asks for {json.dumps(need, sort_keys=True)} on one node but "
                    f"no node of the cluster has that much (the most on one node: {biggest}); lower "
                    "what a rank asks for (trainer.worker_resources, trainer.cpus_per_worker)")
        if a.strategy == "STRICT_PACK":
            whole = {r: v * a.ranks for r, v in need.items()}
            if not any(_fits(n, whole) for n in places):
                return (f"trainer.placement_strategy=STRICT_PACK puts all {a.ranks} {label} ranks on "
                        f"one node, {json.dumps(whole, sort_keys=True)} in all, but no node of the "
                        "cluster has that much; use PACK")
        if a.strategy == "STRICT_SPREAD" and not cap.autoscaling:
            fit = sum(_fits(n, need) for n in cap.nodes)
            if fit < a.ranks:
                return (f"trainer.placement_strategy=STRICT_SPREAD puts each of the {a.ranks} {label} "
                        f"ranks on its own node, but {fit} node(s) of the cluster can hold one; "
                        "use PACK")
    return None


def starts_nodes(status: dict[str, Any]) -> bool:
    """Whether the (v1) autoscaler whose status (Ray's ``__autoscaling_status``) this is
    runs from a config with node types, so it can start nodes: it names its nodes by type,
    where a cluster without one (``ray start``, a local instance) names each by its id
    (``node_<id>``, read-only)."""
    from ray.autoscaler._private.util import format_readonly_node_type

    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping") or {}
    return any(kind != format_readonly_node_type(node) for node, kind in mapping.items())


def autoscaler_status() -> dict[str, Any] | None:
    """The v1 autoscaler's last status (None before its first report)."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    return json.loads(raw) if raw else None


def cluster_capacity() -> Capacity:
    """The connected cluster's :class:`Capacity`."""
    import ray

    nodes = tuple({k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n["Alive"])
    try:  # Ray's v2 autoscaler publishes its node types to the GCS
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - no readable autoscaler config: treated as none
        config = None
    if config is not None and config.node_group_configs:
        types = tuple({k: float(v) for k, v in g.resources.items()} for g in config.node_group_configs
                      if g.max_count != 0)
        most = state.get_max_resources_from_cluster_config() or {}
        return Capacity(nodes, autoscaling=True, node_types=types,
                        max_total={k: float(v) for k, v in most.items()})
    try:
        status = autoscaler_status()
    except Exception:  # noqa: BLE001 - an unreadable status: no autoscaler known
        status = None
    return Capacity(nodes, autoscaling=bool(status) and starts_nodes(status))
