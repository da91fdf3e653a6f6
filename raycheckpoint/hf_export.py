"""Hugging Face exports written beside a committed checkpoint (verl's ``hf_model`` in
``actor_rollout_ref.actor.checkpoint.save_contents``).

:func:`write_beside` exports one role of a committed checkpoint (read through its manifest:
every byte verified) into ``<checkpoint>/huggingface/``: the role's assets (config,
tokenizer) and ``model.safetensors``.  Each file is checksummed while it is written, and
``huggingface/manifest.json``, written last, lists them: an export without it is
incomplete.  :func:`verify_beside` checks the files against it (``raycheckpoint verify``
does).  The export goes with its checkpoint when retention deletes the checkpoint; the
checkpoint's own manifest does not list it, so it never decides whether the checkpoint
loads.  Exports are plaintext: an encrypted root is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from raycheckpoint.errors import IntegrityError, RayCheckpointError
from raycheckpoint.integrity.verify import verify_files
from raycheckpoint.protocol.checkpoint import VerifiedCheckpoint
from raycheckpoint.storage import Storage
from raycheckpoint.storage.spec import FileEntry

EXPORT_DIR = "huggingface"
MANIFEST = "manifest.json"
CHUNK = 64 << 20


def export_dir(name: str) -> str:
    return f"{name}/{EXPORT_DIR}"


def write_beside(ck: VerifiedCheckpoint, role: str = "actor") -> dict[str, Any]:
    """Export ``role`` of ``ck`` into ``<ck>/huggingface/``; the export's manifest."""
    from raycheckpoint.export import export

    if ck.storage.cipher is not None or ck.manifest.encryption:
        raise RayCheckpointError(f"{ck.name}: a Hugging Face export is plaintext and this root is "
                                 "encrypted; export it where plaintext may be, with raycheckpoint export")
    base = export_dir(ck.name)
    with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
        local = os.path.join(tmp, "hf")
        doc = export(ck, local, fmt="hf", role=role)
        files: dict[str, dict[str, Any]] = {}
        for name in sorted(os.listdir(local)):
            entry = _upload(ck.storage, os.path.join(local, name), f"{base}/{name}")
            files[name] = {"size": entry.size, "digest": entry.digest}
    manifest = {"checkpoint": ck.name, "step": ck.step, "role": role, "format": "hf",
                "tensors": doc["tensors"], "files": files}
    ck.storage.write_bytes(f"{base}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def _upload(storage: Storage, path: str, rel: str) -> FileEntry:
    def once() -> FileEntry:
        with storage.open_write(rel) as w, open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                w.write(chunk)
        return w.close()

    return storage.retrying("write", rel, once)


def read_manifest(storage: Storage, name: str) -> dict[str, Any] | None:
    """The export's manifest, or None when ``name`` has no (complete) export."""
    rel = f"{export_dir(name)}/{MANIFEST}"
    if not storage.exists(rel):
        return None
    return json.loads(storage.read_bytes(rel))


def verify_beside(storage: Storage, name: str) -> dict[str, Any] | None:
    """Check ``name``'s export against its manifest: None without an export, else the
    manifest (raises :class:`IntegrityError` naming the first bad file)."""
    try:
        manifest = read_manifest(storage, name)
    except (ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{export_dir(name)}/{MANIFEST} is unreadable: {e}",
                             path=f"{export_dir(name)}/{MANIFEST}") from e
    if manifest is None:
        return None
    base = export_dir(name)
    verify_files(storage, {f"{base}/{n}": FileEntry(f"{base}/{n}", f["size"], f["digest"])
                           for n, f in manifest["files"].items()})
    return manifest
