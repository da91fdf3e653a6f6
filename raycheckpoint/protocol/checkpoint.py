"""A committed checkpoint, opened: its metadata read and verified before anything else is.

:func:`open_verified` checks, before any worker reads a tensor:

1. ``COMMITTED`` exists (nothing ever reads an uncommitted step);
2. the manifest's size and sha256 match the marker; with a key (``storage.cipher``), the
   manifest records that key and the marker carries its MAC
   (:func:`~raycheckpoint.integrity.crypto.check_marker`: AuthenticationError otherwise);
3. ``version.json`` (listed in the manifest) is compatible (:func:`check_version`);
4. every file the manifest lists exists with its recorded size.

The checksums of the small metadata files are always checked here; the shards' are
checked by whoever reads them (no second read), and all of them by
:func:`verify_checkpoint` (``raycheckpoint verify``).  Either checksum algorithm
(:mod:`raycheckpoint.integrity.digest`) is read, whatever this job writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from raycheckpoint.errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    IntegrityError,
)
from raycheckpoint.integrity.crypto import check_marker
from raycheckpoint.integrity.verify import missing, read_verified, verify_files
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.format import (
    BREAKING_CHANGES,
    COMPATIBLE_SINCE,
    FORMAT_VERSION,
    Manifest,
    Marker,
)
from raycheckpoint.protocol.paths import COMMITTED, CheckpointPaths
from raycheckpoint.protocol.refs import available
from raycheckpoint.storage import Storage

# breaking change name -> function(VerifiedCheckpoint) -> None converting in memory
CONVERTERS: dict[str, Callable[[VerifiedCheckpoint], None]] = {}


@dataclass
class VerifiedCheckpoint:
    storage: Storage
    name: str
    marker: Marker
    manifest: Manifest
    version: dict[str, Any]
    trainer_state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.marker.step

    @property
    def kind(self) -> str:
        return self.marker.kind

    @property
    def paths(self) -> CheckpointPaths:
        return CheckpointPaths(self.name)


def check_version(version: dict[str, Any], name: str) -> list[str]:
    """Refuse what this library cannot read; return the breaking changes to convert."""
    fmt = int(version.get("format_version", -1))
    since = int(version.get("compatible_since", fmt))
    lib = version.get("library_version", "unknown")
    if since > FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{name} was written in format {fmt} by raycheckpoint {lib}, readable from format "
            f"{since} on; this library reads format {FORMAT_VERSION}. Upgrade raycheckpoint to "
            f">= {lib} to load it.", name=name)
    if fmt < COMPATIBLE_SINCE:
        pending = [c for c in BREAKING_CHANGES if c not in version.get("breaking_changes", [])]
        unknown = [c for c in pending if c not in CONVERTERS]
        if unknown:
            raise IncompatibleCheckpointError(
                f"{name} is in format {fmt}; this library reads formats >= {COMPATIBLE_SINCE} and "
                f"has no converter for {unknown}. Load it with raycheckpoint {lib} and re-save.",
                name=name)
        return pending
    return []


def read_committed(storage: Storage, name: str, *, authenticate: bool = True
                   ) -> tuple[Marker, bytes, Manifest]:
    """The marker, the manifest's bytes and the manifest of committed checkpoint ``name``:
    the manifest checked against the marker's size and sha256 and, with a key
    (``storage.cipher``) unless ``authenticate`` is False, the marker against the key
    (:func:`~raycheckpoint.integrity.crypto.check_marker`).  CheckpointNotFoundError (a
    FileNotFoundError) when ``name`` is not committed; IntegrityError naming the file."""
    marker = catalog.read_marker(storage, name)
    if marker is None:
        raise CheckpointNotFoundError(f"{name} has no {COMMITTED} marker; " + available(storage),
                                      ref=name)
    paths = CheckpointPaths(name)
    rel = paths.manifest
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError as e:
        raise missing(rel) from e
    if len(data) != marker.manifest_size or hashlib.sha256(data).hexdigest() != marker.manifest_sha256:
        raise IntegrityError(f"{rel}: does not match the size/sha256 recorded in {COMMITTED}",
                             path=rel)
    manifest = Manifest.from_bytes(data, rel)
    if authenticate and storage.cipher is not None:  # only what the key vouches for (DESIGN 8)
        check_marker(storage.cipher, asdict(marker), manifest.encryption, name,
                     marker_path=paths.committed, manifest_path=rel)
    return marker, data, manifest


def open_verified(storage: Storage, name: str) -> VerifiedCheckpoint:
    """Read and check a committed checkpoint's metadata and file presence and sizes."""
    marker, _, manifest = read_committed(storage, name)
    paths = CheckpointPaths(name)
    version = json.loads(read_verified(storage, paths.version, manifest.files.get(paths.version)))
    conversions = check_version(version, name)
    trainer_state = json.loads(read_verified(storage, paths.trainer_state,
                                             manifest.files.get(paths.trainer_state)))
    present = storage.list_files(name)
    for path, entry in sorted(manifest.files.items()):
        size = present.get(path)
        if size is None and not paths.holds(path):
            size = storage.size(path) if storage.exists(path) else None
        if size is None:
            raise IntegrityError(f"{path}: listed in the manifest of {name} but missing", path=path)
        if size != entry.size:
            raise IntegrityError(f"{path}: {size} bytes on storage, manifest says {entry.size} "
                                 "(truncated or overwritten)", path=path)
    ck = VerifiedCheckpoint(storage, name, marker, manifest, version, trainer_state)
    for change in conversions:
        CONVERTERS[change](ck)
    return ck


def verify_checkpoint(storage: Storage, name: str,
                      progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Full verification of a committed checkpoint: every listed byte hashed, streamed.

    What ``raycheckpoint verify`` runs.  ``progress(n)`` is called per chunk read.  Raises
    IntegrityError (naming the file) or IncompatibleCheckpointError; returns a summary.
    """
    ck = open_verified(storage, name)
    verify_files(storage, ck.manifest.files, progress)
    return summary(ck)


def summary(ck: VerifiedCheckpoint) -> dict[str, Any]:
    """What a verification reports of a checkpoint it checked."""
    return {"name": ck.name, "step": ck.step, "kind": ck.kind, "files": len(ck.manifest.files),
            "bytes": ck.manifest.total_bytes}
