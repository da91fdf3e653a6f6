"""What a root holds: committed markers, the catalog cache, LATEST, tags, verifications.

Truth is on storage: the set of step directories holding ``COMMITTED``.
``catalog.json`` and ``LATEST`` are caches of it; :func:`scan` reads the markers
themselves, and :func:`expected_latest` / :func:`catalog_doc` say what the caches
should hold.  The caches and tag pointers are written here and nowhere else
(:func:`write_catalog`, :func:`write_latest`, :func:`write_tag`), by the coordinator
(:mod:`~raycheckpoint.protocol.root`) and by ``raycheckpoint tag`` / ``untag``.
``verification.json`` holds the results of background verification (checkpoint name
-> ``{"ok", "verified_at", "error", ...}``); only the coordinator writes it
(:func:`write_verification`), and the catalog's entries repeat them.
Readers: the coordinator (recovery, retention), resume (resolving a reference), admin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raycheckpoint.errors import IntegrityError
from raycheckpoint.protocol.format import FORMAT_VERSION, Marker, Quarantine, json_bytes
from raycheckpoint.protocol.paths import (
    CATALOG,
    LATEST,
    LATEST_LINK,
    TAGS_DIR,
    VERIFICATION,
    CheckpointPaths,
    parse_step_dir,
    tag_path,
)
from raycheckpoint.storage import Storage


def order_key(m: Marker | dict[str, Any]) -> tuple[int, float]:
    if isinstance(m, Marker):
        return (m.step, m.committed_at)
    return (m["step"], m.get("committed_at", 0.0))


def step_dirs(storage: Storage) -> list[str]:
    return [n for n in storage.list_dir("") if parse_step_dir(n) is not None]


def read_marker(storage: Storage, name: str) -> Marker | None:
    """The marker of ``name``; None when absent; IntegrityError when unreadable."""
    rel = CheckpointPaths(name).committed
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return None
    try:
        marker = Marker.from_bytes(data)
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{rel}: unreadable commit marker ({type(e).__name__}: {e})",
                             path=rel) from None
    if marker.name != name:
        raise IntegrityError(f"{rel}: marker names {marker.name!r}, not {name!r}", path=rel)
    return marker


def read_quarantine(storage: Storage, name: str) -> Quarantine | None:
    """Why ``name`` was set aside (``QUARANTINED``); None when it was not; an unreadable
    record counts as a quarantine too (its reason says so): it is never read, never
    collected as garbage."""
    rel = CheckpointPaths(name).quarantined
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return None
    try:
        return Quarantine.from_bytes(data)
    except (ValueError, KeyError, TypeError) as e:
        step = parse_step_dir(name) or 0
        return Quarantine(Marker(name=name, step=step, kind="full", manifest_size=0,
                                 manifest_sha256="", bytes=0, committed_at=0.0),
                          f"unreadable {rel} ({type(e).__name__}: {e})", quarantined_at=0.0)


@dataclass
class RootScan:
    """What the step directories of a root hold (see :func:`scan_root`)."""

    committed: list[Marker]  # oldest first
    uncommitted: list[str]  # no marker and not quarantined: garbage once no save writes them
    corrupt: dict[str, IntegrityError]  # an unreadable marker: never read, never collected
    quarantined: dict[str, Quarantine]  # set aside: never read, removed only by gc


def scan_root(storage: Storage) -> RootScan:
    """Every step directory's state: one read of its marker (and, where it has none, one
    of ``QUARANTINED``)."""
    scan = RootScan([], [], {}, {})
    for name in step_dirs(storage):
        try:
            marker = read_marker(storage, name)
        except IntegrityError as e:
            scan.corrupt[name] = e
            continue
        if marker is not None:
            scan.committed.append(marker)
        elif (q := read_quarantine(storage, name)) is not None:
            scan.quarantined[name] = q
        else:
            scan.uncommitted.append(name)
    scan.committed.sort(key=order_key)
    return scan


def scan_all(storage: Storage) -> tuple[list[Marker], list[str], dict[str, IntegrityError]]:
    """(committed markers oldest first, step dirs without a marker, dirs whose marker is
    unreadable -> the error).  A corrupt marker is neither committed nor garbage: such a
    directory is never read and never collected; `raycheckpoint verify` reports it.
    Quarantined directories are in none of them (:func:`scan_root`)."""
    scan = scan_root(storage)
    return scan.committed, scan.uncommitted, scan.corrupt


def scan(storage: Storage) -> tuple[list[Marker], list[str]]:
    """(committed markers oldest first, step directories without a marker)."""
    committed, uncommitted, _ = scan_all(storage)
    return committed, uncommitted


def read_pointer(storage: Storage, rel: str) -> str | None:
    try:
        return storage.read_bytes(rel).decode().strip() or None
    except FileNotFoundError:
        return None


def read_latest(storage: Storage) -> str | None:
    return read_pointer(storage, LATEST)


def read_tags(storage: Storage) -> dict[str, str]:
    tags = {}
    for tag in storage.list_dir(TAGS_DIR):
        if tag.startswith(".tmp-"):
            continue
        target = read_pointer(storage, tag_path(tag))
        if target:
            tags[tag] = target
    return tags


def expected_latest(markers: list[Marker]) -> str | None:
    full = [m for m in markers if m.kind == "full"]
    return max(full, key=order_key).name if full else None


def catalog_doc(markers: list[Marker], tags: dict[str, str],
                verified: dict[str, dict[str, Any]] | None = None,
                quarantined: dict[str, Quarantine] | None = None) -> dict[str, Any]:
    entries = []
    for m in sorted(markers, key=order_key):
        entry = m.to_catalog_entry()
        if verified and m.name in verified:
            entry["verified"] = verified[m.name]
        entries.append(entry)
    doc = {
        "format_version": FORMAT_VERSION,
        "latest": expected_latest(markers),
        "tags": dict(sorted(tags.items())),
        "checkpoints": entries,
    }
    if quarantined:
        doc["quarantined"] = [q.to_catalog_entry() for _, q in sorted(quarantined.items())]
    return doc


def read_verification(storage: Storage) -> dict[str, dict[str, Any]]:
    """Background verification results by checkpoint name ({} when none or unreadable)."""
    try:
        doc = json.loads(storage.read_bytes(VERIFICATION))
    except (FileNotFoundError, ValueError):
        return {}
    results = doc.get("checkpoints") if isinstance(doc, dict) else None
    return {k: v for k, v in (results or {}).items() if isinstance(v, dict)}


def write_verification(storage: Storage, results: dict[str, dict[str, Any]]) -> None:
    storage.write_pointer(VERIFICATION, json_bytes({"format_version": FORMAT_VERSION,
                                                    "checkpoints": dict(sorted(results.items()))}))


def newest_verified(markers: list[Marker], verified: dict[str, dict[str, Any]]) -> str | None:
    """The newest committed checkpoint whose verification passed."""
    ok = [m for m in markers if verified.get(m.name, {}).get("ok")]
    return max(ok, key=order_key).name if ok else None


def read_catalog(storage: Storage) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_bytes(CATALOG))
    except FileNotFoundError:
        return None
    except ValueError:
        return None  # a torn or corrupt cache is rebuilt from the markers


def write_catalog(storage: Storage, markers: list[Marker], tags: dict[str, str],
                  verified: dict[str, dict[str, Any]] | None = None,
                  quarantined: dict[str, Quarantine] | None = None) -> None:
    """Replace ``catalog.json`` with the catalog of ``markers``, ``tags``, ``verified``
    and ``quarantined``."""
    storage.write_pointer(CATALOG, json_bytes(catalog_doc(markers, tags, verified, quarantined)))


def write_latest(storage: Storage, name: str) -> None:
    """Point ``LATEST`` (and, where the backend has symlinks, ``latest``) at ``name``."""
    storage.write_pointer(LATEST, (name + "\n").encode())
    storage.symlink(LATEST_LINK, name)


def write_tag(storage: Storage, tag: str, name: str) -> None:
    """Point ``tag`` at the checkpoint ``name``."""
    storage.write_pointer(tag_path(tag), (name + "\n").encode())
