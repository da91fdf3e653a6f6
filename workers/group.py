"""Worker groups: W Ray actors forming one process group.

One rank per GPU (or one gloo process per rank on CPU).  Locally the ranks run
where Ray puts them on this node and meet on 127.0.0.1; with per-rank resources (a
cluster) they get a placement group and meet at rank 0's node (:func:`place_ranks`).
Every wait has a timeout, so a rank that dies cannot leave the others blocked forever.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

# Ports this process has handed out: never handed out twice, so two groups started
# together cannot both be told the same master port.
_GIVEN: set[int] = set()
_LISTEN_LOW = 20000  # above Ray's worker ports (10002-19999 by default)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(exclude: Collection[int] = ()) -> int:
    """A TCP port free on this host now, for a server that binds it a moment later.

    It is drawn outside the kernel's ephemeral range: a port from ``bind(("", 0))``
    can be taken, before the server binds it, by any process's outgoing connection
    (seen as ``EADDRINUSE`` from a process group's store), while a port below that
    range is only ever taken by a server that names it.  Never a port in ``exclude``
    or one this process has already handed out.
    """
    low = _ephemeral_low()
    taken = _GIVEN.union(exclude)
    if low - _LISTEN_LOW >= 1024:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(_LISTEN_LOW, low)
            if port not in taken and _bindable(port):
                _GIVEN.add(port)
                return port
    for _ in range(200):  # a host whose ephemeral range leaves no room below it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free TCP port found on this host after 400 tries")


def init_process_group(*, rank: int, world_size: int, master_addr: str, master_port: int,
                       timeout_s: float, backend: str = "gloo") -> None:
    """Join this actor's process group (one thread per rank: 2 cores are shared by many ranks).

    ``backend`` is torch's: ``"gloo"``, or ``"cpu:gloo,cuda:nccl"`` for ranks holding GPU
    state (FSDP on NCCL, object collectives on gloo).
    """
    torch.set_num_threads(1)
    if master_addr.startswith("127.") or master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


@dataclass
class Placement:
    """Where one group's ranks run: the process group's master, and each rank's actor options.

    ``remove()`` gives the placement group's resources (GPUs) back to the cluster; the
    ranks' actors must be gone or going.
    """

    master_addr: str
    master_port: int
    options: Callable[[int], dict[str, Any]] = field(default=lambda rank: {})
    placement_group: Any = None
    master_node: str | None = None

    def remove(self) -> None:
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    def another_group(self, timeout_s: float = 120.0) -> Placement:
        """The same places for another process group (colocated roles: rank i of every role
        in bundle i): a fresh master port on rank 0's node; the placement group stays
        owned by this placement."""
        if self.master_node is None:
            return dataclasses.replace(self, master_port=free_port(), placement_group=None)
        return dataclasses.replace(self, master_port=_free_port_on(self.master_node, timeout_s),
                                   placement_group=None)


def _free_port_on(node_id: str, timeout_s: float) -> int:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    port = ray.get(ray.remote(free_port).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote(sorted(_GIVEN)), timeout=timeout_s)
    _GIVEN.add(port)
    return port


def bundle_of(resources: dict[str, float], num_cpus: float = 0, share: int = 1) -> dict[str, float]:
    """One rank's placement-group bundle: ``resources`` plus the CPUs of the ``share``
    actors that run in it (what :func:`place_ranks` asks for, and what
    :mod:`drivers.capacity` checks the cluster can hold)."""
    return {**resources, **({"CPU": num_cpus * share} if num_cpus else {})}


def place_ranks(world_size: int, *, resources: dict[str, float] | None = None,
                num_cpus: float = 0, strategy: str = "PACK",
                timeout_s: float = 600.0, share: int = 1) -> Placement:
    """Place ``world_size`` ranks.

    Without ``resources`` every rank runs where Ray puts it on this node (a local run) and
    the group meets on 127.0.0.1.  With them (per rank, e.g. ``{"GPU": 1}``), the group
    gets a placement group of ``world_size`` bundles (the autoscaler starts nodes for it:
    the wait is ``timeout_s``), and the process group's master is rank 0's node, on a
    port that node reports free.  Each rank's actor asks for its bundle's GPUs (so Ray
    assigns it the GPU: ``CUDA_VISIBLE_DEVICES``) divided by ``share``: with ``share=k``,
    k actors (the colocated roles' rank i, see :meth:`Placement.another_group`) fit in
    bundle i and share its GPU.
    """
    if not resources:
        return Placement("127.0.0.1", free_port())
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = bundle_of(resources, num_cpus, share)
    pg = ray.util.placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        node_id = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
        addr = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        port = _free_port_on(node_id, timeout_s)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    gpus = {"num_gpus": resources["GPU"] / share} if resources.get("GPU") else {}
    return Placement(addr, port, lambda rank: {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=rank), **gpus}, pg, node_id)


def start_ranks(worker_cls: Any, placement: Placement, *, role: str, world_size: int,
                timeout_s: float, num_cpus: float = 0, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` actors of ``worker_cls`` (a ``ray.remote`` class) where
    ``placement`` says, without waiting for them.

    Each actor receives ``role``, ``rank``, ``world_size``, ``master_addr``, ``master_port``
    and ``timeout_s`` plus ``kwargs``, and must form the process group in ``__init__``.
    """
    return [worker_cls.options(num_cpus=num_cpus, **placement.options(rank)).remote(
        role=role, rank=rank, world_size=world_size, master_addr=placement.master_addr,
        master_port=placement.master_port, timeout_s=timeout_s, **kwargs)
        for rank in range(world_size)]


def create_worker_group(worker_cls: Any, *, role: str, world_size: int, timeout_s: float = 120.0,
                        num_cpus: float = 0, placement: Placement | None = None,
                        **kwargs: Any) -> list[Any]:
    """:func:`start_ranks`, then wait until every rank is ready.

    ``placement`` (from :func:`place_ranks`) says where; by default, this node.
    """
    actors = start_ranks(worker_cls, placement or place_ranks(world_size), role=role,
                         world_size=world_size, timeout_s=timeout_s, num_cpus=num_cpus, **kwargs)
    ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
    return actors
