"""The memory tier serves only what the job's roots still vouch for, and its actors end
once nobody uses them (DESIGN section 8).

* A job killed with its checkpoint in memory, both of its roots wiped by hand: the next
  job on the same roots starts afresh; the holders drop the stale copy.
* Holders and per-node agents that no job uses for ``checkpoint.memory_idle_ttl_s`` end
  themselves; a use or a touch restarts the clock, and a live job that does not save
  keeps its holders.

Real holders and agents on this test session's local Ray instance."""

from __future__ import annotations

import shutil
import time

import pytest
import ray

from raycheckpoint import Storage
from raycheckpoint.protocol import nodes
from raycheckpoint.protocol.memory import ReplicaHolder, ensure_holders, tier_id, tier_uri
from raycheckpoint.storage.raymem import live_holders
from tests.helpers import RPC_TIMEOUT, manager, train

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:checkpoint.memory_replicas. every rank runs")]


def config(local: str, **more) -> dict:
    return {"local_dir": local, "memory_replicas": 1, "replicate_every": 1, **more}


def save(m, group, step: int) -> None:
    train(group, [step])
    m.update(step=step)
    m.save_checkpoint().wait(RPC_TIMEOUT)
    assert ray.get(m.coordinator.wait_replication.remote(60), timeout=RPC_TIMEOUT)


def held(tier: str) -> dict[str, int]:
    """Every file the live holders of ``tier`` hold (an unchecked look)."""
    return {p: s for h in live_holders(tier)
            for p, s in ray.get(h.listing.remote(), timeout=RPC_TIMEOUT).items()}


def wait_until(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_job_on_wiped_roots_starts_afresh_not_from_the_memory_copy(group2, tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "nvme")
    m = manager(root, {"actor": group2}, config=config(local))
    tier = tier_id(Storage(root).url())
    try:
        save(m, group2, 20)
        assert m.replication()["memory"]["held"] == ["step_00000020"]
    finally:
        m.close(60, release_memory=False)  # the driver's end leaves the holders, as a kill does
    assert any("step_00000020" in p for p in held(tier))
    shutil.rmtree(root)  # "start fresh": both roots wiped by hand
    shutil.rmtree(local)

    m = manager(root, {"actor": group2}, config=config(local))
    try:
        assert m.load_checkpoint("auto") is None  # trains from scratch
        assert held(tier) == {}, "the holders kept the copy the wiped roots no longer vouch for"
        identity = m.roots.memory.options["identity"]
        assert {ray.get(h.where.remote(), timeout=RPC_TIMEOUT)["identity"]
                for h in live_holders(tier)} == {identity}
        save(m, group2, 1)  # the new job's checkpoints are served from memory as before
        train(group2, [99])
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000001", "memory tier")
    finally:
        m.close(60)
    assert live_holders(tier) == []


def test_a_holder_drops_what_another_root_identity_copied(ray_session, tmp_path):
    tier = tier_id(Storage(str(tmp_path / "root")).url())
    node = ray.get_runtime_context().get_node_id()
    ensure_holders(tier, [node], idle_ttl_s=600)
    try:
        old = Storage(tier_uri(tier), {"identity": "before-the-wipe"})
        old.write_pointer("LATEST", b"step_00000020")
        assert old.read_bytes("LATEST") == b"step_00000020"
        unchecked = Storage(tier_uri(tier))  # an operator's look: served, nothing changes
        assert unchecked.list_files() == {"LATEST": len(b"step_00000020")}
        new = Storage(tier_uri(tier), {"identity": "after-the-wipe"})
        assert not new.exists("LATEST") and new.list_files() == {}
        assert unchecked.list_files() == {} and not old.exists("LATEST")  # dropped for good
    finally:
        nodes.release(tier, "memory")


# waits out lifetimes (~12 s): the default suite keeps within its 15 minutes on a 2-core machine;
# .ci/run runs the long tests too
@pytest.mark.long
def test_idle_holders_and_agents_end_themselves_and_use_keeps_them(ray_session, tmp_path):
    ttl = 2.0
    node = ray.get_runtime_context().get_node_id()
    mem_tier = tier_id(Storage(str(tmp_path / "a")).url())
    dir_tier = tier_id(Storage(str(tmp_path / "b")).url())
    ensure_holders(mem_tier, [node], idle_ttl_s=ttl)
    nodes.ensure_on_nodes(nodes.NodeDirAgent, "nodes", dir_tier, [node],
                          str(tmp_path / "nvme"), ttl)
    fs = Storage(tier_uri(mem_tier), {"identity": "x"})
    fs.write_pointer("LATEST", b"step_00000001")
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * ttl:  # used (a read; a touch) more often than ttl
            assert fs.read_bytes("LATEST") == b"step_00000001"
            assert nodes.keep_alive(dir_tier, "nodes", idle_ttl_s=ttl) == 1
            time.sleep(ttl / 4)
        assert len(live_holders(mem_tier)) == 1 and len(live_holders(dir_tier, "nodes")) == 1
        # nobody uses them any more: they end within their lifetime (and a little)
        took = wait_until(lambda: not live_holders(mem_tier) and not live_holders(dir_tier, "nodes"),
                          ttl + 15, "idle actors ending")
        assert took >= ttl * 0.5
        # a later job finds none and starts a fresh, empty one
        ensure_holders(mem_tier, [node], idle_ttl_s=600)
        assert Storage(tier_uri(mem_tier)).list_files() == {}
    finally:
        nodes.release(mem_tier, "memory")
        nodes.release(dir_tier, "nodes")


# waits out lifetimes (~18 s): the default suite keeps within its 15 minutes on a 2-core machine;
# .ci/run runs the long tests too
@pytest.mark.long
def test_a_live_job_that_does_not_save_keeps_its_holders_until_it_ends(group2, tmp_path):
    ttl = 3.0
    root, local = str(tmp_path / "durable"), str(tmp_path / "nvme")
    m = manager(root, {"actor": group2}, config=config(local, memory_idle_ttl_s=ttl))
    tier = tier_id(Storage(root).url())
    try:
        save(m, group2, 1)
        time.sleep(3 * ttl)  # no save, no load: only the driver's keep-alive
        assert len(live_holders(tier)) == 1
        train(group2, [99])
        loaded = m.load_checkpoint("auto")
        assert (loaded.name, loaded.tier) == ("step_00000001", "memory tier")
    finally:
        m.close(60, release_memory=False)  # the job ends; its holders are no longer kept
    wait_until(lambda: not live_holders(tier), ttl + 15, "the ended job's holders ending")


def test_a_holder_built_in_a_plain_process_has_no_timer(tmp_path):
    """No Ray actor, no self-ending (a holder built in a test or a tool)."""
    h = ReplicaHolder("t", "n", idle_ttl_s=0.01)
    time.sleep(0.05)
    assert h.where()["files"] == 0 and h.idle_s() >= 0.01
