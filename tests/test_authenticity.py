"""An encrypted root refuses what its key does not vouch for (DESIGN section 8).

With a key, ``COMMITTED`` carries a MAC (HMAC-SHA256 with a key derived from the job's
key) over the marker, which holds the checkpoint's name and the manifest's sha256; and
every data file must be encrypted.  Someone who can write the root but has no key can
recompute every checksum and the marker's manifest digest, not the MAC: each forgery
below is refused naming the file, by a load (explicit or ``auto``, which passes it
over), by ``open_verified`` and by ``raycheckpoint verify --encryption-key``.  The
honest checkpoint loads, verifies and replicates to another tier with its MAC intact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import msgpack
import pytest

from raycheckpoint import IntegrityError, Storage, admin
from raycheckpoint.integrity import digest
from raycheckpoint.integrity.crypto import (
    MAGIC,
    AuthenticationError,
    EncryptionKeyError,
    FileCipher,
    key_id,
)
from raycheckpoint.integrity.verify import read_verified
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.checkpoint import open_verified
from raycheckpoint.protocol.format import Marker
from raycheckpoint.protocol.replicate import replicate
from raycheckpoint.protocol.root import RootState
from tests.helpers import RPC_TIMEOUT, assert_same, full_state, manager, train

pytestmark = pytest.mark.timeout(300)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
STEP = {s: f"step_{s:08d}" for s in (1, 2, 3)}


@pytest.fixture(scope="module")
def sealed(group2, tmp_path_factory):
    """An encrypted root holding steps 1-3 (step 3 tagged), written by a real job, and the
    model and optimizer state of step 1."""
    where = tmp_path_factory.mktemp("sealed")
    key = where / "key"
    key.write_bytes(KEY)
    root = where / "root"
    m = manager(str(root), {"actor": group2}, config={"encryption_key": f"file:{key}"})
    states = {}
    try:
        for step in (1, 2, 3):
            train(group2, [step])
            m.update(step=step)
            m.save_checkpoint(tag="best" if step == 3 else None).wait(RPC_TIMEOUT)
            states[step] = full_state(group2)
    finally:
        m.close(60)
    return {"root": root, "key": f"file:{key}", "states": states}


@pytest.fixture
def root(sealed, tmp_path) -> Path:
    """A copy of the sealed root, for one test to tamper with."""
    copy = tmp_path / "root"
    shutil.copytree(sealed["root"], copy, symlinks=True)  # `latest` stays a link
    return copy


def keyed(root: Path, key: bytes = KEY) -> Storage:
    return Storage(str(root), cipher=FileCipher(key))


# ---- what a writer without the key can do ---------------------------------------------------

def read_manifest(root: Path, name: str) -> dict:
    return msgpack.unpackb((root / name / "manifest.msgpack").read_bytes(), raw=False,
                           strict_map_key=False)


def write_listed(root: Path, doc: dict, rel: str, data: bytes) -> None:
    """Replace file ``rel`` with ``data`` and its manifest entry (in ``doc``) with a fresh
    size and checksum of the same algorithm."""
    (root / rel).write_bytes(data)
    for entry in doc["files"]:
        if entry[0] == rel:
            entry[1], entry[2] = len(data), digest.like(data, entry[2])
            return
    raise AssertionError(f"{rel} not listed")


def reseal(root: Path, name: str, doc: dict, marker_edit: dict | None = None) -> None:
    """Write manifest ``doc`` for ``name`` and re-seal the marker over it: size and sha256
    recomputed (and ``marker_edit`` applied); its MAC, which needs the key, is kept."""
    data = msgpack.packb(doc, use_bin_type=True)
    (root / name / "manifest.msgpack").write_bytes(data)
    marker_path = root / name / "COMMITTED"
    marker = json.loads(marker_path.read_bytes())
    marker.update(manifest_size=len(data), manifest_sha256=hashlib.sha256(data).hexdigest(),
                  **(marker_edit or {}))
    marker_path.write_text(json.dumps(marker))


def plaintext_shard(root: Path, name: str) -> tuple[str, bytes]:
    """A shard of ``name`` and its plaintext (what a DCP save without a key would hold)."""
    rel = f"{name}/actor/__0_0.distcp"
    return rel, FileCipher(KEY).decrypt(rel, (root / rel).read_bytes())


def refused(root: Path, name: str, path: str, match: str, key_ref: str) -> None:
    """``name`` is refused naming ``path`` by open_verified and by verify with the key."""
    with pytest.raises(AuthenticationError, match=match) as e:
        open_verified(keyed(root), name)
    assert e.value.path == path
    doc = admin.verify(str(root / name), key=key_ref)
    assert not doc["ok"] and doc["checkpoints"][0]["path"] == path, doc


# ---- the forgeries --------------------------------------------------------------------------

def test_a_plaintext_shard_with_manifest_and_marker_resealed_is_refused(root, sealed):
    name = STEP[2]
    doc = read_manifest(root, name)
    rel, plain = plaintext_shard(root, name)
    write_listed(root, doc, rel, plain)
    reseal(root, name, doc)
    assert admin.verify(str(root / name))["ok"]  # without the key: checksums only
    refused(root, name, f"{name}/COMMITTED", "authentication code does not match",
            sealed["key"])


def test_a_manifest_rewritten_without_encryption_is_refused(root, sealed):
    name = STEP[2]
    doc = read_manifest(root, name)
    del doc["encryption"]
    reseal(root, name, doc)
    refused(root, name, f"{name}/manifest.msgpack", "is not encrypted.*has no 'encryption'",
            sealed["key"])


def test_a_resealed_trainer_state_is_refused_and_never_replicated(root, sealed, tmp_path):
    name = STEP[2]
    doc = read_manifest(root, name)
    rel = f"{name}/trainer_state.json"
    state = json.loads((root / rel).read_bytes())
    state["global_step"] = 10_000  # resume far ahead: skip the data the job should see
    write_listed(root, doc, rel, json.dumps(state).encode())
    reseal(root, name, doc)
    refused(root, name, f"{name}/COMMITTED", "authentication code does not match",
            sealed["key"])
    # a tier's replication (to the durable tier, or memory) does not spread it either
    target = keyed(tmp_path / "durable")
    with pytest.raises(AuthenticationError) as e:
        replicate(keyed(root), RootState(target), name)
    assert e.value.path == f"{name}/COMMITTED" and not target.list_files()


def test_a_marker_copied_from_another_step_is_refused(root, sealed):
    """Step 1 presented as step 4: its manifest lists the files of step 1 (paths are
    relative to the root), its marker renamed."""
    src, name = STEP[1], "step_00000004"
    (root / name).mkdir()
    shutil.copy(root / src / "manifest.msgpack", root / name / "manifest.msgpack")
    shutil.copy(root / src / "COMMITTED", root / name / "COMMITTED")
    with pytest.raises(IntegrityError, match="marker names"):  # as it is: names step 1
        open_verified(keyed(root), name)
    reseal(root, name, read_manifest(root, name), {"name": name, "step": 4})
    refused(root, name, f"{name}/COMMITTED", "authentication code does not match",
            sealed["key"])


def strip_mac(root: Path, name: str) -> None:
    """``name``'s marker as a release before authenticated markers wrote it."""
    marker_path = root / name / "COMMITTED"
    marker = json.loads(marker_path.read_bytes())
    del marker["mac"]
    marker_path.write_text(json.dumps(marker))


def test_a_marker_without_mac_is_refused_saying_what_to_do(root, sealed):
    """Also what an encrypted checkpoint written before markers were authenticated holds."""
    name = STEP[2]
    strip_mac(root, name)
    refused(root, name, f"{name}/COMMITTED", "carries no authentication code.*raycheckpoint reseal",
            sealed["key"])


def test_reseal_vouches_for_an_old_checkpoint_only_after_checking_it(root, sealed, capsys):
    from raycheckpoint import cli

    name = STEP[2]
    strip_mac(root, name)
    assert cli.main(["reseal", str(root / name), "--encryption-key", sealed["key"]]) == 0
    assert f"sealed {name}" in capsys.readouterr().out
    assert open_verified(keyed(root), name).marker.mac
    assert admin.verify(str(root / name), key=sealed["key"])["ok"]
    assert cli.main(["reseal", str(root / name), "--encryption-key", sealed["key"]]) == 0
    assert "already sealed" in capsys.readouterr().out

    # an old checkpoint with a plaintext shard (its manifest and marker re-sealed): refused
    name = STEP[3]
    doc = read_manifest(root, name)
    rel, plain = plaintext_shard(root, name)
    write_listed(root, doc, rel, plain)
    reseal(root, name, doc)
    strip_mac(root, name)
    assert cli.main(["reseal", str(root / name), "--encryption-key", sealed["key"]]) == 2
    assert f"{rel}: stored in the clear" in capsys.readouterr().err
    # a marker whose MAC is wrong is never sealed again
    reseal(root, STEP[1], read_manifest(root, STEP[1]), {"metrics": {"loss": -1.0}})
    assert cli.main(["reseal", str(root / STEP[1]), "--encryption-key", sealed["key"]]) == 2
    assert "does not match" in capsys.readouterr().err
    with pytest.raises(AuthenticationError):
        open_verified(keyed(root), STEP[1])


def test_a_data_file_in_the_clear_is_refused_naming_it(root):
    """Where nothing else checks a file (checksums off, the size kept: DCP reads by offset,
    so padding is harmless), the missing header does."""
    name = STEP[2]
    rel, plain = plaintext_shard(root, name)
    stored = (root / rel).stat().st_size
    (root / rel).write_bytes(plain + bytes(stored - len(plain)))
    ck = open_verified(keyed(root), name)  # the metadata is untouched and authentic
    with pytest.raises(AuthenticationError, match="stored in the clear") as e:
        read_verified(keyed(root), rel, ck.manifest.files[rel], checksums=False, decrypt=True)
    assert e.value.path == rel
    # without the key a plain file passes through, as on an unencrypted root
    assert read_verified(Storage(str(root)), rel, ck.manifest.files[rel], checksums=False,
                         decrypt=True).startswith(plain[:64])


def test_the_wrong_key_is_refused_as_before(root):
    with pytest.raises(EncryptionKeyError, match=f"key id {key_id(KEY)}.*wrong key") as e:
        open_verified(keyed(root, OTHER), STEP[2])
    # `auto` stops at it: passing over (and quarantining) every checkpoint written under
    # another key would lose them; the person sets the right key
    assert not isinstance(e.value, IntegrityError)
    assert f"{STEP[2]}/manifest.msgpack" in str(e.value)


# ---- the honest checkpoint ------------------------------------------------------------------

def test_the_honest_checkpoint_verifies_and_replicates_with_its_mac(root, sealed, tmp_path,
                                                                    capsys):
    for step, name in STEP.items():
        ck = open_verified(keyed(root), name)
        assert ck.marker.mac and ck.step == step
    doc = admin.verify(str(root), key=sealed["key"])
    assert doc["ok"] and not doc["problems"], doc
    doc = admin.verify(str(root))  # no key: checksums, and a note that says so
    assert doc["ok"] and "authenticity not checked" in doc["problems"][0]
    from raycheckpoint import cli

    assert cli.main(["verify", str(root / STEP[3]), "--encryption-key", sealed["key"]]) == 0
    assert "1 verified, 0 failed" in capsys.readouterr().out

    # another tier: files, manifest and marker copied as stored; the MAC holds there
    name = STEP[3]
    target = tmp_path / "durable"
    replicate(keyed(root), RootState(keyed(target)), name)
    marker = catalog.read_marker(keyed(target), name)
    assert marker == catalog.read_marker(keyed(root), name) and marker.tag == "best"
    assert open_verified(keyed(target), name).marker.mac == marker.mac
    assert admin.verify(str(target), key=sealed["key"])["ok"]
    # the memory tier keeps no tags: a marker without its tag is still authentic
    assert FileCipher(KEY).authentic(dataclasses.asdict(dataclasses.replace(marker, tag=None)))


def test_the_mac_covers_every_field_but_the_tag():
    cipher = FileCipher(KEY)
    marker = Marker(name="step_00000002", step=2, kind="full", manifest_size=10,
                    manifest_sha256="ab" * 32, bytes=99, metrics={"loss": 0.25}, tag="best",
                    committed_at=1700000000.123456)
    assert b"mac" not in marker.to_bytes()  # an unencrypted root's marker is as it was
    assert "mac" not in marker.to_catalog_entry()
    marker.mac = cipher.marker_mac(dataclasses.asdict(marker))
    read = Marker.from_bytes(marker.to_bytes())
    assert read == marker and cipher.authentic(dataclasses.asdict(read))
    assert not FileCipher(OTHER).authentic(dataclasses.asdict(read))
    assert cipher.marker_mac(dataclasses.asdict(marker)) != hashlib.sha256(KEY).hexdigest()
    changes = {"name": "step_00000003", "step": 3, "kind": "light", "manifest_size": 11,
               "manifest_sha256": "cd" * 32, "bytes": 98, "metrics": {"loss": 0.5},
               "committed_at": 1700000000.0}
    for field, value in changes.items():
        forged = dataclasses.replace(read, **{field: value})
        assert not cipher.authentic(dataclasses.asdict(forged)), field
    assert cipher.authentic(dataclasses.asdict(dataclasses.replace(read, tag=None)))


# ---- through a job's load ---------------------------------------------------------------------

def test_a_job_refuses_forgeries_and_auto_passes_them_over(root, sealed, group2):
    """Step 3: a plaintext shard, manifest and marker re-sealed; step 2: a plaintext shard
    padded to its size, nothing re-sealed, read with checksums off."""
    doc = read_manifest(root, STEP[3])
    rel, plain = plaintext_shard(root, STEP[3])
    write_listed(root, doc, rel, plain)
    reseal(root, STEP[3], doc)
    rel2, plain2 = plaintext_shard(root, STEP[2])
    (root / rel2).write_bytes(plain2 + bytes((root / rel2).stat().st_size - len(plain2)))
    assert not (root / rel2).read_bytes().startswith(MAGIC)
    m = manager(str(root), {"actor": group2},
                config={"encryption_key": sealed["key"], "enable_checksum": False})
    try:
        with pytest.raises(AuthenticationError, match="authentication code") as e:
            m.load_checkpoint(3)
        assert e.value.path == f"{STEP[3]}/COMMITTED"
        with pytest.raises(AuthenticationError, match="stored in the clear") as e:
            m.load_checkpoint(2)
        assert e.value.path == rel2
        with pytest.warns(RuntimeWarning, match=f"{STEP[3]} failed verification"):
            assert m.load_checkpoint("auto").name == STEP[1]
        assert_same(sealed["states"][1]["model"], full_state(group2)["model"])
    finally:
        m.close(60)
