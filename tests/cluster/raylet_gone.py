"""A worker whose raylet is killed ends within seconds (run by tests/test_no_orphans.py).

    python -m tests.cluster.raylet_gone TEMP_DIR

Starts a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, every Ray
file under TEMP_DIR: :mod:`tests.cluster.local_cluster`), places one
of this project's actors (the background verifier, which installs the exit path of
``raycheckpoint/_internal/exit.py``) on the second node, SIGKILLs that node's raylet and
prints, as JSON, how long the actor's process took to end (``null``: still alive after
30 s).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import ray

from raycheckpoint.storage import StorageSpec
from raycheckpoint.verifier import CheckpointVerifier
from tests.cluster import local_cluster


def main(temp: str) -> int:
    cluster = local_cluster.start(temp, num_cpus=1)
    node = cluster.add_node(num_cpus=1, resources={"doomed": 1})
    ray.init(address=cluster.address)
    try:
        actor = ray.remote(CheckpointVerifier).options(resources={"doomed": 1}, num_cpus=0).remote(
            StorageSpec(os.path.join(temp, "root"), {}))
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=120)
        proc = psutil.Process(pid)
        raylet = node.all_processes["raylet"][0].process
        os.kill(raylet.pid, signal.SIGKILL)
        t0 = time.monotonic()
        gone = None
        while time.monotonic() - t0 < 30:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                gone = time.monotonic() - t0
                break
            time.sleep(0.1)
        print(json.dumps({"actor_pid": pid, "raylet_pid": raylet.pid, "gone_after_s": gone}))
        if gone is None:
            proc.kill()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
