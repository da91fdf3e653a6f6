"""The library on its own, as a training loop uses it: ``manager.step`` makes the saves,
retention stays bounded, background verification records what it found, and a load
verifies every file it accepts and says what it skipped."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from raycheckpoint import (
    CheckpointConfig,
    CheckpointManager,
    IntegrityError,
    ResumableSampler,
    Storage,
    admin,
)
from raycheckpoint._internal import faults
from raycheckpoint.protocol import catalog
from tests.helpers import RPC_TIMEOUT, assert_same, flip_bit, full_state, manager, train

pytestmark = pytest.mark.timeout(300)

TOKENIZER = b'{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}' * 20


@pytest.fixture(scope="module")
def with_assets(ray_session):
    """Two TinyLM ranks that save a tokenizer file beside their weights."""
    from workers import FSDPTrainWorker, create_worker_group

    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=2, timeout_s=RPC_TIMEOUT,
                                assets={"tokenizer.json": TOKENIZER})
    yield group
    for w in group:
        ray.kill(w)


@pytest.fixture(scope="module")
def wider(ray_session):
    """One rank of a TinyLM with a third block: keys a two-block checkpoint lacks."""
    from workers import FSDPTrainWorker, create_worker_group

    group = create_worker_group(FSDPTrainWorker, role="actor", world_size=1, timeout_s=RPC_TIMEOUT,
                                model={"n_layers": 3})
    yield group
    for w in group:
        ray.kill(w)


def committed(root: str) -> list[str]:
    return sorted(m.name for m in catalog.scan(Storage(root))[0])


def test_step_makes_the_configured_saves_and_retention_stays_bounded(group2, tmp_path):
    root = str(tmp_path / "ck")
    seed = {"save_interval": 1, "save_full_interval": 4, "keep_last_n": 1, "keep_best_n": 1,
            "save_on_train_end": True, "save_on_loss_drop": 0.99}
    m = manager(root, {"actor": group2}, config=seed)
    made = []
    try:
        for step in range(1, 10):
            loss = train(group2, [step])[0]
            h = m.step(step, metrics={"loss": loss, "reward": step % 3}, is_last=step == 9)
            assert h is not None and m.last_saves[-1] is h
            made.append((step, h.kind, h.reason))
            if step == 1:
                baseline = loss
        m.wait_for_saves(RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        assert [(s, k) for s, k, _ in made] == [(1, "light"), (2, "light"), (3, "light"),
                                               (4, "full"), (5, "light"), (6, "light"),
                                               (7, "light"), (8, "full"), (9, "full")]
        assert made[3][2] == "every 4 steps; every 1 steps (light)"
        assert made[8][2] == "train end; every 1 steps (light)"
        assert [s["reason"] for s in m.checkpoint_stats][:1] == ["every 1 steps (light)"]
        # light: the 3 newest; full: the newest (and LATEST) and the best reward (step 8)
        assert committed(root) == [f"step_{s:08d}" for s in (5, 6, 7, 8, 9)]
        report = admin.gc(root, dry_run=True)  # beside the running job: looks only
        assert report["deleted"] == []
        assert report["kept"]["step_00000008"] == ["one of the 1 best by reward (max; keep_best_n=1)"]
        assert "LATEST points here" in report["kept"]["step_00000009"]
        assert report["kept"]["step_00000005"] == [
            "one of the newest 3 light (keep_last_n_light default=3)"]
    finally:
        m.close(RPC_TIMEOUT)
    # the triggers' baselines travel in the checkpoint
    m2 = manager(root, {"actor": group2})
    try:
        assert m2.load_checkpoint("auto").step == 9
        assert m2._stepper.triggers.loss_baseline == baseline
    finally:
        m2.close(RPC_TIMEOUT)


def test_sigterm_makes_step_save_commit_and_stop(group2, tmp_path):
    root = str(tmp_path / "ck")
    previous = signal.getsignal(signal.SIGTERM)
    m = manager(root, {"actor": group2})
    try:
        assert m.step(1) is None and not m.should_stop  # the handler is installed now
        os.kill(os.getpid(), signal.SIGTERM)
        h = m.step(2)
        assert (h.kind, h.reason, m.should_stop, m.stop_signal) == (
            "full", "preemption (SIGTERM)", True, signal.SIGTERM)
        assert h.done() and h.wait(0)["name"] == "step_00000002"  # committed before step() returned
    finally:
        signal.signal(signal.SIGTERM, previous)
        m.close(RPC_TIMEOUT)
    assert committed(root) == ["step_00000002"]


def _verifier(m: CheckpointManager):
    return ray.get(m.coordinator.__ray_call__.remote(lambda self: self._verifications._actor),
                   timeout=RPC_TIMEOUT)


def test_background_verification_is_recorded_honoured_and_protected(group2, tmp_path):
    root = str(tmp_path / "ck")
    m = manager(root, {"actor": group2}, config={"verify_after_save": True, "keep_last_n": 1})
    try:
        train(group2, [1])
        m.save_checkpoint(step=1).wait(RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)  # the verification is due once the clean-up is done
        assert ray.get(m.coordinator.wait_verifications.remote(60), timeout=RPC_TIMEOUT)
        assert m.checkpoint_stats  # takes the verification results too
        assert [(v["name"], v["ok"]) for v in m.verifications] == [("step_00000001", True)]
        assert any("tensors of 1 role(s) deserialized" in c for c in m.verifications[0]["checks"])
        row = admin.list_root(Storage(root))["checkpoints"][0]
        assert row["verified"]["ok"] and row["verified"]["verified_at"] > 0
        assert catalog.read_catalog(Storage(root))["checkpoints"][0]["verified"]["ok"]
        # the verifier reads step 2 only after its bytes went bad on storage
        verifier = _verifier(m)
        ray.get(verifier.__ray_call__.remote(lambda self: faults.arm("verifier.verify", "hang:3")),
                timeout=RPC_TIMEOUT)
        train(group2, [2])
        m.save_checkpoint(step=2).wait(RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        data = sorted((Path(root) / "step_00000002" / "actor").glob("*.distcp"))[0]
        flip_bit(str(data))
        assert ray.get(m.coordinator.wait_verifications.remote(60), timeout=RPC_TIMEOUT)
        with pytest.warns(RuntimeWarning, match="step_00000002 failed background verification"):
            assert m.checkpoint_stats
        bad = m.verifications[-1]
        assert not bad["ok"] and data.name in bad["error"]
        # keep_last_n=1 would have deleted step 1: it is the newest verified checkpoint
        assert committed(root) == ["step_00000001", "step_00000002"]
        rows = {r["name"]: r for r in admin.list_root(Storage(root))["checkpoints"]}
        assert rows["step_00000002"]["verified"]["ok"] is False
        with pytest.warns(RuntimeWarning, match="step_00000002 is skipped: it failed background"):
            assert m.load_checkpoint("auto").name == "step_00000001"
        ray.get(verifier.__ray_call__.remote(lambda self: faults.disarm()), timeout=RPC_TIMEOUT)
    finally:
        m.close(RPC_TIMEOUT)


def test_verification_of_an_encrypted_root_writes_no_plaintext(group2, tmp_path):
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    root = tmp_path / "ck"
    m = manager(str(root), {"actor": group2},
                config={"verify_every": 2, "encryption_key": f"file:{key}"})
    try:
        for step in (1, 2):
            train(group2, [step])
            m.save_checkpoint(step=step).wait(RPC_TIMEOUT)
        m.wait_for_cleanup(RPC_TIMEOUT)
        before = {p: p.stat().st_size for p in root.rglob("*") if p.is_file()}
        assert ray.get(m.coordinator.wait_verifications.remote(60), timeout=RPC_TIMEOUT)
        assert m.checkpoint_stats
        assert [(v["name"], v["ok"]) for v in m.verifications] == [("step_00000002", True)]
        after = {p for p in root.rglob("*") if p.is_file()}
        assert {p.name for p in after - set(before)} <= {"verification.json"}
    finally:
        m.close(RPC_TIMEOUT)


def test_resume_verifies_every_file_it_accepts(with_assets, wider, tmp_path):
    root = tmp_path / "ck"
    m = manager(str(root), {"actor": with_assets})
    try:
        for step in (1, 2):
            train(with_assets, [step])
            m.save_checkpoint(step=step).wait(RPC_TIMEOUT)
        asset = root / "step_00000002" / "assets" / "actor" / "tokenizer.json"
        assert asset.read_bytes() == TOKENIZER
        flip_bit(str(asset))
        with pytest.raises(IntegrityError, match=r"assets/actor/tokenizer\.json"):
            m.load_checkpoint(2)
        with pytest.warns(RuntimeWarning, match=r"step_00000002 failed verification.*tokenizer\.json"):
            assert m.load_checkpoint("auto").name == "step_00000001"
    finally:
        m.close(RPC_TIMEOUT)
    # rank 1's RNG file is read by no rank of a one-rank job: checked all the same
    flip_bit(str(root / "step_00000001" / "rng" / "actor" / "rank_00001.msgpack"))
    m = manager(str(root), {"actor": wider})
    try:
        with pytest.raises(IntegrityError, match=r"rng/actor/rank_00001\.msgpack"):
            m.load_checkpoint(1, strict=False)
    finally:
        m.close(RPC_TIMEOUT)


def test_strict_refusals_and_what_a_partial_load_skips(group2, wider, tmp_path, caplog, capsys):
    root = str(tmp_path / "ck")
    m = manager(root, {"actor": group2})
    try:
        train(group2, [1])
        m.save_checkpoint(step=1).wait(RPC_TIMEOUT)
    finally:
        m.close(RPC_TIMEOUT)
    m = manager(root, {"actor": group2}, dataloader=ResumableSampler(16, seed=0))
    try:
        with pytest.raises(IntegrityError, match="no data-loader state"):
            m.load_checkpoint(1)
        assert "data loader: no saved state" in m.load_checkpoint(1, strict=False).skipped
    finally:
        m.close(RPC_TIMEOUT)
    m = manager(root, {"actor": wider}, config={"debug": True})
    try:
        with pytest.raises(IntegrityError, match=r"no \d+ key\(s\) this state has: .*blocks\.2\."):
            m.load_checkpoint(1)
        caplog.set_level(logging.WARNING, logger="raycheckpoint.loader")
        capsys.readouterr()
        result = m.load_checkpoint(1, strict=False)
        skipped = "\n".join(result.skipped)
        assert "key(s) not in the checkpoint, left as they were: model.blocks.2." in skipped
        assert "per-rank RNG (world size changed 2 -> 1)" in skipped
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("per-rank RNG (world size changed 2 -> 1)" in w for w in warned), warned
        printed = capsys.readouterr().out
        assert "[raycheckpoint] resume report: step_00000001 (step 1, full" in printed
        assert "check: config fingerprint (0 keys) and world sizes: match" in printed
        assert "loaded actor: model, optimizer and rank state into 1 rank(s) from 2 saved " \
               "(resharded)" in printed
        assert "verified by the workers as they read them" in printed
        assert "skipped: actor/0: per-rank RNG (world size changed 2 -> 1)" in printed
    finally:
        m.close(RPC_TIMEOUT)
    m = manager(root, {"critic": wider})
    try:
        with pytest.raises(IntegrityError, match=r"holds no state for role\(s\) \['critic'\]"):
            m.load_checkpoint(1)
        result = m.load_checkpoint(1, strict=False)
        assert any("holds no state for role(s) ['critic']" in s for s in result.skipped)
        assert any("roles in the checkpoint with no worker group here: ['actor']" in s
                   for s in result.skipped)
    finally:
        m.close(RPC_TIMEOUT)


def test_unknown_option_names_the_closest_keys():
    with pytest.raises(ValueError, match=r"'keep_best' \(did you mean keep_best_n"):
        CheckpointConfig.from_dict({"save_dir": "/x", "keep_best": 3})


def test_a_save_begun_with_the_step_snapshots_right_after_its_calls(group2, tmp_path):
    """``step_save`` begins the save a step's number asks for before the step ends; each
    rank snapshots right after the calls sent before ``snapshot()``, so a call the driver
    sends later (here a next step's training, before ``step()``) is not in it, and the
    save commits with the metrics ``step()`` brings."""
    root = str(tmp_path / "ck")
    m = manager(root, {"actor": group2}, config={"save_full_interval": 2, "keep_last_n": 2,
                                                 "save_on_loss_drop": 0.5})
    at: dict[int, Any] = {}
    try:
        for step in (1, 2, 3, 4):
            ride = m.step_save(step, is_last=step == 4)
            assert (ride is None) == (step % 2 == 1), step
            refs = [w.train_step.remote(step) for w in group2]
            if ride is not None:
                ride.snapshot()
            loss = ray.get(refs, timeout=RPC_TIMEOUT)[0]
            at[step] = full_state(group2)
            if step == 2:  # the driver goes on before step(): not part of step 2's save
                train(group2, [99])
                at[99] = full_state(group2)
            completing = time.monotonic()
            h = m.step(step, metrics={"loss": loss})
            if ride is None:
                assert h is None or h.reason.startswith("loss fell"), h and h.reason
                continue
            assert h.reason == ("every 2 steps; train end" if step == 4 else "every 2 steps")
            assert h.breakdown["queued"] and h.breakdown["rank"].startswith("actor/")
            result = h.wait(RPC_TIMEOUT)
            assert result["name"] == f"step_{step:08d}"
            # its commit time counts from step(), not from step_save(): not the step's calls
            assert result["total_s"] <= time.monotonic() - completing
            ts = json.loads(Storage(root).read_bytes(f"step_{step:08d}/trainer_state.json"))
            assert ts["metrics"] == {"loss": loss} and ts["global_step"] == step
            assert ts["triggers"]["loss_baseline"] == m._stepper.triggers.loss_baseline
        stats = {s["name"]: s for s in m.checkpoint_stats}
        assert stats["step_00000002"]["breakdown_ms"]["copy"] >= 0
        m.step_save(6)
        with pytest.raises(RuntimeError, match=r"completed by step\(\) first"):
            m.save_checkpoint()
        with pytest.raises(RuntimeError, match="completed by that step"):
            m.step(7)  # the save begun with step 6 is aborted, never committed
        assert "step_00000006" not in committed(root)
    finally:
        m.close(RPC_TIMEOUT)
    m2 = manager(root, {"actor": group2})
    try:
        assert m2.load_checkpoint("step_00000002").step == 2
        assert_same(full_state(group2), at[2])
        assert any(not torch.equal(v, at[99]["model"][k]) for k, v in at[2]["model"].items())
    finally:
        m2.close(RPC_TIMEOUT)
