"""Resolving a checkpoint reference: a path, a step, a tag, ``"latest"`` or ``"auto"``.

:func:`resolve` turns a reference into the candidate step directories of a root, best
first (``auto``: every committed full checkpoint, newest first); only committed ones
(a ``COMMITTED`` marker) are ever candidates.  :func:`locate` finds the root a path
reference (``<root>/step_N``) lives in.  Errors name what the root does hold.
"""

from __future__ import annotations

import posixpath
from typing import Any

from raycheckpoint.errors import CheckpointNotFoundError
from raycheckpoint.protocol import catalog
from raycheckpoint.protocol.paths import parse_step_dir
from raycheckpoint.storage import Storage


def available(storage: Storage) -> str:
    """What ``storage`` holds, for an error message."""
    scan = catalog.scan_root(storage)
    tags = catalog.read_tags(storage)
    names = ", ".join(f"{m.name} ({m.kind})" for m in scan.committed) or "none"
    tag_text = ", ".join(f"{t} -> {n}" for t, n in sorted(tags.items())) or "none"
    text = f"committed checkpoints under {storage.url()}: {names}; tags: {tag_text}"
    if scan.quarantined:
        text += "; quarantined (never loaded): " + ", ".join(
            f"{n} ({q.reason})" for n, q in sorted(scan.quarantined.items()))
    return text


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
                                      + available(storage), ref=str(ref))
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
                                      + available(storage), ref=ref)
    if parse_step_dir(ref) is not None:
        if ref in committed:
            return [ref]
        catalog.read_marker(storage, ref)  # an unreadable marker: IntegrityError naming it
        raise CheckpointNotFoundError(f"{ref} is not a committed checkpoint; "
                                      + available(storage), ref=ref)
    tags = catalog.read_tags(storage)
    if ref in tags:
        if tags[ref] in committed:
            return [tags[ref]]
        raise CheckpointNotFoundError(f"tag {ref!r} points to {tags[ref]}, which is not committed; "
                                      + available(storage), ref=ref)
    raise CheckpointNotFoundError(f"unknown checkpoint reference {ref!r} (give a path, step, tag, "
                                  f"'latest' or 'auto'); " + available(storage), ref=str(ref))
