"""Ray integration: FSDP2 worker groups on gloo, the coordinator actor, real storage."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from raycheckpoint import (
    CheckpointNotFoundError,
    ConfigMismatchError,
    IntegrityError,
    LightCheckpointError,
    ResumableSampler,
    Storage,
    verify_checkpoint,
)
from raycheckpoint.protocol.paths import COMMITTED, LATEST
from tests.helpers import (
    assert_same,
    flip_bit,
    full_state,
    manager,
    train,
    weights_sha,
)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_round_trip_is_bitwise(backend, group2, local_root, request):
    root, options = (local_root, {}) if backend == "local" else request.getfixturevalue("s3_root")
    sampler = ResumableSampler(100, seed=1)
    m = manager(root, {"actor": group2}, options, dataloader=sampler, fingerprint={"lr": 1e-3})
    try:
        train(group2, range(2))
        m.update(step=2)
        m.save_checkpoint().wait(120)  # the second save reuses this one's host buffers
        train(group2, [2])
        sampler.next_batch(13)
        m.update(step=3, epoch=0, metrics={"reward": 0.5})
        h = m.save_checkpoint()
        assert h.stall_s < 30
        result = h.wait(120)
        assert h.done() and result["name"] == "step_00000003" and result["bytes"] > 0
        import ray

        deadline = time.time() + 30  # the commit broadcast reaches every worker
        while time.time() < deadline:
            status = ray.get([w.ckpt_status.remote() for w in group2], timeout=60)
            if all(tuple(st["last_committed"] or ()) == ("step_00000003", 3) for st in status):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"commit broadcast not seen by workers: {status}")
        saved = full_state(group2)
        sampler_state = sampler.state_dict()
        probe = [w.rng_probe.remote() for w in group2]
        probe = ray.get(probe, timeout=60)

        train(group2, range(3, 6))  # move on, then come back
        sampler.next_batch(40)
        loaded = m.load_checkpoint("latest")
        assert loaded.step == 3 and loaded.metrics == {"reward": 0.5} and loaded.resharded == {}
        assert_same(saved, full_state(group2))
        assert sampler.state_dict() == sampler_state
        assert ray.get([w.rng_probe.remote() for w in group2], timeout=60) == probe
        assert m.global_step == 3

        stats = m.checkpoint_stats
        assert stats[-1]["ok"] and stats[-1]["bytes"] == result["bytes"]
        assert stats[-1]["stall_s"] <= stats[-1]["total_s"] + stats[-1]["stall_s"]
        st = Storage(root, options)
        assert st.read_bytes(LATEST).decode().strip() == "step_00000003"
        assert verify_checkpoint(st, "step_00000003")["files"] >= 6
    finally:
        m.close(60)


def test_resume_continues_exactly(group2, local_root):
    """k steps + save + (more steps) + load + resume to N == N steps straight."""
    m = manager(local_root, {"actor": group2})
    try:
        for step in (1, 2):  # two saves through the same reused buffers, LR changing
            train(group2, [step - 1])
            m.update(step=step)
            m.save_checkpoint().wait(120)
        train(group2, range(2, 6))
        straight = weights_sha(group2)
        train(group2, range(6, 9))  # the "crashed" run went further and was lost
        assert m.load_checkpoint("auto").step == 2
        train(group2, range(2, 6))
        assert weights_sha(group2) == straight
    finally:
        m.close(60)


@pytest.mark.parametrize("target", ["group2", "group3"])
def test_reshard_from_4_ranks(target, group4, local_root, request):
    dst = request.getfixturevalue(target)
    src = manager(local_root, {"actor": group4})
    try:
        train(group4, range(2))
        src.update(step=7)
        src.save_checkpoint().wait(120)
        saved = full_state(group4)
    finally:
        src.close(60)
    m = manager(local_root, {"actor": dst})
    try:
        loaded = m.load_checkpoint(7)
        assert loaded.resharded == {"actor": (4, len(dst))}
        assert any("world size changed" in s for s in loaded.skipped)
        got = full_state(dst)
        assert_same(saved["model"], got["model"])
        assert_same(saved["optim"], got["optim"])
        assert saved["sched"] == got["sched"]
    finally:
        m.close(60)


def test_retention_over_many_saves(group2, local_root):
    m = manager(local_root, {"actor": group2},
                config={"keep_last_n": 2, "keep_last_n_light": 2, "keep_best_n": 2,
                        "best_metric": "reward", "best_mode": "max"})
    rewards = {}
    try:
        for step in range(1, 25):
            kind = "full" if step % 3 == 0 else "light"
            reward = [0.1, 0.9, 0.3, 0.8, 0.2, 0.4][step % 6] + step / 1000
            rewards[step] = reward
            tag = "milestone" if step == 4 else None
            m.update(step=step, metrics={"reward": reward})
            m.save_checkpoint(tag=tag, kind=kind).wait(120)
        cat = m.catalog()
    finally:
        m.close(60)
    names = {e["name"] for e in cat["checkpoints"]}
    full = sorted(s for s in range(1, 25) if s % 3 == 0)
    light = sorted(s for s in range(1, 25) if s % 3)
    best2 = sorted(rewards, key=rewards.get, reverse=True)[:2]
    expected = {f"step_{s:08d}" for s in full[-2:] + light[-2:] + best2 + [4]}
    assert names == expected
    assert cat["latest"] == "step_00000024" and cat["tags"] == {"milestone": "step_00000004"}
    # storage holds exactly the kept checkpoints, and each verifies
    st = Storage(local_root)
    assert {n for n in st.list_dir("") if n.startswith("step_")} == expected
    for name in expected:
        verify_checkpoint(st, name)

    # retention state is on storage: a new coordinator with tighter rules applies them
    m2 = manager(local_root, {"actor": group2}, config={"keep_last_n": 1, "keep_last_n_light": 1})
    try:
        names2 = {e["name"] for e in m2.catalog()["checkpoints"]}
    finally:
        m2.close(60)
    assert names2 == {"step_00000024", "step_00000023", "step_00000004"}


def test_a_save_is_committed_before_retention_deletes_older_ones(group2, local_root):
    import ray

    from raycheckpoint import testing as faults

    m = manager(local_root, {"actor": group2}, config={"keep_last_n": 1})
    st = Storage(local_root)
    try:
        m.update(step=1)
        m.save_checkpoint().wait(120)
        ray.get(m.coordinator.__ray_call__.remote(
            lambda self: faults.arm("coordinator.retention_delete", "hang:5")), timeout=60)
        train(group2, [2])
        m.update(step=2)
        result = m.save_checkpoint().wait(120)
        # committed and visible while the old checkpoint is still being deleted
        assert result["name"] == "step_00000002" and "deleted" not in result
        assert st.read_bytes(LATEST).decode().strip() == "step_00000002"
        assert st.exists(f"step_00000001/{COMMITTED}")
        cleanup = m.wait_for_cleanup(60)
        assert cleanup["name"] == "step_00000002" and cleanup["deleted"] == ["step_00000001"]
        assert cleanup["error"] is None and cleanup["cleanup_s"] >= 5
        assert not st.exists("step_00000001")
        assert [e["name"] for e in m.catalog()["checkpoints"]] == ["step_00000002"]
        assert m.load_checkpoint("latest").step == 2
    finally:
        m.close(60)


def test_a_persist_starts_before_the_drivers_next_call_to_its_worker(group2, local_root):
    """The persist must begin beside the next training step, not after it: the start is
    queued on each worker ahead of whatever the driver sends it next."""
    import ray

    def started(self) -> bool:  # the first call the driver makes after save_checkpoint
        pending = self._ckpt_saver.pending
        return pending.started

    m = manager(local_root, {"actor": group2})
    try:
        for step in (1, 2):
            m.update(step=step)
            handle = m.save_checkpoint()
            assert ray.get([w.__ray_call__.remote(started) for w in group2], timeout=60) == [
                True, True]
            handle.wait(120)
            assert handle.done()
    finally:
        m.close(60)


def test_workers_freeze_their_heap_when_checkpointing_is_set_up(group2, local_root):
    import ray

    def frozen() -> list[int]:
        return ray.get([w.__ray_call__.remote(lambda self: __import__("gc").get_freeze_count())
                        for w in group2], timeout=60)

    ray.get([w.__ray_call__.remote(lambda self: __import__("gc").unfreeze()) for w in group2],
            timeout=60)
    assert frozen() == [0, 0]
    manager(local_root, {"actor": group2}, config={"freeze_gc": False}).close(60)
    assert frozen() == [0, 0]
    manager(local_root, {"actor": group2}).close(60)
    # torch, Ray and the model: hundreds of thousands of objects out of full collections
    assert all(n > 50_000 for n in frozen()), frozen()


def test_bad_references_and_light_checkpoints(group2, local_root):
    m = manager(local_root, {"actor": group2}, fingerprint={"algo": "grpo", "n": 4})
    try:
        assert m.load_checkpoint("auto") is None  # empty root: a fresh start
        m.update(step=1)
        m.save_checkpoint(tag="first").wait(120)
        m.update(step=2)
        m.save_checkpoint(kind="light").wait(120)
        with pytest.raises(CheckpointNotFoundError, match="step_00000001 \\(full\\)") as e:
            m.load_checkpoint("nope")
        assert "first -> step_00000001" in str(e.value)
        with pytest.raises(CheckpointNotFoundError):
            m.load_checkpoint(99)
        with pytest.raises(LightCheckpointError, match="load_model_weights"):
            m.load_checkpoint(2)
        train(group2, [1])
        assert m.load_model_weights(2).kind == "light"
        assert m.load_checkpoint("first").step == 1
        assert m.load_checkpoint(os.path.join(local_root, "step_00000001")).step == 1
        # a save of the state the job just loaded returns that checkpoint (and can tag it)
        again = m.save_checkpoint(tag="again", step=1)
        assert again.wait(1)["existing"] and m.catalog()["tags"]["again"] == "step_00000001"
        # the light checkpoint of step 2 holds another state than the job's (it loaded
        # step 1): a save of step 2 writes a new checkpoint and sets the light one aside
        name = m.save_checkpoint(step=2).wait(120)["name"]
        assert name.startswith("step_00000002.")
        assert [q["name"] for q in m.catalog()["quarantined"]] == ["step_00000002"]
        # a light save, then a full one, of one state: the full one goes beside it
        m.update(step=4)
        m.save_checkpoint(kind="light").wait(120)
        assert m.save_checkpoint().wait(120)["name"] == "step_00000004_full"
        assert m.save_checkpoint().wait(1)["existing"]
    finally:
        m.close(60)
    other = manager(local_root, {"actor": group2}, fingerprint={"algo": "gae", "n": 8})
    try:
        with pytest.raises(ConfigMismatchError) as e:
            other.load_checkpoint("first")
        assert [d[0] for d in e.value.differences] == ["algo", "n"]
        assert "algo: saved 'grpo', now 'gae'" in str(e.value)
        assert other.load_checkpoint("first", strict=False).skipped
    finally:
        other.close(60)


def test_corruption_is_detected_and_auto_falls_back(group2, local_root):
    m = manager(local_root, {"actor": group2})
    try:
        for step in (1, 2, 3):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint().wait(120)
        flip_bit(os.path.join(local_root, "step_00000003", "actor", "__1_0.distcp"))
        with pytest.raises(IntegrityError, match=re.escape("step_00000003/actor/__1_0.distcp")):
            m.load_checkpoint(3)
        with pytest.warns(RuntimeWarning, match="step_00000003"):
            assert m.load_checkpoint("auto").step == 2
        # truncation and deletion are caught before any worker reads
        shard2 = os.path.join(local_root, "step_00000002", "actor", "__0_0.distcp")
        with open(shard2, "r+b") as f:
            f.truncate(100)
        with pytest.raises(IntegrityError, match=re.escape("step_00000002/actor/__0_0.distcp")):
            m.load_checkpoint(2)
        os.remove(os.path.join(local_root, "step_00000001", "actor", ".metadata"))
        with pytest.raises(IntegrityError, match=re.escape("step_00000001/actor/.metadata")):
            m.load_checkpoint(1)
        with pytest.raises(CheckpointNotFoundError, match="no committed full checkpoint verifies"), \
                pytest.warns(RuntimeWarning):
            m.load_checkpoint("auto")
    finally:
        m.close(60)


def test_catalog_and_latest_rebuilt_from_markers(group2, local_root):
    m = manager(local_root, {"actor": group2})
    try:
        for step in (1, 2):
            m.update(step=step)
            m.save_checkpoint(kind="full" if step == 1 else "light").wait(120)
    finally:
        m.close(60)
    st = Storage(local_root)
    before = json.loads(st.read_bytes("catalog.json"))
    st.delete("catalog.json")
    st.delete(LATEST)
    st.write_bytes("step_00000009/actor/__0_0.distcp", b"half-written leftover")
    m2 = manager(local_root, {"actor": group2})
    try:
        assert m2.catalog()["checkpoints"] == before["checkpoints"]
        assert json.loads(st.read_bytes("catalog.json")) == before
        assert st.read_bytes(LATEST).decode().strip() == "step_00000001"
        assert not st.exists("step_00000009")
        assert m2.load_checkpoint("latest").step == 1
    finally:
        m2.close(60)


def test_frozen_weights_are_written_once_and_kept_while_referenced(group2, group3, local_root):
    m = manager(local_root, {"actor": group2, "reward": group3}, frozen_roles=["reward"],
                config={"keep_last_n": 1})
    try:
        reward_before = full_state(group3)["model"]
        for step in (1, 2, 3):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint().wait(120)
        assert m.wait_for_cleanup(60)["deleted"] == ["step_00000002"]
        st = Storage(local_root)
        from raycheckpoint.protocol.format import Manifest

        manifest = Manifest.from_bytes(st.read_bytes("step_00000003/manifest.msgpack"))
        assert manifest.roles["reward"].dcp_dir == "step_00000001/reward"
        assert all(p.startswith("step_00000001/") for p in manifest.roles["reward"].files)
        # step 1 was collected by retention except the reward bytes step 3 still references
        assert not st.exists(f"step_00000001/{COMMITTED}")
        left = set(st.list_files("step_00000001"))
        assert left == set(manifest.roles["reward"].files)
        assert not st.list_files("step_00000002/reward")
        verify_checkpoint(st, "step_00000003")
        train(group3, [9])  # change the "frozen" weights, then load them back
        assert m.load_checkpoint("latest").step == 3
        assert_same(reward_before, full_state(group3)["model"])
    finally:
        m.close(60)
