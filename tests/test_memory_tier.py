"""The memory tier (``checkpoint.memory_replicas``): the newest full checkpoint held in the
memory of replica-holder actors, read first on resume, bit for bit; a replica that does
not match its manifest is passed over; a lost holder is re-created by the next save.

On one node (this test's Ray instance) every replica is on the ranks' own node; the
cluster test (tests/cluster/node_loss.py) loses a whole node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray

from raycheckpoint import Storage, admin
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.memory import tier_id, tier_uri
from raycheckpoint.protocol.paths import CheckpointPaths
from raycheckpoint.storage.raymem import live_holders
from tests.helpers import RPC_TIMEOUT, assert_same, full_state, manager, train

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:checkpoint.memory_replicas. every rank runs")]


def config(local: str) -> dict:
    return {"local_dir": local, "memory_replicas": 1, "replicate_every": 2,
            "keep_last_n_local": 2}


def save_steps(m, group, steps) -> dict:
    """Train and save each of ``steps``; the state after each."""
    states = {}
    for step in steps:
        train(group, [step])
        m.update(step=step)
        m.save_checkpoint().wait(RPC_TIMEOUT)
        states[step] = full_state(group)
    return states


def held(tier: str) -> dict[str, int]:
    return {p: s for h in live_holders(tier)
            for p, s in ray.get(h.listing.remote(), timeout=RPC_TIMEOUT).items()}


def test_resume_reads_memory_first_and_passes_over_a_bad_or_lost_replica(group2, tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "nvme")
    with pytest.warns(RuntimeWarning, match="no other node"):
        m = manager(root, {"actor": group2}, config=config(local))
    tier = tier_id(Storage(root).url())
    try:
        states = save_steps(m, group2, (1, 2, 3))
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        status = m.replication()["memory"]
        assert status["held"] == ["step_00000003"] and status["last_error"] is None, status
    finally:
        m.close(60, release_memory=False)
    # the newest only, every file of its manifest, verified as it arrived
    files = held(tier)
    assert {p.split("/")[1] for p in files if p.count("/") > 1} == {"step_00000003"}
    assert len(live_holders(tier)) == 1
    # the checkpoint's files (the step directory's CLAIM is the local save's own, not copied)
    local_files = {p: s for p, s in Storage(local).list_files("step_00000003").items()
                   if p != CheckpointPaths("step_00000003").claim}
    assert {p: s for p, s in files.items() if p.startswith(f"{tier}/step_")} == {
        f"{tier}/{p}": s for p, s in local_files.items()}

    # one view of the tiers, in this process and from the command line
    by_name = {r["name"]: r["tiers"] for r in admin.list_tiers(
        Storage(root), Storage(local), memory=Storage(tier_uri(tier)))["checkpoints"]}
    assert by_name == {"step_00000002": {"local": "committed", "durable": "committed"},
                       "step_00000003": {"memory": "committed", "local": "committed"}}, by_name
    ls = subprocess.run([sys.executable, "-m", "raycheckpoint.cli", "ls", root, "--local", local,
                         "--memory", ray.get_runtime_context().gcs_address, "--json"],
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr[-3000:]
    assert {r["name"]: r["tiers"] for r in json.loads(ls.stdout)["checkpoints"]} == by_name

    train(group2, [99])
    m = manager(root, {"actor": group2}, config={**config(local), "debug": True})
    try:
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000003", "memory tier")
        assert any("memory tier" in line for line in loaded.report)
        assert_same(full_state(group2), states[3])

        # a replica whose bytes no longer match the manifest: the local copy is read
        holder = live_holders(tier)[0]
        shard = next(p for p in files if p.endswith(".distcp"))
        bad = bytearray(ray.get(holder.get.remote(shard, 0, None), timeout=RPC_TIMEOUT))
        bad[len(bad) // 2] ^= 1
        ray.get(holder.put.remote(shard, bytes(bad)), timeout=RPC_TIMEOUT)
        train(group2, [99])
        with pytest.warns(RuntimeWarning, match="trying its copy in another tier"):
            loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000003", "local tier")
        assert_same(full_state(group2), states[3])

        # the holder is lost: resume reads the local tier; the next save starts a new one
        ray.kill(holder)
        _wait(lambda: not live_holders(tier))
        train(group2, [99])
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000003", "local tier")
        train(group2, [4])
        m.update(step=4)
        m.save_checkpoint().wait(RPC_TIMEOUT)
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        assert m.replication()["memory"]["held"] == ["step_00000004"]
        assert {p.split("/")[1] for p in held(tier) if p.count("/") > 1} == {"step_00000004"}
        state4 = full_state(group2)
        train(group2, [99])
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000004", "memory tier")
        assert_same(full_state(group2), state4)
    finally:
        m.close(60)  # a clean end frees the memory tier
    assert live_holders(tier) == []
    assert catalog.read_latest(Storage(local)) == "step_00000004"


def test_memory_replicas_need_a_local_tier(tmp_path):
    from raycheckpoint import CheckpointConfig

    with pytest.raises(ValueError, match=r"needs checkpoint\.local_dir"):
        CheckpointConfig(save_dir=str(tmp_path), memory_replicas=1)
    with pytest.raises(ValueError, match="non-negative"):
        CheckpointConfig(save_dir=str(tmp_path), local_dir=str(tmp_path / "l"), memory_replicas=-1)


def _wait(cond, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_per_node_local_directories_commit_on_every_node_and_resume(group2, tmp_path):
    """``local_dir_per_node``: the ranks write on their node's own directory and the
    coordinator commits there through the node's agent (on one node here: one directory)."""
    root, template = str(tmp_path / "durable"), str(tmp_path / "nvme" / "{node_id}")
    cfg = {"local_dir": template, "local_dir_per_node": True, "replicate_every": 2,
           "keep_last_n_local": 2, "keep_last_n": 3}
    node = ray.get_runtime_context().get_node_id()
    disk = Storage(template.replace("{node_id}", node))
    m = manager(root, {"actor": group2}, config=cfg)
    try:
        states = save_steps(m, group2, (1, 2, 3))
        assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        agents = live_holders(m.roots.nodes.open().root, "nodes")
        assert len(agents) == 1
        last = m.replication()["last"]  # the node's agent uploaded every file of step 2
        assert last["name"] == "step_00000002" and last["uploaded_at_source"] == last["files"]
    finally:
        m.close(60, release_memory=False)
    # the node's own directory is a whole root: shards, manifest, marker, LATEST, catalog
    assert [c.name for c in catalog.scan(disk)[0]] == ["step_00000002", "step_00000003"]
    assert catalog.read_latest(disk) == "step_00000003"
    assert admin.verify(disk.full_path("step_00000003"))["ok"]
    assert [c.name for c in catalog.scan(Storage(root))[0]] == ["step_00000002"]
    train(group2, [99])
    m = manager(root, {"actor": group2}, config=cfg)
    try:
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000003", "local tier")
        assert_same(full_state(group2), states[3])
    finally:
        m.close(60)
    assert live_holders(m.roots.nodes.open().root, "nodes") == []
