"""Forged, re-sealed checkpoints for the tests: what anyone who can write an unencrypted
root can do (DESIGN section 8).

:func:`forged_root` copies a checked-in fixture checkpoint; :func:`reseal` replaces (or
adds) files and writes the manifest entries, the manifest and ``COMMITTED`` to match, so
that every checksum holds; the payloads are pickles that would run a shell command
creating a file, so a test proves they never ran by that file's absence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import shlex
import shutil
from pathlib import Path

import torch

from raycheckpoint.integrity import digest
from raycheckpoint.protocol.format import Manifest, Marker
from raycheckpoint.protocol.paths import COMMITTED, MANIFEST
from raycheckpoint.storage import FileEntry, Storage

FIXTURES = Path(__file__).parent / "fixtures"
NAME = "step_00000003"  # the fixtures' checkpoint: a 2-rank actor (model, AdamW, scheduler)
METADATA = f"{NAME}/actor/.metadata"


class Shell:
    """Unpickling this runs ``cmd`` (what a forged pickle would do)."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def touch(flag: Path) -> Shell:
    return Shell(f"touch {shlex.quote(str(flag))}")


def forged_root(tmp_path: Path, fixture: str = "format_v2") -> str:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / fixture / "root", root)
    return str(root)


def reseal(root: str, changes: dict[str, bytes], name: str = NAME) -> None:
    """Write ``changes`` (path relative to the root -> bytes) and re-seal ``name``: each
    file's manifest entry (its size and checksum), the manifest, the marker."""
    s = Storage(root)
    manifest = Manifest.from_bytes(s.read_bytes(f"{name}/{MANIFEST}"))
    for rel, data in changes.items():
        s.write_bytes(rel, data)
        old = manifest.files.get(rel)
        manifest.files[rel] = FileEntry(rel, len(data), digest.like(data, old.digest) if old
                                        else digest.of(data, digest.DEFAULT))
    blob = manifest.to_bytes()
    s.write_bytes(f"{name}/{MANIFEST}", blob)
    marker = Marker.from_bytes(s.read_bytes(f"{name}/{COMMITTED}"))
    marker = dataclasses.replace(marker, manifest_size=len(blob),
                                 manifest_sha256=hashlib.sha256(blob).hexdigest())
    s.delete(f"{name}/{COMMITTED}")
    s.create_marker(f"{name}/{COMMITTED}", marker.to_bytes())


def metadata(root: str) -> object:
    """The fixture's own (trusted) DCP metadata."""
    return pickle.loads(Storage(root).read_bytes(METADATA))  # a checked-in fixture: trusted


def forge_metadata(root: str, flag: Path) -> None:
    """``.metadata`` still holding the checkpoint's metadata, plus a command that unpickling
    it with pickle would run (the load would then go on as if nothing happened)."""
    md = metadata(root)
    md.storage_meta.modules = [touch(flag)]
    reseal(root, {METADATA: pickle.dumps(md)})


def forge_item(root: str, fqn: str, obj: object) -> str:
    """Point item ``fqn`` at a new ``torch.save`` record of ``obj`` appended to its file;
    returns that file."""
    import io

    md = metadata(root)
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    rel = f"{NAME}/actor/{info.relative_path}"
    s = Storage(root)
    data = s.read_bytes(rel)
    buf = io.BytesIO()
    torch.save(obj, buf)
    record = buf.getvalue()
    md.storage_data[index] = dataclasses.replace(info, offset=len(data), length=len(record))
    reseal(root, {rel: data + record, METADATA: pickle.dumps(md)})
    return rel


def add_hf_config(root: str) -> None:
    """A Hugging Face config.json among the actor's assets (what an ``hf`` export needs)."""
    reseal(root, {f"{NAME}/assets/actor/config.json": b'{"model_type": "tinylm"}'})
