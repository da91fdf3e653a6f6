"""A manifest names only plain paths inside its root: anything else is a corrupt manifest.

Anyone who can write an unencrypted root can re-seal a manifest (DESIGN section 8).  One
that lists ``../outside.bin`` (a file beside the root, with its real size and checksum)
would have every reader open a file outside the root.  Every reader of a manifest
refuses it, naming the manifest, before it opens any listed path: the load's
``open_verified``, ``raycheckpoint verify`` (and its command line), replication to
another tier, and the start-up check (which passes the checkpoint over, as ``auto`` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from raycheckpoint import IntegrityError, Storage
from raycheckpoint.admin import verify
from raycheckpoint.integrity import digest
from raycheckpoint.protocol.checkpoint import open_verified
from raycheckpoint.protocol.format import Manifest, Marker
from raycheckpoint.protocol.paths import COMMITTED, MANIFEST
from raycheckpoint.protocol.replicate import replicate
from raycheckpoint.protocol.root import RootState
from raycheckpoint.storage import FileEntry
from tests.forgery import NAME, forged_root

BAD = ["../outside.bin", "/etc/hostname", f"{NAME}//actor/x", f"{NAME}/./x", f"{NAME}\\x",
       "s3://bucket/x", "~/x", ""]


def _list_in_manifest(root: str, path: str, data: bytes) -> None:
    """Re-seal ``NAME``'s manifest with ``path`` listed (size and checksum of ``data``)."""
    s = Storage(root)
    manifest = Manifest.from_bytes(s.read_bytes(f"{NAME}/{MANIFEST}"))
    manifest.files[path] = FileEntry(path, len(data), digest.of(data, digest.DEFAULT))
    blob = manifest.to_bytes()
    s.write_bytes(f"{NAME}/{MANIFEST}", blob)
    marker = Marker.from_bytes(s.read_bytes(f"{NAME}/{COMMITTED}"))
    marker = dataclasses.replace(marker, manifest_size=len(blob),
                                 manifest_sha256=hashlib.sha256(blob).hexdigest())
    s.delete(f"{NAME}/{COMMITTED}")
    s.create_marker(f"{NAME}/{COMMITTED}", marker.to_bytes())


@pytest.mark.parametrize("path", BAD)
def test_every_reader_refuses_a_path_that_is_not_plain_and_relative(tmp_path, path):
    root = forged_root(tmp_path)
    outside = Path(root).parent / "outside.bin"
    outside.write_bytes(b"bytes that are not the checkpoint's")
    _list_in_manifest(root, path, outside.read_bytes())
    rel = f"{NAME}/{MANIFEST}"

    with pytest.raises(IntegrityError, match="corrupt manifest") as e:
        open_verified(Storage(root), NAME)
    assert e.value.path == rel

    doc = verify(root)
    assert not doc["ok"] and doc["checkpoints"][0]["path"] == rel

    target = RootState(Storage(str(tmp_path / "copy")))
    target.sync()
    with pytest.raises(IntegrityError, match="corrupt manifest"):
        replicate(Storage(root), target, NAME)
    assert not Storage(str(tmp_path / "copy")).list_files(NAME)


def test_the_command_line_and_the_start_up_check_refuse_it_too(tmp_path):
    from raycheckpoint.errors import CheckpointNotFoundError
    from raycheckpoint.resume import preflight

    root = forged_root(tmp_path)
    outside = Path(root).parent / "outside.bin"
    outside.write_bytes(b"x" * 64)
    _list_in_manifest(root, "../outside.bin", outside.read_bytes())
    cli = subprocess.run([sys.executable, "-m", "raycheckpoint.cli", "verify", root],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "corrupt manifest" in cli.stdout + cli.stderr
    with pytest.warns(RuntimeWarning, match="corrupt manifest"), \
            pytest.raises(CheckpointNotFoundError, match="no committed full checkpoint verifies"):
        preflight(Storage(root), "auto", {}, {"actor": 2}, allow_reshard=False)
