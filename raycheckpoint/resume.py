"""Resume-side checks: resolve a reference, verify a checkpoint, compare configs.

``resolve(storage, ref)`` turns a path, step, tag, ``"latest"`` or ``"auto"`` into the
candidate step directories (``auto``: every committed full checkpoint, newest first).
``open_verified`` then checks, before any worker reads a tensor:

1. ``COMMITTED`` exists (nothing ever reads an uncommitted step);
2. the manifest's size and sha256 match the marker;
3. ``version.json`` (listed in the manifest) is compatible;
4. every file the manifest lists exists with its recorded size.

The checksums of the small metadata files are always checked here; the shards' are
checked by the workers as they read them (no second read), when enabled.  Either
algorithm (:mod:`raycheckpoint.digest`) is read, whatever this job writes.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raycheckpoint import catalog
from raycheckpoint.errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    IntegrityError,
)
from raycheckpoint.format import (
    BREAKING_CHANGES,
    COMMITTED,
    COMPATIBLE_SINCE,
    FORMAT_VERSION,
    MANIFEST,
    TRAINER_STATE,
    VERSION,
    Manifest,
    Marker,
    parse_step_dir,
)
from raycheckpoint.integrity import verify_bytes, verify_file
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


def _available(storage: Storage) -> str:
    markers, _ = catalog.scan(storage)
    tags = catalog.read_tags(storage)
    names = ", ".join(f"{m.name} ({m.kind})" for m in markers) or "none"
    tag_text = ", ".join(f"{t} -> {n}" for t, n in sorted(tags.items())) or "none"
    return f"committed checkpoints under {storage.url()}: {names}; tags: {tag_text}"


def split_path_ref(ref: str) -> tuple[str, str] | None:
    """``/root/step_00000010`` or ``s3://b/root/step_00000010/`` -> (root uri, name)."""
    stripped = ref.rstrip("/")
    parent, name = posixpath.split(stripped)
    if parse_step_dir(name) is None or not parent:
        return None
    return parent, name


def locate(storage: Storage, ref: str | int,
           options: dict[str, Any] | None = None) -> tuple[Storage, str | int]:
    """The storage a reference lives in: a path ``<root>/step_N`` may name another root."""
    if not (isinstance(ref, str) and ("/" in ref or "://" in ref)):
        return storage, ref
    split = split_path_ref(ref)
    if split is None:
        raise CheckpointNotFoundError(
            f"{ref!r} is not a checkpoint directory (expected <root>/step_NNNNNNNN)", ref=ref)
    root, name = split
    if root.rstrip("/") in (storage.url().rstrip("/"), storage.uri.rstrip("/")):
        return storage, name
    return Storage(root, dict(options or {}), retries=storage.retries, cipher=storage.cipher), name


def resolve(storage: Storage, ref: str | int) -> list[str]:
    """Candidate step directory names for ``ref`` in ``storage``, best first."""
    markers, _ = catalog.scan(storage)
    committed = {m.name: m for m in markers}
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        step = int(ref)
        hits = sorted((m for m in markers if m.step == step),
                      key=lambda m: (m.kind == "full", m.committed_at), reverse=True)
        if hits:
            return [m.name for m in hits]
        for name in catalog.step_dirs(storage):
            if parse_step_dir(name) == step:
                catalog.read_marker(storage, name)  # an unreadable marker: IntegrityError
        raise CheckpointNotFoundError(f"no committed checkpoint at step {step}; "
                                      + _available(storage), ref=str(ref))
    if ref == "auto":
        return [m.name for m in sorted((m for m in markers if m.kind == "full"),
                                       key=catalog.order_key, reverse=True)]
    if ref == "latest":
        pointed = catalog.read_latest(storage)
        newest = catalog.expected_latest(markers)
        # the markers win over the pointer cache (a crash may sit between them)
        names = [n for n in dict.fromkeys([newest, pointed]) if n in committed]
        if names:
            return names
        raise CheckpointNotFoundError("no committed full checkpoint to resolve 'latest'; "
                                      + _available(storage), ref=ref)
    if parse_step_dir(ref) is not None:
        if ref in committed:
            return [ref]
        catalog.read_marker(storage, ref)  # an unreadable marker: IntegrityError naming it
        raise CheckpointNotFoundError(f"{ref} is not a committed checkpoint; "
                                      + _available(storage), ref=ref)
    tags = catalog.read_tags(storage)
    if ref in tags:
        if tags[ref] in committed:
            return [tags[ref]]
        raise CheckpointNotFoundError(f"tag {ref!r} points to {tags[ref]}, which is not committed; "
                                      + _available(storage), ref=ref)
    raise CheckpointNotFoundError(f"unknown checkpoint reference {ref!r} (give a path, step, tag, "
                                  f"'latest' or 'auto'); " + _available(storage), ref=str(ref))


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


def _read_listed(storage: Storage, manifest: Manifest, rel: str) -> bytes:
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError as e:
        raise IntegrityError(f"{rel}: missing from storage", path=rel) from e
    verify_bytes(rel, data, manifest.files.get(rel), checksums=True)
    return data


def open_verified(storage: Storage, name: str) -> VerifiedCheckpoint:
    """Read and check a committed checkpoint's metadata and file presence and sizes."""
    marker = catalog.read_marker(storage, name)
    if marker is None:
        raise CheckpointNotFoundError(f"{name} has no {COMMITTED} marker; " + _available(storage),
                                      ref=name)
    rel = f"{name}/{MANIFEST}"
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError as e:
        raise IntegrityError(f"{rel}: missing from storage", path=rel) from e
    if len(data) != marker.manifest_size or hashlib.sha256(data).hexdigest() != marker.manifest_sha256:
        raise IntegrityError(f"{rel}: does not match the size/sha256 recorded in {COMMITTED}",
                             path=rel)
    manifest = Manifest.from_bytes(data)
    version = json.loads(_read_listed(storage, manifest, f"{name}/{VERSION}"))
    conversions = check_version(version, name)
    trainer_state = json.loads(_read_listed(storage, manifest, f"{name}/{TRAINER_STATE}"))
    present = storage.list_files(name)
    for path, entry in sorted(manifest.files.items()):
        size = present.get(path)
        if size is None and not path.startswith(name + "/"):
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
    for path in sorted(ck.manifest.files):
        verify_file(storage, path, ck.manifest.files[path], progress)
    return {"name": name, "step": ck.step, "kind": ck.kind, "files": len(ck.manifest.files),
            "bytes": ck.manifest.total_bytes}


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every key whose value differs, as ``(key, saved, current)``; missing shows as None."""
    a, b = flatten(saved), flatten(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def resume_differences(ck: VerifiedCheckpoint, fingerprint: dict[str, Any],
                       world_sizes: dict[str, int], *, allow_reshard: bool) -> list[tuple[str, Any, Any]]:
    """Everything that blocks a strict resume of ``ck`` by a job with this fingerprint."""
    diffs = config_diff(ck.trainer_state.get("config_fingerprint") or {}, fingerprint)
    if not allow_reshard:
        diffs += [(f"world_size.{role}", layout.world_size, world_sizes[role])
                  for role, layout in sorted(ck.manifest.roles.items())
                  if role in world_sizes and layout.world_size != world_sizes[role]]
    return diffs


def format_differences(name: str, diffs: list[tuple[str, Any, Any]]) -> str:
    text = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs)
    return (f"config of {name} differs from this job's in {len(diffs)} key(s): {text}. "
            "Resume with the same config, or pass strict=False to load anyway.")


def preflight(storage: Storage, ref: str | int, fingerprint: dict[str, Any],
              world_sizes: dict[str, int], *, allow_reshard: bool) -> str | None:
    """Before any worker starts: refuse a strict resume that ``load_checkpoint`` would refuse.

    Checks the checkpoint ``ref`` resolves to first (for ``"auto"``: the newest committed
    full one); returns its name, or None when ``"auto"`` finds nothing.  Raises
    ConfigMismatchError listing every difference.
    """
    from raycheckpoint.errors import ConfigMismatchError

    storage, ref = locate(storage, ref, storage.options)
    names = resolve(storage, ref)
    if not names:
        return None
    ck = open_verified(storage, names[0])
    diffs = resume_differences(ck, fingerprint, world_sizes, allow_reshard=allow_reshard)
    if diffs:
        raise ConfigMismatchError(format_differences(ck.name, diffs), differences=diffs)
    return ck.name
