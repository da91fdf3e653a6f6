"""Worker groups: W Ray actors forming one gloo process group on 127.0.0.1.

A "GPU" here is one rank; on CPU each rank is one gloo process.  Every wait has a
timeout, so a rank that dies cannot leave the others blocked forever.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(*, rank: int, world_size: int, master_addr: str, master_port: int,
                       timeout_s: float) -> None:
    """Join this actor's gloo group (one thread per rank: 2 cores are shared by many ranks)."""
    torch.set_num_threads(1)
    if master_addr.startswith("127.") or master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def create_worker_group(worker_cls: Any, *, role: str, world_size: int, timeout_s: float = 120.0,
                        num_cpus: float = 0, **kwargs: Any) -> list[Any]:
    """Start ``world_size`` actors of ``worker_cls`` (a ``ray.remote`` class) as one group.

    Each actor receives ``role``, ``rank``, ``world_size``, ``master_addr``, ``master_port``
    and ``timeout_s`` plus ``kwargs``, and must form the process group in ``__init__``.
    """
    port = free_port()
    actors = [worker_cls.options(num_cpus=num_cpus).remote(
        role=role, rank=rank, world_size=world_size, master_addr="127.0.0.1",
        master_port=port, timeout_s=timeout_s, **kwargs) for rank in range(world_size)]
    ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
    return actors
