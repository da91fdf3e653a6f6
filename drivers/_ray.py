"""Starting or joining Ray from a driver."""

from __future__ import annotations

import os
import tempfile

import ray


def init_ray(num_cpus: int = 8) -> None:
    """Join the cluster named by RAY_ADDRESS (``ray job submit``), else start a local one.

    A local instance never joins another cluster on the machine and keeps its files in
    a fresh temporary directory.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="rcray-", dir="/tmp"),
             object_store_memory=256 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
