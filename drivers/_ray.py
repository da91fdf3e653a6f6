"""Starting or joining Ray from a driver."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import psutil
import ray


def init_ray(num_cpus: int = 8) -> None:
    """Join the cluster named by RAY_ADDRESS (``ray job submit``), else start a local one.

    A local instance never joins another cluster on the machine and keeps its files in
    a fresh temporary directory (under ``RAYCHECKPOINT_RAY_TMPDIR``, default ``/tmp``).
    It ends with the driver, also when the driver is killed: a reaper process
    (:mod:`drivers._reaper`) ends the instance's processes by their recorded PIDs and by
    that directory, and removes it.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    temp = tempfile.mkdtemp(prefix="rcray-", dir=os.environ.get("RAYCHECKPOINT_RAY_TMPDIR", "/tmp"))
    start_reaper(temp)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp,
             object_store_memory=256 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)


def start_reaper(temp: str) -> subprocess.Popen:
    """Start the process that ends this driver's local Ray once the driver is gone."""
    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, "-m", "drivers._reaper", str(me.pid), repr(me.create_time()), temp],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        close_fds=True)
