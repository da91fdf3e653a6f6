"""Starting or joining Ray from a driver, and sizing the object store of the one it starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import psutil
import ray

MIB = 2**20
OBJECT_STORE_FLOOR = 256 * MIB   # enough for the built-in model and the checkpoint's messages
WEIGHT_COPIES = 4                # the actor's weights fetched, put for the rollout, and the
                                 # previous sync's copies not yet released
MEMORY_SHARE = 0.3               # Ray's own default share of the machine's memory


def object_store_bytes(model_bytes: int, memory_bytes: int, shm_bytes: int | None = None) -> int:
    """The object store of a local Ray for a job whose policy weighs ``model_bytes``.

    Every sync moves the actor's full weights to the rollout through the object store, so
    it holds :data:`WEIGHT_COPIES` times the weights, at least :data:`OBJECT_STORE_FLOOR`
    and at most :data:`MEMORY_SHARE` of ``memory_bytes`` and what ``/dev/shm`` has
    (``shm_bytes``; beyond it Ray moves the store to disk); never below the floor.
    """
    cap = int(memory_bytes * MEMORY_SHARE)
    if shm_bytes is not None:
        cap = min(cap, int(shm_bytes))
    return max(OBJECT_STORE_FLOOR, min(WEIGHT_COPIES * int(model_bytes), cap))


def machine_object_store_bytes(model_bytes: int) -> int:
    """:func:`object_store_bytes` for this machine's memory and ``/dev/shm``."""
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    return object_store_bytes(model_bytes, psutil.virtual_memory().total, shm)


def init_ray(num_cpus: int = 8, model_bytes: Callable[[], int] | None = None) -> None:
    """Join the cluster named by RAY_ADDRESS (``ray job submit``), else start a local one.

    The local one's object store is :func:`object_store_bytes` for ``model_bytes()`` (the
    weights the job moves through it; called only when Ray is started here), else
    :data:`OBJECT_STORE_FLOOR`.

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
    store = machine_object_store_bytes(model_bytes()) if model_bytes else OBJECT_STORE_FLOOR
    temp = tempfile.mkdtemp(prefix="rcray-", dir=os.environ.get("RAYCHECKPOINT_RAY_TMPDIR", "/tmp"))
    start_reaper(temp)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp,
             object_store_memory=store, log_to_driver=False,
             configure_logging=False)


def start_reaper(temp: str) -> subprocess.Popen:
    """Start the process that ends this driver's local Ray once the driver is gone."""
    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, "-m", "drivers._reaper", str(me.pid), repr(me.create_time()), temp],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        close_fds=True)
