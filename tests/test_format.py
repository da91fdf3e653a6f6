"""Format versioning against checked-in checkpoints (tests/fixtures/format_v<N>/).

Every fixture must keep loading bit for bit: a format change that breaks reading them
fails here unless it comes with a converter, and a new format version needs a fixture of
its own (``python -m tests.fixtures.make_format_fixture``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from raycheckpoint import IncompatibleCheckpointError, ResumableSampler, Storage
from raycheckpoint.export import RoleReader
from raycheckpoint.protocol import checkpoint as resume
from raycheckpoint.protocol.checkpoint import open_verified, verify_checkpoint
from raycheckpoint.protocol.format import FORMAT_VERSION, Manifest, Marker
from raycheckpoint.protocol.paths import COMMITTED, MANIFEST, VERSION
from raycheckpoint.storage import FileEntry
from tests.fixtures.make_format_fixture import tensor_sha
from tests.helpers import full_state, manager

pytestmark = pytest.mark.timeout(300)

FIXTURES = Path(__file__).parent / "fixtures"
ALL = sorted(p.name for p in FIXTURES.glob("format_v*") if p.is_dir())


def copy_fixture(name: str, tmp_path: Path) -> tuple[str, dict]:
    root = tmp_path / name
    shutil.copytree(FIXTURES / name / "root", root)
    return str(root), json.loads((FIXTURES / name / "expected.json").read_text())


def rewrite(root: str, name: str, rel: str, data: bytes) -> None:
    """Replace a listed file and re-seal the checkpoint (manifest entry, marker), as another
    library version would have written it."""
    s = Storage(root)
    s.write_bytes(f"{name}/{rel}", data)
    manifest = Manifest.from_bytes(s.read_bytes(f"{name}/{MANIFEST}"))
    path = f"{name}/{rel}"
    manifest.files[path] = FileEntry(path, len(data), hashlib.sha256(data).hexdigest())
    blob = manifest.to_bytes()
    s.write_bytes(f"{name}/{MANIFEST}", blob)
    marker = Marker.from_bytes(s.read_bytes(f"{name}/{COMMITTED}"))
    marker.manifest_size, marker.manifest_sha256 = len(blob), hashlib.sha256(blob).hexdigest()
    s.delete(f"{name}/{COMMITTED}")
    s.create_marker(f"{name}/{COMMITTED}", marker.to_bytes())


def test_the_current_format_has_a_fixture():
    assert f"format_v{FORMAT_VERSION}" in ALL, (
        f"format {FORMAT_VERSION} has no checked-in checkpoint: run "
        "`python -m tests.fixtures.make_format_fixture` and commit tests/fixtures/")


@pytest.mark.parametrize("fixture", ALL)
def test_fixture_verifies_and_reads_without_ray(fixture, tmp_path):
    root, expected = copy_fixture(fixture, tmp_path)
    st = Storage(root)
    summary = verify_checkpoint(st, expected["name"])
    assert summary["step"] == expected["step"] and summary["kind"] == "full"
    ck = open_verified(st, expected["name"])
    assert ck.version["format_version"] == expected["format_version"]
    assert {"compatible_since", "breaking_changes", "library_version"} <= set(ck.version)
    assert ck.trainer_state["dataloader"] == expected["sampler"]
    reader = RoleReader(ck, "actor")
    model = {name: tensor for name, _, tensor in reader.iter_model()}
    assert tensor_sha(model) == expected["model_sha256"]


@pytest.mark.parametrize("fixture", ALL)
def test_fixture_resumes_exactly_into_a_live_group(fixture, group2, tmp_path):
    root, expected = copy_fixture(fixture, tmp_path)
    sampler = ResumableSampler(50, seed=3)
    m = manager(root, {"actor": group2}, dataloader=sampler,
                fingerprint={"model": "tinylm", "lr": 1e-3})
    try:
        loaded = m.load_checkpoint("fixture")  # by its tag
        assert loaded.name == expected["name"] and loaded.step == expected["step"]
        got = full_state(group2)
        assert tensor_sha(got["model"]) == expected["model_sha256"]
        assert tensor_sha(got["optim"]) == expected["optim_sha256"]
        assert json.loads(json.dumps(got["sched"], default=str)) == expected["sched"]
        assert got["steps"] == expected["steps"]
        import ray

        assert ray.get([w.rng_probe.remote() for w in group2], timeout=60) == expected["rng_probe"]
        assert sampler.state_dict() == expected["sampler"]
    finally:
        m.close(60)


def test_a_newer_incompatible_format_is_refused_with_the_upgrade_path(tmp_path):
    root, expected = copy_fixture(f"format_v{FORMAT_VERSION}", tmp_path)
    version = {"format_version": FORMAT_VERSION + 1, "compatible_since": FORMAT_VERSION + 1,
               "breaking_changes": ["something-new"], "library_version": "9.0.0"}
    rewrite(root, expected["name"], VERSION, json.dumps(version).encode())
    with pytest.raises(IncompatibleCheckpointError, match=r"Upgrade raycheckpoint to >= 9\.0\.0"):
        open_verified(Storage(root), expected["name"])
    # newer but still readable (compatible_since allows it): loads
    version["compatible_since"] = FORMAT_VERSION
    rewrite(root, expected["name"], VERSION, json.dumps(version).encode())
    assert open_verified(Storage(root), expected["name"]).step == expected["step"]


def test_an_older_format_is_converted_by_its_registered_converter(tmp_path, monkeypatch):
    """This library moves to format N+1 with a breaking change; format-N checkpoints need
    the converter registered for it, and are refused (naming the change) without one."""
    root, expected = copy_fixture(f"format_v{FORMAT_VERSION}", tmp_path)
    monkeypatch.setattr(resume, "FORMAT_VERSION", FORMAT_VERSION + 1)
    monkeypatch.setattr(resume, "COMPATIBLE_SINCE", FORMAT_VERSION + 1)
    monkeypatch.setattr(resume, "BREAKING_CHANGES", ["metrics-renamed"])
    monkeypatch.setattr(resume, "CONVERTERS", {})
    with pytest.raises(IncompatibleCheckpointError, match="no converter for \\['metrics-renamed'\\]"):
        open_verified(Storage(root), expected["name"])

    def rename_metrics(ck):
        ck.trainer_state["metrics"] = {f"train/{k}": v for k, v in ck.trainer_state["metrics"].items()}

    resume.CONVERTERS["metrics-renamed"] = rename_metrics
    ck = open_verified(Storage(root), expected["name"])
    assert ck.trainer_state["metrics"] == {"train/loss": 1.5, "train/reward": 0.25}


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_each_checksum_algorithm_records_which_readers_can_read_it(algorithm, group2, tmp_path):
    """A job hashing with sha256 writes what format 1 wrote (bare sha256 digests, readable
    from format 1); with BLAKE3 (the default) the checkpoint is readable from format 2,
    and a format-1 reader, which can still verify version.json (always sha256), refuses it
    with the upgrade path rather than calling its files corrupt."""
    import re

    root = str(tmp_path / "root")
    m = manager(root, {"actor": group2}, config={"checksum_algorithm": algorithm})
    try:
        m.update(step=1)
        name = m.save_checkpoint().wait(120)["name"]
    finally:
        m.close(60)
    st = Storage(root)
    ck = open_verified(st, name)
    since = {"sha256": 1, "blake3": 2}[algorithm]
    assert ck.version["format_version"] == FORMAT_VERSION and ck.version["compatible_since"] == since
    digests = {p: e.digest for p, e in ck.manifest.files.items()}
    assert re.fullmatch("[0-9a-f]{64}", digests[f"{name}/{VERSION}"])
    others = [d for p, d in digests.items() if not p.endswith(VERSION)]
    pattern = "[0-9a-f]{64}" if algorithm == "sha256" else "blake3:[0-9a-f]{64}"
    assert others and all(re.fullmatch(pattern, d) for d in others), digests
    assert verify_checkpoint(st, name)["files"] == len(digests)
    with pytest.MonkeyPatch.context() as mp:  # a reader of format 1
        mp.setattr(resume, "FORMAT_VERSION", 1)
        if algorithm == "sha256":
            assert open_verified(st, name).step == 1
        else:
            with pytest.raises(IncompatibleCheckpointError, match=r"Upgrade raycheckpoint to >= 0\.2\.0"):
                open_verified(st, name)
