"""Corruption of every kind of file: detected at load with an IntegrityError naming the
file; ``auto`` falls back to the newest checkpoint that verifies; caches are rebuilt.

A root with two full checkpoints (steps 1 and 2, two FSDP2 ranks) is written once; each
case corrupts one file of step 2 in a copy: a flipped bit, a truncation, or a deletion.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from raycheckpoint import CheckpointNotFoundError, IntegrityError, Storage
from raycheckpoint.admin import verify
from raycheckpoint.protocol.paths import CATALOG, LATEST
from tests.helpers import flip_bit, manager, train, weights_sha

pytestmark = pytest.mark.timeout(300)

# file kind -> path under step_00000002/
FILES = {
    "shard": "actor/__1_0.distcp",
    "dcp_metadata": "actor/.metadata",
    "manifest": "manifest.msgpack",
    "marker": "COMMITTED",
    "trainer_state": "trainer_state.json",
    "version": "version.json",
    "rng_state": "rng/actor/rank_00001.msgpack",
}
MODES = ["flip", "truncate", "delete"]


def corrupt(path: str, mode: str) -> None:
    if mode == "delete":
        os.unlink(path)
        return
    if mode == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
        return
    flip_bit(path)


@pytest.fixture(scope="module")
def two_steps(group2, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corruption") / "root")
    m = manager(root, {"actor": group2})
    shas = {}
    try:
        for step in (1, 2):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint(tag=f"t{step}").wait(120)
            shas[step] = weights_sha(group2)
    finally:
        m.close(60)
    return root, shas


@pytest.fixture
def copy(two_steps, tmp_path):
    root, shas = two_steps
    dst = str(tmp_path / "root")
    shutil.copytree(root, dst, symlinks=True)
    return dst, shas


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(FILES))
def test_verify_names_the_corrupted_file(copy, kind, mode):
    root, _ = copy
    corrupt(f"{root}/step_00000002/{FILES[kind]}", mode)
    doc = verify(root)
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["step_00000001"]["ok"]
    if kind == "marker" and mode == "delete":  # no marker: simply not committed
        assert "step_00000002" not in by_name
        return
    bad = by_name["step_00000002"]
    assert not bad["ok"] and not doc["ok"]
    named = {"step_00000002/" + FILES[kind]}
    if kind == "marker":  # a flipped bit that keeps the JSON valid breaks the manifest's seal
        named.add("step_00000002/manifest.msgpack")
    assert bad["path"] in named, bad


# one corruption mode per kind at load time (all modes are covered by verify above)
LOAD_CASES = [("shard", "flip"), ("dcp_metadata", "truncate"), ("manifest", "delete"),
              ("marker", "truncate"), ("trainer_state", "flip"), ("version", "truncate"),
              ("rng_state", "flip")]


@pytest.mark.parametrize(("kind", "mode"), LOAD_CASES)
def test_load_raises_naming_the_file_and_auto_falls_back(copy, group2, kind, mode):
    root, shas = copy
    corrupt(f"{root}/step_00000002/{FILES[kind]}", mode)
    m = manager(root, {"actor": group2})
    try:
        with pytest.raises(IntegrityError) as e:
            m.load_checkpoint("step_00000002")
        assert e.value.path == f"step_00000002/{FILES[kind]}", str(e.value)
        with pytest.warns(RuntimeWarning, match="step_00000002"):
            loaded = m.load_checkpoint("auto")
        assert loaded.name == "step_00000001" and weights_sha(group2) == shas[1]
    finally:
        m.close(60)
    assert os.path.isdir(f"{root}/step_00000002")  # evidence is kept, never collected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pointer", [LATEST, CATALOG])
def test_corrupt_caches_are_rebuilt_from_the_markers(copy, pointer, mode):
    from raycheckpoint import CheckpointConfig
    from raycheckpoint.protocol.checkpoint import open_verified
    from raycheckpoint.protocol.coordinator import CheckpointCoordinator
    from raycheckpoint.protocol.refs import resolve

    root, _ = copy
    corrupt(f"{root}/{pointer}", mode)
    st = Storage(root)
    assert resolve(st, "latest")[0] == "step_00000002"  # the markers win over the pointer
    # what a (re)starting job's coordinator does first: rebuild the caches from the markers
    coordinator = CheckpointCoordinator(st.spec, CheckpointConfig(save_dir=root))
    assert coordinator.recovery["fixed_latest"] == (pointer == LATEST)
    assert coordinator.recovery["rebuilt_catalog"] == (pointer == CATALOG)
    assert st.read_bytes(LATEST).decode().strip() == "step_00000002"
    assert [c["name"] for c in coordinator.catalog()["checkpoints"]] == ["step_00000001",
                                                                         "step_00000002"]
    assert open_verified(st, "step_00000002").step == 2
    assert verify(root)["problems"] == []


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupt_tag_pointer_is_a_clear_error(copy, group2, mode):
    root, _ = copy
    corrupt(f"{root}/tags/t2", mode)
    from raycheckpoint.protocol.refs import resolve

    with pytest.raises(CheckpointNotFoundError, match="t2"):
        resolve(Storage(root), "t2")
    assert Path(root, "step_00000002", "COMMITTED").exists()  # the checkpoint itself is fine
