"""A tiered job loses a whole node and resumes bit for bit (run by tests/test_tiers.py).

    python -m tests.cluster.node_loss TEMP_DIR S3_ENDPOINT KEY SECRET

On a three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and
two worker nodes, every Ray file under TEMP_DIR/ray:
:mod:`tests.cluster.local_cluster`), a two-rank FSDP2 group runs one rank per worker
node and saves tiered: the memory tier (``memory_replicas=1``: each rank's files on its
node and on the other one), the local tier in each node's own directory
(TEMP_DIR/nvme/<node id>, ``local_dir_per_node``), the durable tier on the S3 server,
every second checkpoint replicated.  After step 5 (memory and local only; step 4 is
durable) the node of rank 1 is removed without a graceful stop (every Ray process of it
SIGKILLed, its replica holder and its directory's agent with it) and its local directory
deleted, as a lost node's disk is.  A replacement node joins, a new group and manager
start, and ``auto`` resumes step 5 from the surviving holder's memory.  Then the
replicas are lost too (the holders ended): the local tier lacks rank 1's files of steps
4 and 5, and ``auto`` resumes step 4 from the durable tier.  Prints one JSON line: per
phase the tier and step resumed from, whether the state equals the one saved then, and
the recovery time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid

import ray

from raycheckpoint import CheckpointConfig, CheckpointManager
from raycheckpoint.protocol import catalog, memory
from raycheckpoint.storage import Storage
from raycheckpoint.storage.raymem import live_holders
from tests.cluster import local_cluster
from tests.helpers import assert_same
from workers import FSDPTrainWorker, create_worker_group
from workers.group import place_ranks

TIMEOUT = 120


def spread_group() -> tuple[list, list[str], object]:
    """Two ranks, one per worker node; (actors, their node ids, their placement)."""
    placement = place_ranks(2, resources={"CPU": 1}, strategy="STRICT_SPREAD", timeout_s=TIMEOUT)
    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=2, timeout_s=TIMEOUT,
                                placement=placement)
    where = ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                     for w in group], timeout=TIMEOUT)
    return group, where, placement


def resume(m: CheckpointManager, group: list, saved: dict, t0: float) -> dict:
    """``auto``: what was resumed, from where, whether bit for bit, and how fast."""
    loaded = m.load_checkpoint("auto")
    out = {"name": loaded.name, "tier": loaded.tier, "recovery_s": time.perf_counter() - t0,
           "load_s": loaded.load_s}
    now = ray.get([w.full_state.remote() for w in group], timeout=TIMEOUT)
    try:
        for a, b in zip(now, saved[loaded.step], strict=True):
            assert_same(a, b)
        out["bitwise"] = True
    except (AssertionError, KeyError) as e:
        out["bitwise"] = repr(e)
    return out


def main(temp: str, endpoint: str, key: str, secret: str) -> int:
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    local = os.path.join(temp, "nvme", "{node_id}")
    root = f"s3://ckpt/node-loss-{uuid.uuid4().hex[:8]}"
    options = {"endpoint_url": endpoint, "key": key, "secret": secret}
    cfg = CheckpointConfig(save_dir=root, storage_options=options, local_dir=local,
                           local_dir_per_node=True,
                           replicate_every=2, keep_last_n_local=2, memory_replicas=1,
                           publish_metrics=False,
                           commit_timeout_s=60, rpc_timeout_s=TIMEOUT, save_wait_timeout_s=TIMEOUT,
                           lease_ttl_s=5)
    # the head holds no CPU for ranks: one rank per worker node (STRICT_SPREAD over two)
    cluster = local_cluster.start(temp, num_cpus=0)
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address)
    out: dict = {}
    try:
        group, where, placement = spread_group()
        out["rank_nodes"] = len(set(where))
        m = CheckpointManager(cfg, {"actor": group})
        saved = {}
        for step in range(1, 6):
            ray.get([w.train_step.remote(step) for w in group], timeout=TIMEOUT)
            m.update(step=step)
            m.save_checkpoint().wait(TIMEOUT)
            if step >= 4:
                saved[step] = ray.get([w.full_state.remote() for w in group], timeout=TIMEOUT)
                assert ray.get(m.coordinator.wait_replication.remote(60), timeout=TIMEOUT)
        status = m.replication()
        out["memory_before"] = status["memory"]["held"]
        out["uploaded_by_nodes"] = status["last"]["uploaded_at_source"] == status["last"]["files"]
        tier = m.roots.memory.open().root
        out["holders_before"] = len(live_holders(tier))
        out["durable_before"] = sorted(x.name for x in catalog.scan(Storage(root, options))[0])
        disks = [Storage(local.replace("{node_id}", n)) for n in where]
        out["local_before"] = [sorted(x.name for x in catalog.scan(d)[0]) for d in disks]
        # each node's directory: its own rank's shard of step 5, and all of the metadata
        out["shards_step5"] = [sorted(p.rsplit("/", 1)[1] for p in d.list_files("step_00000005")
                                      if p.endswith(".distcp")) for d in disks]
        # the node of rank 1 is lost: every Ray process of it SIGKILLed, its disk gone
        doomed = next(n for n in nodes if n.node_id == where[1])
        cluster.remove_node(doomed, allow_graceful=False)
        deadline = time.monotonic() + 60  # the cluster notices (health checks), as a restart would
        while any(n["NodeID"] == where[1] and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError("the removed node is still alive to the cluster after 60 s")
            time.sleep(0.5)
        shutil.rmtree(local.replace("{node_id}", where[1]))
        try:
            m.close(10, release_memory=False)
        except Exception:  # noqa: BLE001 - its rank is dead: the old job cannot close cleanly
            m.roots.release()
        for w in group:
            ray.kill(w)
        placement.remove()
        cluster.add_node(num_cpus=1)  # the replacement
        t0 = time.perf_counter()
        group, where2, _ = spread_group()
        m = CheckpointManager(cfg, {"actor": group})
        out["memory"] = resume(m, group, saved, t0)
        out["replacement_used"] = len(set(where2) - set(where)) == 1
        # the replicas are lost too: the durable tier has the newest it can give
        memory.release(tier)
        ray.get([w.train_step.remote(99) for w in group], timeout=TIMEOUT)
        out["durable"] = resume(m, group, saved, time.perf_counter())
        m.close(60)
    finally:
        print(json.dumps(out), flush=True)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
