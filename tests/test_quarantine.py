"""Nothing saved is lost: what ``auto`` passes over is set aside and its step saved again.

* The start-up check (``resume.preflight``) takes exactly the candidates the load takes,
  in the same order, on every tier: a damaged newest checkpoint moves it on to the next
  one that opens, as ``auto`` would, instead of refusing the job (Ray-free cases first).
* A committed checkpoint ``auto`` passed over is quarantined (``QUARANTINED`` replaces
  its marker: shown by ``ls``, never read, removed only by ``gc`` once superseded), and a
  save of its step writes a new checkpoint; so does a save of a step whose checkpoint
  holds another state (the job loaded an older one).  Saving the very state the job
  committed or loaded still reuses it.
"""

from __future__ import annotations

import json
import os

import pytest

from raycheckpoint import CheckpointConfig, CheckpointNotFoundError, ConfigMismatchError, Storage
from raycheckpoint.admin import gc, list_root, verify
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.candidates import Tier
from raycheckpoint.protocol.coordinator import CheckpointCoordinator
from raycheckpoint.protocol.paths import COMMITTED, LATEST, QUARANTINED
from raycheckpoint.resume import preflight
from tests.helpers import flip_bit, manager, train, weights_sha

pytestmark = pytest.mark.timeout(300)

FP = {"algo": "grpo", "n": 4}


def _commit(root: str, steps: list[int], fingerprint: dict = FP) -> None:
    """Committed checkpoints of ``steps`` (one actor rank, bytes that are no tensors: the
    start-up check reads metadata only), written by the coordinator itself."""
    coordinator = CheckpointCoordinator(Storage(root).spec, CheckpointConfig(
        save_dir=root, commit_timeout_s=30))
    for step in steps:
        begun = coordinator.begin(step=step, kind="full", tag=None, metrics={},
                                  trainer_state={"config_fingerprint": fingerprint},
                                  expected=[("actor", 0)], world_sizes={"actor": 1})
        entry = coordinator.storage.write_bytes(f"{begun['name']}/actor/__0_0.distcp",
                                                f"step {step}".encode())
        coordinator.report(begun["save_id"], "actor", 0, [entry.to_dict()], None, 0.0)
        coordinator.wait(begun["save_id"], 30)
        coordinator.wait_cleanup(30)


def _saved(root: str, group: list, steps: tuple[int, ...]) -> None:
    """A job that trains and saves ``steps`` on ``group``, then ends."""
    m = manager(root, {"actor": group}, fingerprint=FP)
    try:
        _train_and_save(m, group, steps)
    finally:
        m.close(60)


def _train_and_save(m, group: list, steps: tuple[int, ...]) -> None:
    for step in steps:
        train(group, [step])
        m.update(step=step)
        m.save_checkpoint().wait(120)


def _preflight(tiers, ref="auto", fingerprint=FP):
    with pytest.warns(RuntimeWarning) as warned:
        name = preflight(tiers, ref, fingerprint, {"actor": 1}, allow_reshard=False)
    return name, " ".join(str(w.message) for w in warned)


@pytest.mark.parametrize("damage", ["trainer_state_flipped", "version_flipped", "manifest_flipped",
                                    "file_missing", "failed_background_verification"])
def test_the_start_up_check_falls_back_as_auto_does(tmp_path, damage):
    root = str(tmp_path / "root")
    _commit(root, [2, 4, 6])
    newest = os.path.join(root, "step_00000006")
    if damage == "trainer_state_flipped":
        flip_bit(f"{newest}/trainer_state.json")
    elif damage == "version_flipped":
        flip_bit(f"{newest}/version.json")
    elif damage == "manifest_flipped":
        flip_bit(f"{newest}/manifest.msgpack")
    elif damage == "file_missing":
        os.unlink(f"{newest}/actor/__0_0.distcp")
    else:  # what the background verifier recorded
        catalog.write_verification(Storage(root), {"step_00000006": {
            "ok": False, "error": "IntegrityError: a shard's bytes", "verified_at": 0.0}})
    name, warned = _preflight(Storage(root))
    assert name == "step_00000004"
    assert "step_00000006" in warned
    # and it refuses what the load would refuse, on the checkpoint the load would take
    with pytest.raises(ConfigMismatchError, match=r"step_00000004.*n: saved 4, now 8"):
        _preflight(Storage(root), fingerprint={**FP, "n": 8})


def test_the_start_up_check_walks_every_tier_in_the_loads_order(tmp_path):
    local, durable = str(tmp_path / "local"), str(tmp_path / "durable")
    _commit(local, [2, 4])
    _commit(durable, [2, 4])
    flip_bit(os.path.join(local, "step_00000004", "trainer_state.json"))
    tiers = [Tier(Storage(local), "local tier", copy=True), Tier(Storage(durable), "durable tier")]
    # the local copy of step 4 is damaged; its durable copy is whole: step 4, as the load
    name, warned = _preflight(tiers)
    assert name == "step_00000004" and "local tier" in warned
    # a path names one root: its checkpoint there, as the load reads it
    assert preflight(tiers, os.path.join(durable, "step_00000004"), FP, {"actor": 1},
                     allow_reshard=False) == "step_00000004"
    # no candidate verifies: the same error the load gives
    flip_bit(os.path.join(durable, "step_00000004", "trainer_state.json"))
    for root in (local, durable):
        os.unlink(os.path.join(root, "step_00000002", "actor", "__0_0.distcp"))
    with pytest.raises(CheckpointNotFoundError, match="no committed full checkpoint verifies"), \
            pytest.warns(RuntimeWarning):
        preflight(tiers, "auto", FP, {"actor": 1}, allow_reshard=False)


def test_auto_sets_a_damaged_checkpoint_aside_and_the_job_saves_its_step_again(group2, tmp_path):
    root = str(tmp_path / "root")
    _saved(root, group2, (2, 4, 6))
    flip_bit(os.path.join(root, "step_00000006", "actor", "__0_0.distcp"))

    m = manager(root, {"actor": group2}, fingerprint=FP)  # the job, restarted
    try:
        with pytest.warns(RuntimeWarning, match="step_00000006"):
            assert m.load_checkpoint("auto").name == "step_00000004"
        st = Storage(root)
        # set aside at once: no marker, the reason kept, LATEST and the catalog moved
        assert not st.exists(f"step_00000006/{COMMITTED}")
        why = json.loads(st.read_bytes(f"step_00000006/{QUARANTINED}"))["reason"]
        assert why.startswith("passed over by resume: ") and "__0_0.distcp" in why
        assert st.read_bytes(LATEST).decode().strip() == "step_00000004"
        assert [q["name"] for q in m.catalog()["quarantined"]] == ["step_00000006"]
        # the retrained step 6 is saved, in a directory of its own
        train(group2, [6])
        m.update(step=6)
        saved = m.save_checkpoint().wait(120)
        assert saved["name"].startswith("step_00000006.") and not saved.get("existing")
        assert st.read_bytes(LATEST).decode().strip() == saved["name"]
    finally:
        m.close(60)
    # every committed checkpoint verifies; ls shows the quarantined one and why
    doc = verify(root)
    assert doc["ok"] and {c["name"] for c in doc["checkpoints"]} == {
        "step_00000002", "step_00000004", saved["name"]}
    rows = {r["name"]: r for r in list_root(Storage(root))["checkpoints"]}
    assert rows["step_00000006"]["state"] == "quarantined" and "passed over" in rows[
        "step_00000006"]["reason"]
    # only gc removes it, now that a newer checkpoint holds its step
    report = gc(root)
    assert report["removed_quarantined"] == ["step_00000006"]
    assert not Storage(root).list_files("step_00000006")


def test_a_save_after_loading_an_older_checkpoint_writes_its_step_anew(group2, tmp_path):
    root = str(tmp_path / "root")
    m = manager(root, {"actor": group2}, fingerprint=FP)
    try:
        _train_and_save(m, group2, (2, 4))
        old_4 = weights_sha(group2)
        m.load_checkpoint(2)  # back to step 2; train differently
        train(group2, [40])
        m.update(step=4)
        saved = m.save_checkpoint().wait(120)
        assert not saved.get("existing") and saved["name"].startswith("step_00000004.")
        new_4 = weights_sha(group2)
        assert new_4 != old_4
        # the state saved twice (the train-end save after a periodic one) is reused
        assert m.save_checkpoint().wait(1)["existing"]
        assert m.load_checkpoint(4).name == saved["name"] and weights_sha(group2) == new_4
        assert m.load_checkpoint("auto").name == saved["name"]
    finally:
        m.close(60)
    quarantined = catalog.scan_root(Storage(root)).quarantined
    assert list(quarantined) == ["step_00000004"]
    assert quarantined["step_00000004"].reason.startswith("superseded")
    assert verify(root)["ok"]


def test_a_resealed_rank_state_that_is_no_rank_state_is_passed_over(group2, tmp_path):
    """Bytes that match a re-sealed manifest but are no rank state: the worker's load
    says so naming the file (an IntegrityError), and ``auto`` takes the one before."""
    from raycheckpoint.protocol.format import pack
    from tests.forgery import reseal

    root = str(tmp_path / "root")
    _saved(root, group2, (2, 4))
    rel = "step_00000004/rng/actor/rank_00001.msgpack"
    reseal(root, {rel: pack(["not", "a", "rank", "state"])}, name="step_00000004")
    m = manager(root, {"actor": group2}, fingerprint=FP)
    try:
        with pytest.warns(RuntimeWarning, match=f"{rel}: holds no rank state"):
            assert m.load_checkpoint("auto").name == "step_00000002"
    finally:
        m.close(60)
